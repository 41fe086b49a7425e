"""The scheduler's records: the limits it schedules within (`SchedulerConfig`) and the plan of
each step it hands the runner (`SchedulerOutput`, one `ScheduledChunk` per request)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from workers.engine.kv_cache.host_tier import NO_COPIES, BlockCopies
from workers.engine.request import Request


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int  # running sequences at most
    max_num_batched_tokens: int  # new tokens per step at most (the chunked-prefill budget)
    max_model_len: int  # tokens per sequence at most (prompt + output)
    max_loras: int = 0  # LoRA adapters among the running requests at most; 0: no adapters


class ScheduledChunk(NamedTuple):
    """`num_tokens` new tokens of `request`, at positions [start, start + num_tokens).

    A NamedTuple, not a dataclass: one is made per running request per step."""

    request: Request
    start: int
    num_tokens: int
    block_ids: tuple[int, ...]  # the request's whole block table (shared, not copied)
    samples: bool  # the chunk brings the request level: its last logits pick the next token


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # single-token chunks (decodes) first, by context length
    num_batched_tokens: int
    preempted: list[str]  # request ids preempted this step
    # KV copies between the cache's tiers, made before the forward pass (saves, then loads)
    block_copies: BlockCopies = NO_COPIES

    @property
    def num_decodes(self) -> int:
        return sum(1 for c in self.chunks if c.num_tokens == 1)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
