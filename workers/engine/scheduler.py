"""Continuous batching at iteration level, with chunked prefill, a token budget and preemption.

Each step: running requests first (oldest first), each gets the tokens it still lacks up to the
remaining budget; when blocks run out the newest running request is preempted (its blocks freed,
its tokens recomputed later). Then waiting requests are admitted in the queue's order (FIFO;
TTFT deadlines earliest first: `waiting_order`), reusing prefix-cache hits, as long as budget,
sequence slots and blocks allow. The scheduler owns every unfinished request's place: waiting,
running, or waiting for its KV from another worker (`add_waiting_for_kv` until `kv_landed`).

Async scheduling (`workers.engine.async_step`) splits `update` in two: `commit` at a step's launch
(computed tokens advance, and each request that samples gets a placeholder for its coming token)
and `record` once its tokens are on the host. `schedule(lookahead=True)` plans the next step in
between (a placeholder: a token the device supplies). Records: `scheduler_records`.
"""

from __future__ import annotations

from collections import deque

from workers.engine.kv_cache import KVCacheManager
from workers.contract.protocol import FinishReason
from workers.engine.request import Request, RequestStatus
from workers.engine.stops import append_checked, check_stop
from workers.engine.waiting_order import due_position
from workers.engine.scheduler_records import (
    PROMPT_LOGPROB_TOKENS_PER_STEP, DraftCounts, ScheduledChunk, SchedulerConfig, SchedulerOutput,
    adapter_fits, prompt_left, takes_logprob_rows)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}  # request id -> request whose KV is coming
        self._kv_tokens: dict[str, int] = {}  # request id -> tokens whose KV is coming
        self.requests: dict[str, Request] = {}  # every unfinished request, wherever it is
        self.num_preemptions = 0  # since start, for metrics and tests
        self.drafts = DraftCounts()  # speculative decoding's, since start
        # prompt tokens of waiting and running requests not computed yet, kept as they move
        self.num_pending_prompt_tokens = 0  # (`_set_computed`), so reading it costs nothing
        # request id -> tokens sampled by launched steps but not recorded yet (async scheduling)
        self.placeholders: dict[str, int] = {}

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished(self) -> bool:
        """True while a step can make progress (requests waiting for their KV cannot)."""
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        """Queue a request to be scheduled (its prompt, and any output tokens it already has,
        computed from scratch)."""
        self.requests[req.request_id] = req
        self.waiting.insert(due_position(self.waiting, req) if self.config.order_by_deadline
                            else len(self.waiting), req)
        self.num_pending_prompt_tokens += prompt_left(req, req.num_computed_tokens)

    def add_waiting_for_kv(self, req: Request, num_kv_tokens: int | None = None) -> bool:
        """Allocate blocks for the first `num_kv_tokens` tokens (default: the prompt) of a
        request whose KV another worker computed (the caller fills them; blocks the request
        already holds count) and hold it, unscheduled, until `kv_landed`. False, and nothing
        changes, when the blocks are not free. Cache entries evicted for room are not saved to
        the host tier: the pull writes the blocks before the next step could copy them."""
        num = req.num_prompt_tokens if num_kv_tokens is None else num_kv_tokens
        if num < 1:
            raise ValueError(f"the KV of {num} tokens: expected at least 1")
        if not self.kv.allocate_slots(req, num, save_evicted=False):
            return False
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[req.request_id] = req
        self.waiting_for_kv[req.request_id] = req
        self._kv_tokens[req.request_id] = num
        return True

    def kv_landed(self, request_id: str) -> None:
        """The KV is in the request's blocks: it runs from the next step, computing only the
        tokens after it. KeyError when it is not waiting for its KV."""
        req = self.waiting_for_kv.pop(request_id, None)
        if req is None:
            raise KeyError(f"request {request_id!r} is not waiting for remote KV")
        req.num_computed_tokens = self._kv_tokens.pop(request_id)
        self.num_pending_prompt_tokens += prompt_left(req, req.num_computed_tokens)
        self.kv.cache_blocks(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _set_computed(self, req: Request, num_computed: int) -> None:
        """Move a waiting or running request's `num_computed_tokens`, keeping the count of
        pending prompt tokens."""
        old, num_prompt = req.num_computed_tokens, len(req.prompt_token_ids)
        req.num_computed_tokens = num_computed
        if old < num_prompt or num_computed < num_prompt:  # not a decode past the prompt
            self.num_pending_prompt_tokens += (max(0, num_prompt - num_computed)
                                               - max(0, num_prompt - old))

    def schedule(self, lookahead: bool = False) -> SchedulerOutput | None:
        """The next step. `lookahead` (a step in flight): requests their placeholders surely end
        are left out; None, not a preemption, where room needs one (slots allocated kept)."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        rows = PROMPT_LOGPROB_TOKENS_PER_STEP
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            ahead = self.placeholders.get(req.request_id, 0) if self.placeholders else 0
            if ahead and self._ends_at(req, ahead):
                i += 1
                continue
            num_new = min(req.num_tokens + ahead - req.num_computed_tokens, budget)
            draft = (tuple(req.draft_token_ids[:budget - 1])
                     if req.draft_token_ids and num_new == 1 and not ahead else ())
            num_new += len(draft)
            takes_rows = takes_logprob_rows(req)
            if takes_rows:
                num_new = min(num_new, rows)
                if num_new == 0:  # its prompt-logprob rows wait for the next step
                    i += 1
                    continue
            while not self.kv.allocate_slots(req, num_new):
                if draft:  # a speculative draft: decode without it rather than preempt
                    num_new, draft = num_new - len(draft), ()
                    continue
                if lookahead:
                    return None
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                if takes_rows:
                    rows -= num_new
                chunks.append(self._chunk(req, num_new, ahead, draft))
                budget -= num_new
                i += 1

        budget = budget if preempted else self._admit(chunks, budget, rows)
        # decodes first, shortest context first (the attention backend batches similar lengths)
        chunks.sort(key=lambda c: (c.num_tokens != 1, c.start))
        return SchedulerOutput(chunks, self.config.max_num_batched_tokens - budget, preempted,
                               self.kv.take_copies())

    def _admit(self, chunks: list[ScheduledChunk], budget: int, rows: int) -> int:
        """Admit waiting requests into `chunks` within `budget` tokens and `rows` prompt-logprob
        rows, in order, while sequence slots and blocks allow; the budget left."""
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and adapter_fits(self.waiting[0], self.running, self.config.max_loras)):
            req = self.waiting[0]
            hits = self.kv.get_computed_blocks(req)
            num_hit_tokens = len(hits) * self.kv.block_size
            num_new = min(req.num_tokens - num_hit_tokens, budget)
            if takes_logprob_rows(req):
                num_new = min(num_new, rows)
                rows -= num_new
            if num_new == 0 or not self.kv.allocate_slots(req, num_new, hits):
                break
            self.waiting.popleft()
            if req.status is RequestStatus.WAITING:
                req.num_cached_tokens = num_hit_tokens
            self._set_computed(req, num_hit_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(self._chunk(req, num_new))
            budget -= num_new
        return budget

    def _chunk(self, req: Request, num_new: int, ahead: int = 0,
               draft: tuple[int, ...] = ()) -> ScheduledChunk:
        start = req.num_computed_tokens
        return ScheduledChunk(req, start, num_new, self.kv.block_table(req.request_id),
                              start + num_new == len(req.all_token_ids) + ahead + len(draft),
                              draft)

    def _ends_at(self, req: Request, ahead: int) -> bool:
        """Whether the `ahead` tokens sampled but not recorded surely end the request."""
        return (req.num_output_tokens + ahead >= req.params.max_tokens
                or req.num_tokens + ahead >= self.config.max_model_len)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self._set_computed(req, 0)
        req.draft_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               accepted: dict[str, list[int]] | None = None) -> list[Request]:
        """Record a finished step: advance computed tokens, cache full blocks, append sampled
        tokens (after a verifying request's `accepted` drafted ones) and finish requests that
        hit a stop condition. Returns the requests that got a token this step."""
        advanced: list[Request] = []
        for req, start, num_tokens, _, samples, draft in out.chunks:
            if req.status is RequestStatus.FINISHED:  # aborted while the step ran
                continue
            if draft:
                good = (accepted or {}).get(req.request_id, [])
                self._record_verified(req, start, len(draft), [*good, sampled[req.request_id]])
                advanced.append(req)
                continue
            self._set_computed(req, req.num_computed_tokens + num_tokens)
            self.kv.cache_blocks(req)
            if not samples:
                continue
            req.append_output(sampled[req.request_id])
            advanced.append(req)
            reason = check_stop(req, self.config.max_model_len)
            if reason is not None:
                self.finish(req.request_id, reason)
        return advanced

    def _record_verified(self, req: Request, start: int, num_drafted: int,
                         tokens: list[int]) -> None:
        """Append a verified chunk's new tokens one at a time through the stop checks; the KV
        computed is the chunk's first position's and the appended drafted tokens'; blocks past
        the request's tokens (rejected positions') are returned."""
        req.num_draft_tokens += num_drafted
        req.num_accepted_tokens += len(tokens) - 1
        self.drafts.add(num_drafted, len(tokens) - 1)
        appended, reason = append_checked(req, tokens, self.config.max_model_len)
        self._set_computed(req, start + appended)
        self.kv.cache_blocks(req)
        self.kv.trim(req)
        if reason is not None:
            self.finish(req.request_id, reason)

    def commit(self, out: SchedulerOutput) -> None:
        """A launched step's KV is as good as computed (later steps are ordered after it on
        the device): advance each request's computed tokens, cache its full blocks of known
        tokens, and give each request that samples a placeholder until `record`."""
        for req, _, num_tokens, _, samples, _ in out.chunks:
            if req.status is RequestStatus.FINISHED:
                continue
            self._set_computed(req, req.num_computed_tokens + num_tokens)
            if req.num_computed_tokens <= req.num_tokens:  # no placeholder among them
                self.kv.cache_blocks(req)
            if samples:
                self.placeholders[req.request_id] = self.placeholders.get(req.request_id, 0) + 1

    def record(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """A committed step's tokens reached the host: each replaces its placeholder, and
        stop conditions are checked as `update` does. A request finished here (or earlier)
        that a later step already computed past is rolled back by `finish`. Returns the
        requests that got a token."""
        advanced: list[Request] = []
        for req, _, _, _, samples, _ in out.chunks:
            if not samples or req.status is RequestStatus.FINISHED:
                continue
            rid = req.request_id
            left = self.placeholders[rid] - 1
            if left:
                self.placeholders[rid] = left
            else:
                del self.placeholders[rid]
            req.append_output(sampled[rid])
            advanced.append(req)
            reason = check_stop(req, self.config.max_model_len)
            if reason is not None:
                self.finish(rid, reason)
            elif req.num_computed_tokens == req.num_tokens:  # a launched step computed it
                self.kv.cache_blocks(req)
        return advanced

    def finish(self, request_id: str, reason: FinishReason,
               hold: bool | None = None) -> Request | None:
        """End a request wherever it is and free its blocks (hold them, for a request that
        asked to, unless aborted; `hold` says so instead when given). Unknown or finished ids:
        None."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if self.placeholders.pop(request_id, None) is not None:
            # a launched step computed past its last token: that KV is discarded (as a
            # synchronous step, which never computes the last sampled token, leaves it)
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
        if req.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.waiting_for_kv[request_id]
            del self._kv_tokens[request_id]
        else:
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self.num_pending_prompt_tokens -= prompt_left(req, req.num_computed_tokens)
        if (req.hold_kv and reason is not FinishReason.ABORT) if hold is None else hold:
            self.kv.hold(req)
        else:
            self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        return req

