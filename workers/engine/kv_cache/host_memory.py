"""Host memory for KV caches: zeroed tensors backed by transparent huge pages where the kernel
offers them (Linux, `madvise` mode or `always`), committed as they are first written.

Huge pages matter for the KV handoff: a decode worker on the same node pulls the cache with one
`process_vm_readv` (UCX's CMA) per segment, and the kernel walks 512x fewer pages. Measured with
`benchmarks/kv_transfer.py` (1 GiB between two processes): 6.6 GB/s with huge pages against
4.5 GB/s without. The advice is given before the first touch; where it is refused the tensor is
an ordinary one.

The memory is an anonymous mapping, zero until written: the kernel commits a page when a block
is first written, so an engine starts without writing its whole cache (the tiny model's default
512 MiB took 0.03-0.36 s to zero, the high end while the kernel compacted memory for huge
pages) and a process's resident memory is the part of its cache in use.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys

import torch

MADV_HUGEPAGE = 14  # linux/mman.h


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages under `t`'s whole pages (call before touching it); False when the
    platform or kernel refuses."""
    if sys.platform != "linux" or t.device.type != "cpu":
        return False
    start = -(-t.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE  # madvise takes whole pages
    end = (t.data_ptr() + t.numel() * t.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
    if end <= start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(start, end - start, MADV_HUGEPAGE) == 0


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
          huge_pages: bool = True) -> torch.Tensor:
    """`torch.zeros(shape)`; on the host an anonymous mapping (committed when written), backed
    by huge pages when `huge_pages` (and allowed)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # the tensor keeps the mapping alive (torch.frombuffer holds a reference to it)
    t = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
    if huge_pages:
        advise_huge_pages(t)
    return t
