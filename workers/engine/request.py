"""One sequence inside the engine: its tokens, how many have KV computed, and its state.

There is no prefill or decode phase: `num_computed_tokens` catches up with `num_tokens`, a chunk
at a time; a request samples a token whenever a step brings it level.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.contract.protocol import FinishReason, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    import torch


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # handed off from another worker: holds blocks for its prompt, unscheduled until they fill
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; recomputes its tokens when rescheduled
    FINISHED = "finished"


class Request:
    """Mutable engine-side state of one sample. `request_id` is unique within the engine."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int], *, cache_salt: str | None = None,
                 arrival_time: float | None = None, hold_kv: bool = False,
                 lora_name: str | None = None, deadline: float | None = None) -> None:
        self.request_id = request_id
        self.lora_name = lora_name  # its LoRA adapter; None: the base model
        # a prefill-only request: on finishing (not on abort) its blocks are held for a KV
        # handoff instead of freed (`KVCacheManager.hold`)
        self.hold_kv = hold_kv
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.cache_salt = cache_salt
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.deadline = deadline  # monotonic time its first token is due; None: no target
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first schedule
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        # a structured-output request's grammar matcher (`workers.engine.grammar`), in step with
        # `output_token_ids`; None: free text
        self.grammar: object | None = None
        # speculative decoding (`workers.engine.speculative`): the tokens drafted for the next
        # step (set by the speculator before each step), and this sample's counts of drafted
        # tokens verified and of those accepted; `draft_probs` [k, V]: the distributions a
        # sampled request's draft was drawn from (a draft model's; None: a deterministic draft,
        # accepted where the target samples the same token)
        self.draft_token_ids: list[int] = []
        self.draft_probs: torch.Tensor | None = None
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.block_hashes: list[int] = []  # chained hashes of the full blocks known so far
        # entry i: logprob of prompt token i given the tokens before it (None for the first)
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens after the first `num_output_tokens` (a stop string ended the
        request there, within a speculative step's tokens)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[num_output_tokens:]
            del self.all_token_ids[-drop:]

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")


@dataclass(frozen=True)
class Continuation:
    """One sample of a request continued on this worker after `sent_token_ids`, output other
    workers sampled and sent (`Connector.resume`, `Connector.continue_with_kv`): with
    `num_kv_tokens` > 0, that many tokens' KV is pulled from another worker instead of
    computed, into blocks the request takes first when `hold_id` holds them (a live
    migration's first pull)."""

    index: int  # the sample's index in the request (0 unless n > 1)
    sent_token_ids: Sequence[int]
    num_kv_tokens: int = 0
    hold_id: str | None = None

