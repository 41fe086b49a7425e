"""A routed request's token stream, as the front ends read it: `Generation`. Torch-free.

One async generator, `Generation.events()`, reads the worker's `TokenStream`, makes each event's
text (`workers.tokenizer.detokenizer.SampleText`: incremental detokenization, stop strings and
their hold-back, here rather than on the engine's step thread; a stop string ends the sample and
aborts the request on its worker), and handles every recovery in place (see `router.orchestrator`):
- the decode half of a disaggregated request: its first event means the KV landed (the handoff
  is timed); a `KVPullFailed` instead makes the same decode worker compute the prompt itself,
  after the prefill worker's lease is ended;
- migration: when the worker streaming a request fails mid-stream, the prompt plus every token
  already sent of each sample still running goes to another decode-pool worker
  (`Recovery.migrate`), at most `migration_retries` times (not before every such sample has a
  token);
- live migration (`router.live_migration`, which marks it moving): the stream moves to another
  worker with its KV while it runs (a drain); its source's stream ends with `RequestMoved`
  after every token it produced, and the target's stream, already opened after exactly those
  tokens, takes over;
- closing it early aborts the request wherever it is (the decode worker and, while the KV has
  not landed, the prefill worker's lease).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from router.errors import NoHealthyWorkerError, WorkerUnavailableError
from router.metrics import error_reason
from router.request_record import NullRecord
from router.starts import DONE, Start
from router.worker_client import TokenStream, WorkerClient
from workers.contract.messages import RequestMoved, ResumedSample
from workers.contract.protocol import FinishReason, KVPullFailed, TokenEvent, WorkerRequest
from workers.tokenizer.detokenizer import SampleText

if TYPE_CHECKING:
    from kvtransfer.handoff import KVHandoff

logger = logging.getLogger(__name__)


class Recovery(Protocol):
    """What a generation asks when its worker or its KV pull fails (`router.failover`)."""

    async def migrate(self, req: WorkerRequest, samples: list[ResumedSample],
                      tried: list[str], exc: Exception) -> tuple[str, TokenStream]:
        """Another healthy decode-pool worker's stream of `samples` after their sent tokens
        (counted), not one of `tried` (those that failed streaming it), or raise `exc` when
        none is left."""

    def kv_pulled(self, decode_id: str, handoff: KVHandoff, seconds: float) -> None:
        """The decode worker's first event after it was given the handoff."""

    def kv_pull_failed(self, decode_id: str, exc: KVPullFailed) -> None:
        """The decode worker could not land the KV (it computes the prompt instead)."""


@dataclass(frozen=True)
class Parts:
    """What every generation of a router shares (`router.generations.GenerationFactory`)."""

    recovery: Recovery
    migration_retries: int = 0  # times a stream moves on after its worker failed
    tokenizer: object | None = None  # makes the events' text here (None: the workers' text)


