"""A worker group's KV caches in one file of shared memory that any process on the node maps.

The driver allocates the caches (`SharedCaches`: one zeroed file under /dev/shm, every tensor a
view of it) and hands each rank small picklable `SharedTensor` descriptors, so a rank maps its
caches the same way whatever started it (a spawned process, a Ray actor). What a rank writes
lands in the driver's views, where the transfer layer reads it.

The file is unlinked once every rank has mapped it: the mappings stay valid until their last
user drops them, and nothing is left in /dev/shm when a process dies later.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.engine.kv_cache.host_memory import advise_huge_pages

SHM_DIR = "/dev/shm"
FILE_PREFIX = "cleave-kv-"  # then the driver's pid and a random suffix


@dataclass(frozen=True)
class SharedTensor:
    """Where one tensor lives: elements [offset, offset + prod(shape)) of a file of `dtype`s."""

    path: str
    file_numel: int  # the whole file, in elements of `dtype`
    offset: int  # in elements of `dtype`
    shape: tuple[int, ...]
    dtype: str  # a torch dtype name, e.g. "bfloat16"


def map_tensors(refs: Sequence[SharedTensor]) -> list[torch.Tensor]:
    """The tensors `refs` describe, in order, mapping each file once. Raises
    `FileNotFoundError` once the file has been unlinked (map before reporting ready)."""
    files: dict[str, torch.Tensor] = {}
    tensors = []
    for ref in refs:
        flat = files.get(ref.path)
        if flat is None:
            flat = _map_file(ref.path, ref.file_numel, getattr(torch, ref.dtype))
            files[ref.path] = flat
        tensors.append(_view(flat, ref))
    return tensors


def _map_file(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """[numel] over a shared mapping of the existing file `path` (never creates it, unlike
    `torch.from_file`: a late mapper must not leave a new file behind)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    fd = os.open(path, os.O_RDWR)
    try:
        buffer = mmap.mmap(fd, numel * itemsize)  # MAP_SHARED; outlives the fd and the name
    finally:
        os.close(fd)
    return torch.frombuffer(buffer, dtype=dtype, count=numel)  # keeps `buffer` alive


def _view(flat: torch.Tensor, ref: SharedTensor) -> torch.Tensor:
    return flat[ref.offset:ref.offset + math.prod(ref.shape)].view(ref.shape)


class SharedCaches:
    """`count` zeroed tensors of `shape` in one new file, mapped in this process (`tensors`,
    `refs[i]` describing `tensors[i]`). Each tensor starts on a page boundary. Call `unlink()`
    once every user has mapped the file, and on failure (idempotent).

    NOTE: the caches count against /dev/shm's size (64 MiB in a default Docker container; the
    Helm chart mounts a larger one, `shmSize`)."""

    def __init__(self, count: int, shape: tuple[int, ...], dtype: torch.dtype,
                 directory: str | None = None) -> None:
        if count < 1 or math.prod(shape) < 1:
            raise ValueError(f"shared caches need at least one element: {count} tensors of "
                             f"shape {shape}")
        directory = directory or (SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir())
        self.path = os.path.join(directory, f"{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = math.prod(shape)
        page = mmap.PAGESIZE // itemsize  # a page, in elements
        stride = -(-numel // page) * page
        file_numel = stride * (count - 1) + numel
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, file_numel * itemsize)  # reads as zeros; pages come on first touch
        finally:
            os.close(fd)
        try:
            flat = _map_file(self.path, file_numel, dtype)
            advise_huge_pages(flat)  # before the first touch
            name = str(dtype).removeprefix("torch.")
            self.refs = [SharedTensor(self.path, file_numel, i * stride, tuple(shape), name)
                         for i in range(count)]
            self.tensors = [_view(flat, ref) for ref in self.refs]
        except BaseException:
            self.unlink()
            raise

    def unlink(self) -> None:
        """Remove the file; mappings made before stay valid (idempotent)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
