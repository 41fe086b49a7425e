"""What a request becomes before the engine queues it: validated against the model and the KV
cache, then split into its samples, each a `Request` with its own id, parameters and grammar
matcher. Builds; registers nothing (the engine tracks and queues what it builds here)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from workers.contract.prefix_cache import adapter_salt
from workers.contract.protocol import InvalidRequestError, SamplingParams, WorkerRequest
from workers.engine.adapters import NoAdapters
from workers.engine.request import Request
from workers.engine.sampler import sample_seed

if TYPE_CHECKING:
    from workers.engine.grammar import Grammars
    from workers.engine.kv_cache import KVCacheManager


class Intake:
    """Checks requests against one engine's limits and builds their samples."""

    def __init__(self, vocab_size: int, max_model_len: int, max_num_batched_tokens: int,
                 kv: KVCacheManager, eos_token_ids: frozenset[int], grammars: Grammars,
                 adapters: NoAdapters | None = None) -> None:
        self.vocab_size = vocab_size
        self.adapters = adapters or NoAdapters()  # refuses requests for adapters not loaded
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        """Raise `InvalidRequestError` (naming the parameter) for a prompt of `ids` asking for
        `params` that this engine could never run, even alone."""
        vocab = self.vocab_size
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt contains token ids outside [0, {vocab}): {bad[:5]}", param="prompt")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
                f"{params.max_tokens} in the completion).", param="max_tokens")
        bad = [t for t in params.logit_bias or () if t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"logit_bias has token ids outside [0, {vocab}): {bad[:5]}", param="logit_bias")
        tokens = len(ids) + params.max_tokens
        if self.kv.window is not None:  # older blocks return: a step's chunk and the window
            tokens = min(tokens, self.max_num_batched_tokens + self.kv.window)
        needed = self.kv.num_blocks_for(tokens) + (self.kv.window is not None)
        if needed > self.kv.pool.num_blocks:  # could never run, even alone
            raise InvalidRequestError(
                f"{len(ids)} prompt tokens plus max_tokens={params.max_tokens} need {needed} KV "
                f"blocks; the cache has only {self.kv.pool.num_blocks}", param="max_tokens")

    def sample(self, req: WorkerRequest, index: int, sent_token_ids: Sequence[int] = (), *,
               params: SamplingParams | None = None, hold_kv: bool = False) -> Request:
        """Sample `index` of `req` (with `params` instead of the request's when given): its id
        (the request's own when n is 1), its parameters (one sample, its own seed, prompt
        logprobs with sample 0) and, for structured output, its grammar matcher at the state
        after `sent_token_ids` (compiled here unless the async engine compiled it off the step
        thread). The sent tokens are not appended. Not validated: call `validate` first."""
        params = req.params if params is None else params
        self.adapters.check(req.lora_name)
        sample = Request(sample_id(req.request_id, params.n, index), list(req.prompt_token_ids),
                         sample_params(params, index), self.eos_token_ids,
                         cache_salt=adapter_salt(req.cache_salt,
                                                 self.adapters.cache_name(req.lora_name)),
                         hold_kv=hold_kv, lora_name=req.lora_name,
                         deadline=first_token_due(req, sent_token_ids))
        spec = sample.params.structured
        if spec is not None:
            sample.grammar = self.grammars.matcher(spec, sent_token_ids)
        return sample


def first_token_due(req: WorkerRequest, sent_token_ids: Sequence[int]) -> float | None:
    """When the request's first token is due on this worker's clock (None: no target, or its
    first token already went out: a resumed or handed-off request)."""
    if req.ttft_deadline_s is None or sent_token_ids:
        return None
    return time.monotonic() + req.ttft_deadline_s


def sample_id(request_id: str, n: int, index: int) -> str:
    """The engine's id of a request's sample: the request's own when it has one."""
    return request_id if n == 1 else f"{request_id}/{index}"


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """A sample's own parameters: one sample, its own seed, prompt logprobs with sample 0."""
    if params.n == 1:
        return params
    return dataclasses.replace(
        params, n=1, seed=None if params.seed is None else sample_seed(params.seed, index),
        prompt_logprobs=params.prompt_logprobs if index == 0 else None)
