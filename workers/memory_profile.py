"""How much GPU memory the KV cache may take: measured, not guessed.

The budget is `gpu_memory_utilization` of the device's total memory, less what the weights and
the largest step's activations need at their peak, less what other processes (and the CUDA
context) hold. The peak is measured by running one forward of `max_num_batched_tokens` tokens
(the largest step the scheduler will ever build) against a throw-away cache, as vLLM does.
CUDA graphs' own memory pool comes out of the `1 - gpu_memory_utilization` left over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from workers.parallel.executor import LocalExecutor
from workers.parallel.messages import StepMessage
from workers.scheduler import PROMPT_LOGPROB_TOKENS_PER_STEP

logger = logging.getLogger(__name__)

CacheFactory = Callable[[int], list[torch.Tensor]]  # number of blocks -> a cache per layer


def profile_step(num_tokens: int, max_model_len: int, block_size: int,
                 max_num_seqs: int) -> tuple[StepMessage, int]:
    """The largest prefill step: `num_tokens` prompt tokens in sequences of up to
    `max_model_len`, laid out in consecutive blocks from 0, with the logits of up to
    `max_num_seqs` sampled rows and the step's prompt-logprob rows
    (`scheduler.PROMPT_LOGPROB_TOKENS_PER_STEP`) requested. Returns the message and the blocks
    it needs."""
    lengths = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        lengths.append(num_tokens % max_model_len)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    tables: list[tuple[int, ...]] = []
    next_block = 0
    for length in lengths:
        blocks = -(-length // block_size)
        tables.append(tuple(range(next_block, next_block + blocks)))
        slots.extend(range(next_block * block_size, next_block * block_size + length))
        next_block += blocks
        ids.extend([0] * length)
        positions.extend(range(length))
        starts.append(starts[-1] + length)
    num_rows = max_num_seqs + PROMPT_LOGPROB_TOKENS_PER_STEP
    rows = tuple(range(max(0, num_tokens - num_rows), num_tokens))
    msg = StepMessage(step_id=0, input_ids=tuple(ids), positions=tuple(positions),
                      slot_mapping=tuple(slots), query_start_loc=tuple(starts),
                      seq_lens=tuple(lengths), block_tables=tuple(tables), num_decodes=0,
                      logit_rows=rows)
    return msg, next_block


def run_profile_step(model: nn.Module, caches_for: CacheFactory, device: torch.device,
                     num_tokens: int, max_model_len: int, block_size: int,
                     max_num_seqs: int) -> torch.Tensor:
    """Runs the largest step once on a cache made by `caches_for(num_blocks)`; returns its
    logits (the caller drops them with the cache)."""
    msg, num_blocks = profile_step(num_tokens, max_model_len, block_size, max_num_seqs)
    with torch.inference_mode():
        return LocalExecutor(model, caches_for(num_blocks), device).execute(msg)


def kv_budget_bytes(total: int, peak: int, outside_torch: int, utilization: float) -> int:
    """The KV cache's share, in bytes, of `utilization` x `total` device memory: what is left
    after this process's torch `peak` (weights, the largest step's activations) and the memory
    held outside torch's allocator (`outside_torch`: the CUDA context, other processes).
    `utilization` is a fraction of the device's *total* memory, not of what is free (vLLM's
    `gpu_memory_utilization`). May be <= 0: the caller reports that."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    return int(total * utilization) - peak - outside_torch


def gpu_kv_budget(model: nn.Module, caches_for: CacheFactory, device: torch.device, *,
                  utilization: float, num_tokens: int, max_model_len: int, block_size: int,
                  max_num_seqs: int) -> int:
    """Bytes the KV cache may take on `device` (CUDA), after a measured profile step."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run_profile_step(model, caches_for, device, num_tokens, max_model_len, block_size,
                     max_num_seqs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)  # weights + activations + profile cache
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    budget = kv_budget_bytes(total, peak, outside_torch, utilization)
    logger.info("GPU memory: %.2f GiB total, peak of a %d-token step %.2f GiB, outside torch "
                "%.2f GiB -> KV cache %.2f GiB (utilization %.2f)", total / 2**30, num_tokens,
                peak / 2**30, outside_torch / 2**30, budget / 2**30, utilization)
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization=} of {total / 2**30:.1f} GiB "
            f"is taken by the weights and a {num_tokens}-token step's activations "
            f"({peak / 2**30:.1f} GiB peak) and other processes ({outside_torch / 2**30:.1f} "
            f"GiB); raise gpu_memory_utilization or lower max_num_batched_tokens")
    return budget
