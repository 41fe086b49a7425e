"""KV cache sizing of a GPU worker group: every rank measures its own budget, the group takes the
smallest.

A group started with a `KVProfile` starts in two phases: each rank loads its shard and runs the
largest step (the driver built it: `memory_profile.profile_step`) with the whole group on a
throw-away cache, then reports its device's readings (`MemoryReport`); the driver turns each
into a budget by the single-process engine's arithmetic (`memory_profile.kv_budget_bytes`,
passed in as `KVSizing.budget`: this package does not import the profiler, which runs a
`LocalExecutor`), sizes the cache by the rank with the least room for its own share of a block
(`group_num_blocks`) and sends every rank its `AllocateCaches`.
Ranks are not alike: the last stage holds the LM head, the first the embedding, and another
process may share a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from workers.engine.parallel.messages import MemoryReport, StepMessage


@dataclass(frozen=True)
class KVProfile:
    """The step every rank runs to measure its peak memory (part of its `RankSetup`)."""

    step: StepMessage  # the largest step the scheduler builds (`memory_profile.profile_step`)
    num_blocks: int  # blocks of the throw-away cache it runs on


@dataclass(frozen=True)
class KVSizing:
    """How the driver sizes a group's cache by profiling (stays in the driver)."""

    profile: KVProfile
    budget: Callable[[MemoryReport], int]  # a rank's readings -> bytes its KV may take


def measure_rank_memory(rank: int, run_step: Callable[[StepMessage, int], None],
                        device: torch.device, profile: KVProfile) -> MemoryReport:
    """Runs the profile step through `run_step(msg, num_blocks)` (the rank's own step, on a
    cache of `num_blocks` it drops afterwards; every rank of the group must run it at once:
    collectives) and reads `device`'s (CUDA) memory, as `memory_profile.gpu_kv_budget` does."""
    msg, num_blocks = profile.step, profile.num_blocks
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run_step(msg, num_blocks)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)  # weights + activations + profile cache
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    return MemoryReport(rank, total, peak, outside_torch)


def group_num_blocks(reports: Sequence[MemoryReport], budget: Callable[[MemoryReport], int],
                     bytes_per_block: Sequence[int]) -> int:
    """KV blocks of the group's cache: the fewest any rank has room for, rank r's `budget`
    holding `bytes_per_block[r]` of each block (its stage's layers, its heads). Raises
    `ValueError` naming the rank when one has room for none."""
    if len(reports) != len(bytes_per_block) or not reports:
        raise ValueError(f"{len(reports)} memory reports for {len(bytes_per_block)} ranks")
    budgets = [budget(r) for r in reports]
    fits = [max(0, b) // per_block for b, per_block in zip(budgets, bytes_per_block)]
    least = min(range(len(fits)), key=fits.__getitem__)
    if fits[least] < 1:
        r = reports[least]
        raise ValueError(
            f"rank {r.rank} has no GPU memory left for the KV cache: {budgets[least]} bytes "
            f"after its shard and a profiled step ({r.peak_bytes / 2**30:.2f} GiB peak, "
            f"{r.outside_torch_bytes / 2**30:.2f} GiB outside torch, of "
            f"{r.total_bytes / 2**30:.1f} GiB) hold no block of {bytes_per_block[least]} "
            "bytes; raise gpu_memory_utilization or lower max_num_batched_tokens")
    return fits[least]
