"""The engine's side of disaggregation and migration: the verbs that move a request's KV to or
from another worker, kept out of the engine's core (vLLM's KV connector is the model).

A `Connector` holds one `Engine` and works only through its narrow interface: `intake` (validate
a request, build its samples), `track` and `sample_ids` (a request's samples), `abort` (with
`keep_blocks`), `settle`, the scheduler's `add`, `add_waiting_for_kv` and `kv_landed`, and the
KV cache's lease ledger (`kv.ledger`: blocks held for, or reserved from, another worker). Like
the engine, it is not thread-safe: call it between steps on the thread that drives the engine
(the worker's async engine `apply`s it; `workers.serving.async_connector` has the commands that
stream events). No torch at import.

- prefill side of a KV handoff: `prefill`, then `held_block_ids` / `free_held`;
- a cached prefix pulled by another worker: `export_prefix` here, `reserve_prefix` +
  `land_prefix` there; `hot_prefixes` and `kv_snapshot` say what is cached;
- decode side: `decode_from_handoff` / `continue_with_kv` + `kv_landed`, and `resume` (the KV
  computed here instead);
- a live migration's source: `export_running`, then `pause`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from workers.contract.protocol import (
    InvalidRequestError,
    KVCacheFull,
    WorkerRequest,
)
from workers.contract.prefix_cache import HotPrefix, KVSnapshot
from workers.engine.request import Continuation, Request, RequestStatus

if TYPE_CHECKING:
    from workers.engine.core import Engine
    from workers.engine.kv_cache import LeaseLedger


@dataclasses.dataclass(frozen=True)
class PausedHere:
    """A sample `Connector.pause` stopped: its blocks are held under `sample_id`."""

    index: int
    sample_id: str
    output_token_ids: list[int]
    num_kv_tokens: int
    block_ids: list[int]


class Connector:
    """The KV handoff, prefix export and live migration verbs of one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def ledger(self) -> LeaseLedger:
        return self.engine.kv.ledger

    # ---- the KV handoff: prefill side ------------------------------------------------------

    def prefill(self, req: WorkerRequest) -> None:
        """Queue the prompt of a request another worker will decode: it samples the first token
        only (with `req.params`), then its blocks are held for the KV handoff until `free_held`
        (an abort frees them at once). Validated against the whole request. n must be 1."""
        engine, request_id, params = self.engine, req.request_id, req.params
        if params.n != 1:
            raise InvalidRequestError(f"n must be 1 for a prefill-only request, got {params.n}",
                                      param="n")
        if engine.sample_ids(request_id) or self.ledger.held_block_ids(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already running or held",
                                      param="request_id")
        engine.intake.validate(list(req.prompt_token_ids), params)
        first_only = dataclasses.replace(params, max_tokens=1,
                                         min_tokens=min(params.min_tokens, 1))
        # max_tokens=1: the whole request, nothing to hand off
        sample = engine.intake.sample(req, 0, params=first_only,
                                      hold_kv=params.max_tokens > 1)
        engine.track(request_id, 0, sample)
        engine.scheduler.add(sample)

    def held_block_ids(self, request_id: str) -> list[int]:
        """Blocks of a finished prefill-only request, in token order ([] when none are held)."""
        return self.ledger.held_block_ids(request_id)

    def free_held(self, request_id: str) -> bool:
        """The handoff is over (pulled, cancelled or expired): free the held blocks."""
        return self.ledger.free_held(request_id)

    # ---- a prefix pulled from another worker (either side) -----------------------------------

    def export_prefix(self, hold_id: str, block_hashes: Sequence[int]) -> list[int]:
        """Hold the device blocks of the leading `block_hashes` this prefix cache has (up to the
        first miss) for another worker to pull, until `free_held(hold_id)`; their ids."""
        self.engine.settle()
        return self.ledger.hold_prefix(hold_id, block_hashes)

    def hot_prefixes(self, max_blocks: int) -> list[HotPrefix]:
        """The prefixes requests hit here lately, most worth first, still in the device pool,
        within `max_blocks` in all (what a worker leaving the pool hands to the others)."""
        kv = self.engine.kv
        return kv.hot.top(max_blocks, lambda h: kv.pool.lookup(h) is not None)

    def reserve_prefix(self, hold_id: str, num_blocks: int) -> list[int]:
        """Fresh blocks for a pulled prefix, held until `land_prefix` or `free_held`. Raises
        `KVCacheFull` (nothing held) when they are not free."""
        self.engine.settle()
        block_ids = self.ledger.reserve(hold_id, num_blocks)
        if block_ids is None:
            raise KVCacheFull(f"no {num_blocks} KV blocks free for the prefix of {hold_id!r}")
        return block_ids

    def land_prefix(self, hold_id: str, block_hashes: Sequence[int],
                    token_ids: Sequence[int]) -> None:
        """The reserved blocks hold the prefix `token_ids` (hashing to `block_hashes`): they
        join the prefix cache, so the request sent next finds them."""
        self.ledger.cache_reserved(hold_id, block_hashes, token_ids)

    def kv_snapshot(self) -> KVSnapshot:
        """The prefix cache's hashes, consistent with the events emitted so far."""
        kv = self.engine.kv
        host = kv.host
        return KVSnapshot(kv.events.epoch, kv.events.next_seq,
                          frozenset(kv.pool.cached_hashes()),
                          frozenset(host.cached_hashes()) if host is not None else frozenset())

    # ---- the KV handoff and continuations: decode side ---------------------------------------

    def decode_from_handoff(self, req: WorkerRequest, first_token_id: int) -> list[int]:
        """Allocate blocks for a prompt whose KV another worker computed; returns the block ids
        to fill. The request waits for its KV (no step schedules it) until `kv_landed`, then
        decodes after `first_token_id` (already sent to the client by that worker). `abort`
        frees it. Raises `KVCacheFull` (nothing allocated) when the blocks are not free."""
        c = Continuation(0, [first_token_id], len(req.prompt_token_ids))
        return self.continue_with_kv(req, [c])[0]

    def continue_with_kv(self, req: WorkerRequest,
                         samples: Sequence[Continuation]) -> dict[int, list[int]]:
        """The continuation of a request's `samples`, each after its sent tokens, whose first
        `num_kv_tokens` tokens' KV another worker computed: blocks are allocated for them, and
        each sample's block ids to fill returned by index, but for blocks already filled and
        held under its `hold_id` (a live migration's first pull), which it takes first. They
        wait (no step schedules them) until `kv_landed`, then compute the tokens after that
        KV. `abort` frees them. Raises `KVCacheFull` (nothing kept, the held blocks freed)."""
        engine, kv, rid = self.engine, self.engine.kv, req.request_id
        engine.settle()
        try:
            conts = self._continuations(req, samples, with_kv=True)
        except InvalidRequestError:
            for c in samples:
                if c.hold_id is not None:
                    self.ledger.free_held(c.hold_id)
            raise
        to_fill: dict[int, list[int]] = {}
        for i, (c, sample) in enumerate(zip(samples, conts)):
            if c.hold_id is not None:
                kv.adopt(c.hold_id, sample.request_id)
            filled = len(kv.block_ids(sample.request_id))
            if not engine.scheduler.add_waiting_for_kv(sample, c.num_kv_tokens):
                kv.free(sample)
                engine.abort(rid)  # the samples added before
                for later in samples[i + 1:]:
                    if later.hold_id is not None:
                        self.ledger.free_held(later.hold_id)
                raise KVCacheFull(f"no KV blocks free for the {c.num_kv_tokens}-token handoff "
                                  f"of {rid!r}")
            engine.track(rid, c.index, sample, c.sent_token_ids)
            to_fill[c.index] = kv.block_ids(sample.request_id)[filled:]
        return to_fill

    def kv_landed(self, request_id: str) -> None:
        """The handed-off KV has landed in the request's blocks: start decoding it. KeyError
        when the request is not waiting for its KV."""
        for sid in self.engine.sample_ids(request_id) or [request_id]:
            self.engine.scheduler.kv_landed(sid)

    def resume(self, req: WorkerRequest, samples: Sequence[Continuation]) -> None:
        """Queue a request's `samples`, whose first output tokens other workers sampled (and
        sent) but whose KV is not here (a failed KV pull, or a decode worker lost mid-stream):
        the prompt and those tokens are computed here, then each decodes on from its next
        token. Greedy and seeded output equal an uninterrupted run (a seeded draw depends only
        on the seed, the sample's index and the output position)."""
        conts = self._continuations(req, samples, with_kv=False)
        for c, sample in zip(samples, conts):
            self.engine.track(req.request_id, c.index, sample, c.sent_token_ids)
            self.engine.scheduler.add(sample)

    def _continuations(self, req: WorkerRequest, samples: Sequence[Continuation],
                       with_kv: bool) -> list[Request]:
        """The validated samples of a request continued here after the output other workers
        sampled and streamed (each holds the first of its sent tokens; the rest join in
        `Engine.track`); `with_kv`: each brings the KV of some of its tokens. Registered
        nowhere yet. max_tokens, min_tokens and penalties count the sent tokens as output."""
        engine, request_id, params = self.engine, req.request_id, req.params
        indexes = [c.index for c in samples]
        if not samples or len(set(indexes)) != len(indexes) or not all(
                0 <= i < params.n for i in indexes):
            raise InvalidRequestError(f"a continuation of samples {indexes}: expected distinct "
                                      f"indexes in [0, n={params.n})", param="samples")
        if engine.sample_ids(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already running",
                                      param="request_id")
        ids = list(req.prompt_token_ids)
        engine.intake.validate(ids, params)
        vocab = engine.model_config.vocab_size
        out = []
        for c in samples:
            sent = c.sent_token_ids
            if not 1 <= len(sent) < params.max_tokens:
                raise InvalidRequestError(
                    f"a continued request needs between 1 and max_tokens-1="
                    f"{params.max_tokens - 1} tokens already sent, got {len(sent)}",
                    param="max_tokens")
            bad = [t for t in sent if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"sent token ids outside [0, {vocab}): {bad[:5]}",
                                          param="sent_token_ids")
            total = len(ids) + len(sent)
            if with_kv and not 0 < c.num_kv_tokens < total:
                raise InvalidRequestError(
                    f"the KV of {c.num_kv_tokens} tokens of a {total}-token continuation: "
                    "expected at least 1 and fewer than all (the last is computed here)",
                    param="num_kv_tokens")
            sample = engine.intake.sample(req, c.index, sent)
            sample.append_output(sent[0])
            out.append(sample)
        return out

    # ---- a live migration's source side -------------------------------------------------------

    def export_running(self, request_id: str,
                       hold_id: Callable[[int], str]) -> dict[int, list[int]]:
        """Hold the full blocks of each sample's computed tokens of a running request (which it
        never writes again) for a live migration's target to pull while the request decodes on
        here, until `free_held(hold_id(index))`; their ids by sample index."""
        self.engine.settle()
        bs, kv = self.engine.config.block_size, self.engine.kv
        return {index: kv.hold_leading(hold_id(index), sample.request_id,
                                       sample.num_computed_tokens // bs)
                for index, sample in self._running_samples(request_id)}

    def pause(self, request_id: str) -> list[PausedHere]:
        """Stop a running request here, between steps and with no further event, keeping each
        sample's blocks held until `free_held(sample_id)`: per sample still running, its
        output tokens so far, how many of its tokens' KV its blocks hold, and their ids (a live
        migration's target pulls what it lacks and continues)."""
        self.engine.settle()
        running = [(index, sample.request_id, list(sample.output_token_ids),
                    sample.num_computed_tokens)
                   for index, sample in self._running_samples(request_id)]
        self.engine.abort(request_id, keep_blocks=True)
        return [PausedHere(index, sid, tokens, num_kv, self.ledger.held_block_ids(sid))
                for index, sid, tokens, num_kv in running]

    def _running_samples(self, request_id: str) -> list[tuple[int, Request]]:
        """A running request's unfinished samples, by index; each must have output."""
        engine = self.engine
        sample_ids = engine.sample_ids(request_id)
        if not sample_ids:
            raise InvalidRequestError(f"request {request_id!r} is not running here",
                                      param="request_id")
        samples = [engine.scheduler.requests.get(sid) for sid in sample_ids]
        running = [s for s in samples if s is not None and s.output_token_ids
                   and s.status is not RequestStatus.WAITING_FOR_REMOTE_KV]
        if len(running) != len(samples):
            raise InvalidRequestError(f"request {request_id!r} has a sample with no output yet",
                                      param="request_id")
        return [(engine.outputs.index(s.request_id), s) for s in running]
