"""Small factories for engine tests: a scheduler without a model, requests, a fake step."""

from __future__ import annotations

from workers.kv_cache import KVCacheManager
from workers.protocol import SamplingParams
from workers.request import Request
from workers.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

EOS = 0


def create_scheduler(num_blocks: int = 16, block_size: int = 4, max_num_seqs: int = 4,
                     max_num_batched_tokens: int = 16, max_model_len: int = 256,
                     enable_caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching)
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


def replay_events(events: list) -> set[int]:
    """The set of cached block hashes that a consumer of the KV events would believe in."""
    from workers.protocol import AllBlocksCleared, BlockRemoved, BlockStored

    cached: set[int] = set()
    for event in events:
        if isinstance(event, BlockStored):
            cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            cached.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            cached.clear()
    return cached