class Generation:
    """One request submitted to its worker(s), built by a `GenerationFactory`. `events()`
    yields its token events (the first has already arrived); `aclose()` aborts what is left.
    `worker_id` sampled the first token; `decode_worker_id`, when set, streams the rest.
    `record` times it and counts how it ended (`router.metrics`)."""

    def __init__(self, req: WorkerRequest, start: Start, parts: Parts,
                 record: Callable[[Generation], NullRecord]) -> None:
        """`record(self)`: its metrics record, opened once its first event has its text."""
        self.req = req
        self._tokenizer = parts.tokenizer
        self._texts: dict[int, SampleText] = {}  # sample index -> its text so far
        self._ended: set[int] = set()  # samples that finished (here or on the worker)
        first = self._with_text(start.first)
        if first is None:
            raise ValueError(f"request {req.request_id}: a first event of no live sample")
        self.first = first
        self.worker_id = start.worker_id
        self.decode_worker_id = start.decode_worker_id
        self.predicted_cached_tokens = start.predicted_cached_tokens
        self.num_cached_tokens = first.num_cached_tokens
        self._speculated: dict[int, tuple[int, int]] = {}  # sample -> (drafted, accepted)
        self._stream = start.stream
        self._recovery = parts.recovery
        self._handover = start.handover
        # a stream that ended at its first token has nothing to move
        self._moves_left = 0 if start.stream is DONE else parts.migration_retries
        self._streamed_by = [start.streamer]
        self._failed: list[str] = []  # the workers that failed while streaming it
        self._closed = False
        # while a live migration is under way: its (target id, target stream, the source to
        # release after a replay), once paused
        self._moved: asyncio.Future[tuple[str, TokenStream, WorkerClient | None]] | None = None
        # done at its first event from the worker a move took it to (or when it ends): the
        # worker has reported the KV it brought (`LiveMigrations.drain` waits for it)
        self.resumed: asyncio.Future[None] | None = None
        self.record = record(self)

    @property
    def speculated(self) -> tuple[int, int]:
        """(drafted tokens verified, accepted) over its samples, as its workers reported."""
        return (sum(d for d, _ in self._speculated.values()),
                sum(a for _, a in self._speculated.values()))

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.req.prompt_token_ids

    async def events(self) -> AsyncIterator[TokenEvent]:
        n = self.req.params.n
        sent: dict[int, list[int]] = {i: [] for i in range(n)}  # what each sample sent
        sent[self.first.index].extend(self.first.token_ids)
        try:
            yield self.first
            while len(self._ended) < n:
                try:
                    event = await self._stream.__anext__()
                except StopAsyncIteration:
                    break
                except KVPullFailed as exc:
                    if self._handover is None:
                        raise
                    await self._compute_instead(exc)
                    continue
                except RequestMoved:
                    await self._take_moved()
                    continue
                except Exception as exc:  # any worker failure: move the stream on, or raise
                    if self._moves_left == 0:
                        raise
                    await self._end_handover()
                    await self._migrate(exc, sent)
                    continue
                if self.resumed is not None and self._moved is None:
                    self._resume_seen()  # an event from the worker it moved to
                if self._handover is not None:
                    h, self._handover = self._handover, None
                    self._recovery.kv_pulled(h.decode.worker_id, h.handoff,
                                             time.monotonic() - h.started)
                shown = self._with_text(event)
                if shown is None:  # a sample that already ended here
                    continue
                sent[shown.index].extend(shown.token_ids)
                self.record.on_event(shown)
                yield shown
            self.record.finish("success")
        except Exception as exc:
            self.record.finish("error", error_reason(exc))
            if isinstance(exc, WorkerUnavailableError):  # no worker left to continue it: 503
                raise NoHealthyWorkerError(
                    f"the worker streaming this request went away and no other could continue "
                    f"it: {exc}") from None
            raise
        finally:
            await self.aclose()

    def _with_text(self, event: TokenEvent) -> TokenEvent | None:
        """The event with its text made here, cut at a stop string it completes (which ends
        its sample); None for an event of a sample that already ended."""
        if event.index in self._ended:
            return None
        if event.num_draft_tokens:
            self._speculated[event.index] = (event.num_draft_tokens, event.num_accepted_tokens)
        if self._tokenizer is None:
            if event.finish_reason is not None:
                self._ended.add(event.index)
            return event
        text = self._texts.get(event.index)
        if text is None:
            text = self._texts[event.index] = SampleText(
                self._tokenizer, self.req.prompt_token_ids, self.req.params)
        for i, token_id in enumerate(event.token_ids):
            stop = text.add_token(token_id)
            if stop is not None:
                self._ended.add(event.index)
                kept = event.token_ids[:i + 1]
                return event.replaced(
                    token_ids=kept, text=text.take(True, flush=False),
                    logprobs=event.logprobs[:len(kept)] if event.logprobs else event.logprobs,
                    finish_reason=FinishReason.STOP, stop_reason=stop)
        finished = event.finish_reason is not None
        if finished:
            self._ended.add(event.index)
        return event.replaced(text=text.take(
            finished, flush=finished and event.stop_reason is None))

    async def _compute_instead(self, exc: KVPullFailed) -> None:
        """The pull failed: end the prefill worker's lease, and have the decode worker compute
        the prompt itself and continue after the first token (none repeated or lost)."""
        h = self._handover
        if h is None:
            raise RuntimeError(f"request {self.req.request_id}: a KV pull failed with no handoff")
        logger.warning("request %s: %s; decode worker %s prefills it itself",
                       self.req.request_id, exc, h.decode.worker_id)
        self._recovery.kv_pull_failed(h.decode.worker_id, exc)
        await self._end_handover()
        self._stream = h.decode.decode_from_handoff(self.req, self.first.token_ids[-1], None)

    async def _migrate(self, exc: Exception, sent: dict[int, list[int]]) -> None:
        """Continue the samples still running on another worker, from what each sent; raise
        `exc` when one of them has sent nothing yet (it has nothing to continue from)."""
        failed = self._streamed_by[-1]
        self._failed.append(failed)
        samples = [ResumedSample(i, tuple(tokens)) for i, tokens in sent.items()
                   if i not in self._ended]
        if any(not s.sent_token_ids for s in samples):
            raise exc
        logger.warning("request %s: worker %s failed after %d tokens (%r); migrating",
                       self.req.request_id, failed, sum(map(len, sent.values())), exc)
        await self._stream.aclose()  # aborts what is left of it there
        self._moves_left -= 1
        worker_id, self._stream = await self._recovery.migrate(self.req, samples,
                                                               list(self._failed), exc)
        self._streamed_by.append(worker_id)

    @property
    def worker_now(self) -> str:
        """The worker streaming it now."""
        return self._streamed_by[-1]

    @property
    def movable(self) -> bool:
        """A running stream whose KV has landed and that is not moving."""
        return not self._closed and self._handover is None and self._moved is None

    def begin_move(self) -> asyncio.Future[tuple[str, TokenStream, WorkerClient | None]]:
        """Mark it moving (`router.live_migration`): when its source's stream ends with
        `RequestMoved`, the stream goes on from the future's (target id, target stream, the
        source to release after a replay)."""
        loop = asyncio.get_running_loop()
        self._moved, self.resumed = loop.create_future(), loop.create_future()
        return self._moved

    def cancel_move(self) -> None:
        """The move did not happen (the stream did not pause): it goes on where it is."""
        self._moved = None
        self._resume_seen()

    def _resume_seen(self) -> None:
        if self.resumed is not None and not self.resumed.done():
            self.resumed.set_result(None)

    async def _take_moved(self) -> None:
        """The source's stream ended (moved): the target's continues it. After a replay the
        source is told to let go of what it paused with (nobody pulls it)."""
        if self._moved is None:
            raise RuntimeError(f"request {self.req.request_id} moved with no move under way")
        worker_id, self._stream, release = await self._moved
        self._moved = None
        self._streamed_by.append(worker_id)
        if release is not None:
            await release.abort(self.req.request_id)

    @property
    def streamed_by(self) -> list[str]:
        """The workers that streamed part of it, in order (each before the last failed, or
        the stream moved off it live)."""
        return list(self._streamed_by)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._resume_seen()
        self.record.finish("cancelled")  # unless it already ended
        try:
            await self._stream.aclose()
        finally:
            await self._end_handover()

    async def _end_handover(self) -> None:
        """The decode side will not pull (any more): end the prefill worker's lease, which may
        still hold the prompt's blocks."""
        h, self._handover = self._handover, None
        if h is not None:
            try:
                await h.prefill.abort(self.req.request_id)
            except WorkerUnavailableError:
                pass  # gone: nothing is held there any more


__all__ = ["Generation", "Parts", "Recovery"]
