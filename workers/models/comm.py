"""Collectives over one torch.distributed process group, with byte and time accounting.

Every collective the model issues goes through a `Communicator`, tagged with a site name
("attn", "mlp", "moe_dispatch" ...), so a benchmark can read the bytes each rank handed to the
network per site and the seconds spent inside collectives. Bytes are the logical payload this
rank passes in (the input tensor of an all-reduce, all-gather, all-to-all or send), not the
algorithm's wire traffic.

Every tensor a collective or a pipeline transfer touches lives on the process group's device:
the CPU for gloo, this rank's GPU for NCCL (which rejects host tensors). On a GPU the calls
return once the transfer is queued on the current stream, so the seconds counted there are
host time, not transfer time.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

CPU = torch.device("cpu")


@dataclass
class CommStats:
    """Counters since the last `reset()`; mutated by the communicators that share it."""

    bytes_by_site: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls_by_site: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: float = 0.0  # wall time inside collectives (includes waiting for slower ranks)

    def add(self, site: str, tensor: torch.Tensor, seconds: float) -> None:
        self.bytes_by_site[site] += tensor.numel() * tensor.element_size()
        self.calls_by_site[site] += 1
        self.seconds += seconds

    def reset(self) -> None:
        self.bytes_by_site.clear()
        self.calls_by_site.clear()
        self.seconds = 0.0

    def snapshot(self) -> dict[str, object]:
        return {"bytes_by_site": dict(self.bytes_by_site),
                "calls_by_site": dict(self.calls_by_site), "seconds": self.seconds}


class Communicator:
    """Collectives among `ranks` (global ranks, in group order); this process is `rank` in it.

    `group=None` means the default (world) group. `device`: where the group's tensors live
    (the CPU for gloo, this rank's GPU for NCCL); the tensors this class creates go there.
    Not thread-safe.
    """

    def __init__(self, group: object | None, ranks: list[int], rank: int,
                 stats: CommStats | None = None,
                 device: torch.device = CPU) -> None:
        if not 0 <= rank < len(ranks):
            raise ValueError(f"rank {rank} is not in a group of {len(ranks)} ranks")
        self.group, self.ranks, self.rank = group, list(ranks), rank
        self.size = len(ranks)
        self.stats = stats if stats is not None else CommStats()
        self.device = device

    @classmethod
    def world(cls) -> Communicator:
        """The default group (torch.distributed must be initialized); on NCCL its device is
        the current CUDA device."""
        size = dist.get_world_size()
        return cls(None, list(range(size)), dist.get_rank(), device=backend_device())

    def all_reduce(self, x: torch.Tensor, site: str) -> torch.Tensor:
        """Sums `x` over the group in place; returns it."""
        start = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.stats.add(site, x, time.perf_counter() - start)
        return x

    def all_gather(self, x: torch.Tensor, site: str, dim: int = 0) -> torch.Tensor:
        """Concatenates every rank's `x` (same shape on every rank) along `dim`, in rank order."""
        start = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        self.stats.add(site, x, time.perf_counter() - start)
        return torch.cat(parts, dim=dim)

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                   site: str) -> torch.Tensor:
        """Sends rows `x[sum(send_counts[:r]):...]` to rank r; returns the rows received, in
        rank order. x: [sum(send_counts), *row] -> [sum(recv_counts), *row]."""
        start = time.perf_counter()
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.group)
        self.stats.add(site, x, time.perf_counter() - start)
        return out

    def exchange_counts(self, send_counts: list[int], site: str) -> list[int]:
        """Each rank tells every other how many rows it will send it; returns what each sends
        this rank."""
        counts = torch.tensor(send_counts, dtype=torch.int64, device=self.device)
        received = self.all_to_all(counts, [1] * self.size, [1] * self.size, site)
        return received.tolist()


class StageLink:
    """Point-to-point hidden-state transfer between pipeline stages (global ranks); received
    tensors are allocated on `device` (the default group's: the CPU for gloo, this rank's GPU
    for NCCL)."""

    def __init__(self, stats: CommStats, device: torch.device) -> None:
        self.stats, self.device = stats, device

    def send(self, x: torch.Tensor, dst: int) -> object:
        """Starts sending `x` to global rank `dst`; returns the work to `wait()` on."""
        start = time.perf_counter()
        work = dist.isend(x.contiguous(), dst)
        self.stats.add("pp", x, time.perf_counter() - start)
        return work

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        start = time.perf_counter()
        out = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(out, src)  # NCCL: queued on the current stream; later kernels wait for it
        self.stats.seconds += time.perf_counter() - start
        return out


def backend_device() -> torch.device:
    """Where the default process group's tensors must live: the current CUDA device for NCCL,
    else the CPU (torch.distributed must be initialized)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return CPU
