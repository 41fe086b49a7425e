"""The scheduler's records: the limits it schedules within (`SchedulerConfig`) and the plan of
each step it hands the runner (`SchedulerOutput`, one `ScheduledChunk` per request)."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

from workers.engine.kv_cache.host_tier import NO_COPIES, BlockCopies
from workers.engine.request import Request

if TYPE_CHECKING:
    from workers.engine.config import EngineConfig


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int  # running sequences at most
    max_num_batched_tokens: int  # new tokens per step at most (the chunked-prefill budget)
    max_model_len: int  # tokens per sequence at most (prompt + output)
    max_loras: int = 0  # LoRA adapters among the running requests at most; 0: no adapters
    order_by_deadline: bool = True  # the waiting queue: earliest deadline first, else FIFO

    @classmethod
    def of(cls, config: EngineConfig, max_model_len: int) -> SchedulerConfig:
        """The limits an engine's configuration sets (adapters are counted once attached)."""
        return cls(config.max_num_seqs, config.max_num_batched_tokens, max_model_len,
                   order_by_deadline=config.scheduling_policy == "deadline")


class ScheduledChunk(NamedTuple):
    """`num_tokens` new tokens of `request`, at positions [start, start + num_tokens).

    A NamedTuple, not a dataclass: one is made per running request per step."""

    request: Request
    start: int
    num_tokens: int
    block_ids: tuple[int, ...]  # the request's whole block table (shared, not copied)
    samples: bool  # the chunk brings the request level: its last logits pick the next token
    # drafted tokens verified by this chunk (its last len(draft) positions; a decode's first
    # position is the request's last token): every position samples, the drafted tokens are
    # accepted while the target samples them (`workers.engine.speculative`)
    draft: tuple[int, ...] = ()


@dataclass
class DraftCounts:
    """Speculative decoding's counters since start: drafted tokens verified, those accepted,
    and drafts verified (one a drafting request a step)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_drafts: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        """One request's verified draft of `drafted` tokens, `accepted` of them accepted."""
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.num_drafts += drafted > 0


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
    def num_draft_tokens(self) -> int:
        return sum(len(c.draft) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


# Prompt-logprobs requests' prefill chunks compute a row of logits per token (tokens × vocab
# floats, then their log-softmax): at most this many rows a step, over all of them, so a step
# stays within the memory the profile measured (`workers.engine.memory_profile`; a chunk of
# 8192 rows of a 128k vocabulary would need 4 GiB twice over).
PROMPT_LOGPROB_TOKENS_PER_STEP = 512


def takes_logprob_rows(req: Request) -> bool:
    """A prompt-logprobs request still in its prompt: its chunk counts against the step's
    prompt-logprob rows."""
    return req.prompt_logprobs is not None and req.num_computed_tokens < req.num_prompt_tokens

def prompt_left(req: Request, num_computed: int) -> int:
    """Prompt tokens still to compute when `num_computed` tokens are."""
    return max(0, req.num_prompt_tokens - num_computed)


def adapter_fits(req: Request, running: Iterable[Request], max_loras: int) -> bool:
    """Whether `req` can join the `running` requests without their LoRA adapters outnumbering
    the model's slots (`max_loras`): a step runs them all at once."""
    if req.lora_name is None:
        return True
    loaded = {r.lora_name for r in running} - {None}
    return req.lora_name in loaded or len(loaded) < max_loras


def prompt_logprob_rows(req: Request, start: int, num_tokens: int) -> int:
    """How many rows of a chunk of `num_tokens` from `start` predict a prompt token (position p
    predicts token p + 1)."""
    if req.prompt_logprobs is None:
        return 0
    return max(0, min(start + num_tokens, req.num_prompt_tokens - 1) - start)
