"""Small factories for engine tests: a scheduler without a model, requests, a fake step, a paged
KV cache of noise, a handoff between two engines in this process."""

from __future__ import annotations

import torch

from workers.engine.kv_cache import KVCacheManager
from workers.contract.protocol import SamplingParams
from workers.engine.request import Request
from workers.engine.scheduler import Scheduler
from workers.engine.scheduler_records import SchedulerConfig, SchedulerOutput

EOS = 0


def create_scheduler(num_blocks: int = 16, block_size: int = 4, max_num_seqs: int = 4,
                     max_num_batched_tokens: int = 16, max_model_len: int = 256,
                     enable_caching: bool = True, host_blocks: int = 0) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching, host_blocks=host_blocks)
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len), kv)


def create_request(request_id: str, prompt: list[int], max_tokens: int = 4,
                   **params: object) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   frozenset({EOS}))


def fake_step(scheduler: Scheduler, token: int = 7) -> SchedulerOutput:
    """Schedule, pretend the model ran, and sample `token` for every request that samples."""
    out = scheduler.schedule()
    sampled = {c.request.request_id: token for c in out.chunks if c.samples}
    scheduler.update(out, sampled)
    return out


def replay_events(events: list, medium: str = "device") -> set[int]:
    """The set of block hashes cached in tier `medium` that a consumer of the KV events would
    believe in."""
    from workers.contract.prefix_cache import AllBlocksCleared, BlockRemoved, BlockStored

    cached: set[int] = set()
    for event in events:
        if isinstance(event, BlockStored) and event.medium == medium:
            cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved) and event.medium == medium:
            cached.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            cached.clear()
    return cached


def noise_paged_cache(seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                      gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's KV cache `[2, num_blocks, block_size, Hkv, D]` of noise (spare blocks too, so an
    attention kernel reading a wrong block shows) and shuffled, disjoint block tables (int32,
    padded with block 0) for sequences of `seq_lens` tokens."""
    counts = [-(-length // block_size) for length in seq_lens]
    num_blocks = sum(counts) + 3
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    rows, used = [], 0
    for count in counts:
        rows.append(order[used:used + count] + [0] * (max(counts) - count))
        used += count
    return cache, torch.tensor(rows, dtype=torch.int32)


def quantized_cache(cache: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """A full-precision cache `[planes, ..., D]` as an 8-bit cache of `cache_dtype` stores it
    (`workers.kernels.kv_quant`: keys, plane 0, in `key_dtype`, their bytes in the cache)."""
    from workers.kernels.kv_quant import key_dtype, quantize_kv

    keys = quantize_kv(cache[0], key_dtype(cache_dtype)).view(cache_dtype)
    return torch.stack([keys, *(quantize_kv(plane, cache_dtype) for plane in cache[1:])])


def dequantized_cache(stored: torch.Tensor) -> torch.Tensor:
    """An 8-bit cache's planes as fp32, in its basis (`quantized_cache`'s inverse, up to the
    rounding)."""
    from workers.kernels.kv_quant import dequantize_kv, plane_views

    planes = plane_views(stored)[:stored.shape[0]]
    return torch.stack([dequantize_kv(plane, torch.float32) for plane in planes])


def hand_off(prefill, decode, req) -> list[int]:  # noqa: ANN001 - two Engines, a WorkerRequest
    """`req` prefilled on engine `prefill` (its first token), its KV copied into the blocks
    engine `decode` gives it as a pull would copy them, then decoded there: every token."""
    from workers.serving.connector import Connector

    prefill.generate(req)
    first = prefill.step()[0].token_ids[0]  # the whole prompt fits one step
    src_blocks = prefill.block_ids(req.request_id)
    dst_blocks = Connector(decode).decode_from_handoff(req, first)
    assert len(dst_blocks) == len(src_blocks[:len(dst_blocks)])
    for src_cache, dst_cache in zip(prefill.kv_caches, decode.kv_caches):
        dst_cache[:, dst_blocks] = src_cache[:, src_blocks[:len(dst_blocks)]]
    prefill.abort(req.request_id)
    Connector(decode).kv_landed(req.request_id)
    tokens = [first]
    while decode.has_unfinished():
        for event in decode.step():
            tokens += event.token_ids
    return tokens
