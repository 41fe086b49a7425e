"""A step's host<->device transfers, in one place.

A GPU step should make exactly one host synchronisation: the copy of its sampled tokens back
to the host (`download`). Everything else a step needs from the host (token ids, positions,
slot mappings, block tables, the prefill tile list, sampling parameters) goes up with `upload`,
which stages the values in pinned memory and copies them without waiting for the device. A
transfer anywhere else in a step (`torch.tensor(list, device=...)`, `.item()`, `.tolist()`,
`.cpu()`, indexing with a Python list, a data-dependent shape such as `torch.unique`) waits for
the device; `tests/workers/test_host_syncs.py` counts them as stray syncs.

`gpu_paths(device)` is the one switch between a code path's GPU form (no host reads of device
values) and its CPU form (where host reads cost nothing and plain loops are faster). Tests run
the GPU forms on CPU tensors under `simulate_gpu_paths()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch

_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
                 torch.float64: np.float64}
_simulated = False


def gpu_paths(device: torch.device) -> bool:
    """Whether code on `device` takes its sync-free GPU form: on CUDA, or under
    `simulate_gpu_paths`."""
    return device.type == "cuda" or _simulated


@contextlib.contextmanager
def simulate_gpu_paths() -> Iterator[None]:
    """Within it, CPU tensors take the GPU forms (for tests: not thread-safe, not nestable)."""
    global _simulated
    _simulated = True
    try:
        yield
    finally:
        _simulated = False


def upload(values: Sequence[int] | Sequence[float] | np.ndarray, device: torch.device,
           dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-D `dtype` tensor of `values` on `device`. On a GPU the values are staged in pinned
    memory (PyTorch's caching host allocator keeps the block until the copy has run) and copied
    asynchronously: the host does not wait. On the CPU it is just the host tensor."""
    if dtype not in _NUMPY_DTYPES:
        raise ValueError(f"upload dtype must be one of {sorted(map(str, _NUMPY_DTYPES))}, "
                         f"got {dtype}")
    # numpy builds a tensor from a list of ints about 5x faster than torch.tensor
    host = torch.from_numpy(np.asarray(values, dtype=_NUMPY_DTYPES[dtype]))
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def download(tensor: torch.Tensor) -> list:
    """`tensor.tolist()`: the step's one host synchronisation (it waits for the device)."""
    return tensor.tolist()


class PendingDownload:
    """A copy of a device tensor to the host, started without waiting (`start_download`):
    `wait()` is the step's one host synchronisation, made when the host needs the values."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event = None
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            tensor = host
        self._host = tensor

    def wait(self) -> list:
        """The values as a list, once the copy has landed (waits for it, not for later work
        queued on the device)."""
        if self._event is not None:
            self._event.synchronize()
        return download(self._host)


def start_download(tensor: torch.Tensor) -> PendingDownload:
    """Start copying `tensor` to the host: on a GPU into pinned memory, non-blocking, with an
    event to wait on; on the CPU there is nothing to copy."""
    return PendingDownload(tensor)
