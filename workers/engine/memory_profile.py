"""How much GPU memory the KV cache may take: measured, not guessed.

The budget is `gpu_memory_utilization` of the device's total memory, less what the weights and
the largest step's activations need at their peak, less what other processes (and the CUDA
context) hold. The peak is measured by running one forward of `max_num_batched_tokens` tokens
(the largest step the scheduler will ever build) against a throw-away cache, as vLLM does,
followed by what the runner does with that step's logits at its most expensive: the sampler over
`max_num_seqs` rows with top-p, min-p and 20 logprobs (a full-vocabulary sort), then the
log-softmax and top-20 of the step's prompt-logprob rows (`PROMPT_LOGPROB_TOKENS_PER_STEP`).

CUDA graphs hold memory of their own, outside the allocator's ordinary pool, for as long as the
engine lives: before the budget is fixed, the largest graph is captured on a one-block
throw-away cache and what it holds (its pool, the shared logits buffer, the static input
buffers) is measured and taken off the KV share (the smaller graphs reuse its pool). The same
decode pass warms every decode-kernel variant (`CudaGraphExecutor.warm_up`), so Triton compiles
them at start, not while serving.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import logging
from collections.abc import Callable

import torch

from workers.engine.cuda_graphs import CudaGraphExecutor
from workers.kernels.host_transfer import upload
from workers.engine.parallel.executor import LocalExecutor
from workers.engine.parallel.messages import StepMessage
from workers.contract.protocol import SamplingParams
from workers.engine.request import Request
from workers.engine.sampler import Sampler, top_logprobs
from workers.engine.scheduler_records import PROMPT_LOGPROB_TOKENS_PER_STEP

if TYPE_CHECKING:
    from workers.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # the most logprobs (and prompt logprobs) a request may ask for

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


def run_profile_step(model: LlamaForCausalLM, caches_for: CacheFactory, device: torch.device,
                     num_tokens: int, max_model_len: int, block_size: int,
                     max_num_seqs: int) -> torch.Tensor:
    """Runs the largest step once on a cache made by `caches_for(num_blocks)`, then
    `sample_profile` on its logits; returns the logits (the caller drops them with the
    cache)."""
    msg, num_blocks = profile_step(num_tokens, max_model_len, block_size, max_num_seqs)
    with torch.inference_mode():
        logits = LocalExecutor(model, caches_for(num_blocks), device).execute(msg)
        sample_profile(logits, max_num_seqs, device)
    return logits


def sample_profile(logits: torch.Tensor, max_num_seqs: int, device: torch.device) -> None:
    """The runner's most expensive use of a step's logits [rows, vocab] fp32 (not modified):
    its first `max_num_seqs` rows sampled with top-p, min-p, a temperature and 20 logprobs,
    then the rest as prompt-logprob rows (log-softmax, the chosen token and the top 20), as
    `Runner._execute` does. Run for the memory it allocates; the results are dropped."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    sampled = min(max_num_seqs, logits.shape[0])
    params = SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, logprobs=MAX_LOGPROBS)
    reqs = [Request(f"memory-profile-{i}", [0], params, frozenset()) for i in range(sampled)]
    if reqs:
        Sampler(0, device)(logits[:sampled], reqs)
    prompt_rows = logits.shape[0] - sampled
    if prompt_rows:
        chosen = upload([0] * prompt_rows, device)
        top_logprobs(logits[sampled:].log_softmax(-1), chosen, MAX_LOGPROBS)


def graph_profile(model: LlamaForCausalLM, caches_for: CacheFactory, device: torch.device, *,
                  max_seq_len: int, graph_batch_size: int) -> int:
    """Runs one-row decode steps that compile every decode-kernel variant, and with
    `graph_batch_size` > 0 captures the graph of that many rows (the ladder's largest) on a
    one-block cache made by `caches_for(1)`; returns the device bytes the graph and its buffers
    keep reserved while they live (0 without a graph). CUDA only; frees all of it before
    returning."""
    if graph_batch_size < 0:
        raise ValueError(f"graph_batch_size must be >= 0, got {graph_batch_size}")
    caches = caches_for(1)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_reserved(device)
    executor = CudaGraphExecutor(model, caches, device, sink_block=0,
                                 max_batch_size=max(graph_batch_size, 1),
                                 max_seq_len=max_seq_len, capture=False)
    if getattr(model.attn_backend, "cuda_graph_safe", False):
        executor.warm_up()
    if graph_batch_size:
        executor.capture([executor.sizes[-1]])
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # what the eager warm-up cached; a live graph keeps its pool
    held = torch.cuda.memory_reserved(device) - before
    del executor, caches
    torch.cuda.empty_cache()
    return max(0, held) if graph_batch_size else 0


def kv_budget_bytes(total: int, peak: int, outside_torch: int, utilization: float,
                    graph_bytes: int = 0) -> int:
    """The KV cache's share, in bytes, of `utilization` x `total` device memory: what is left
    after this process's torch `peak` (weights, the largest step's activations and logits
    work), the memory held outside torch's allocator (`outside_torch`: the CUDA context, other
    processes) and what the CUDA graphs keep (`graph_bytes`).
    `utilization` is a fraction of the device's *total* memory, not of what is free (vLLM's
    `gpu_memory_utilization`). May be <= 0: the caller reports that."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    if graph_bytes < 0:
        raise ValueError(f"graph_bytes must be >= 0, got {graph_bytes}")
    return int(total * utilization) - peak - outside_torch - graph_bytes


def gpu_kv_budget(model: LlamaForCausalLM, caches_for: CacheFactory, device: torch.device, *,
                  utilization: float, num_tokens: int, max_model_len: int, block_size: int,
                  max_num_seqs: int, graph_batch_size: int = 0) -> int:
    """Bytes the KV cache may take on `device` (CUDA), after a measured profile step and, with
    `graph_batch_size` > 0 (the largest batch the executor will capture), a measured capture
    of that graph (`graph_profile`)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run_profile_step(model, caches_for, device, num_tokens, max_model_len, block_size,
                     max_num_seqs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)  # weights + activations + profile cache
    torch.cuda.empty_cache()
    graph_bytes = graph_profile(model, caches_for, device, max_seq_len=max_model_len,
                                graph_batch_size=graph_batch_size)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    budget = kv_budget_bytes(total, peak, outside_torch, utilization, graph_bytes)
    logger.info("GPU memory: %.2f GiB total, peak of a %d-token step %.2f GiB, CUDA graphs "
                "%.2f GiB, outside torch %.2f GiB -> KV cache %.2f GiB (utilization %.2f)",
                total / 2**30, num_tokens, peak / 2**30, graph_bytes / 2**30,
                outside_torch / 2**30, budget / 2**30, utilization)
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization=} of {total / 2**30:.1f} GiB "
            f"is taken by the weights and a {num_tokens}-token step's activations "
            f"({peak / 2**30:.1f} GiB peak), CUDA graphs ({graph_bytes / 2**30:.1f} GiB) and "
            f"other processes ({outside_torch / 2**30:.1f} GiB); raise "
            f"gpu_memory_utilization or lower max_num_batched_tokens")
    return budget
