"""The boundary between the router and a worker: one request record in, token events out.

Torch-free. The router holds one `WorkerClient` per worker and never touches an engine directly.
The one implementation is `router.channel.ChannelClient`, over a `WorkerChannel` (the wire, also
defined here) in process (`cluster.inprocess_client`), to a worker process
(`cluster.process_worker`) or to a Ray actor's socket (`cluster.worker_client`); tests script
fakes of this contract (`tests/router/fakes.py`). Prompts cross as token ids: the router
tokenizes, so it can hash the prompt's blocks for routing.

`WorkerClient` is the one place on the router's side that names the operations: each named
method builds its record (a command of `workers.contract.messages`, a call of
`workers.contract.calls`) and hands it to one of three primitives: `open` (a streaming command),
`send` (an `Abort`), `call` (a call and its answer). A `WorkerChannel` carries the records and
reads the output stream; it knows no operation by name. A new operation needs no method here:
`client.call(NewRecord(...))`.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from workers.contract.calls import (
    Call,
    CancelMigration,
    ExportPrefix,
    ExportRunning,
    Health,
    HotPrefixes,
    Info,
    LandPrefix,
    Pause,
    Prefill,
    PrepareMigration,
    SnapshotKV,
    Stats,
)
from workers.contract.messages import (
    Abort,
    DecodeFromHandoff,
    Generate,
    Paused,
    PrefillResult,
    PrefixFetch,
    Resume,
    ResumedSample,
    StreamCommand,
    WorkerOutputs,
)
from workers.contract.protocol import (
    EngineStats,
    KVPullFailed,
    TokenEvent,
    WorkerInfo,
    WorkerRequest,
    WorkerRole,
)
from workers.contract.prefix_cache import HotPrefix, KVEvent, KVSnapshot

if TYPE_CHECKING:
    from kvtransfer.handoff import KVHandoff
    from router.errors import WorkerUnavailableError

__all__ = ["EngineStats", "KVPullFailed", "PrefillResult", "TokenStream", "WorkerChannel",
           "WorkerClient", "WorkerInfo", "WorkerListener", "WorkerRequest", "WorkerRole"]

R = TypeVar("R")

# between two output messages over a wire between processes (`WorkerChannel.output_interval_s`)
OUTPUT_INTERVAL_S = 0.001


class TokenStream(Protocol):
    """One request's events until all its samples finish. `aclose()` before the end aborts
    the request on the worker (its blocks and leases are freed)."""

    def __aiter__(self) -> AsyncIterator[TokenEvent]: ...

    async def __anext__(self) -> TokenEvent: ...

    async def aclose(self) -> None: ...


class WorkerListener(Protocol):
    """What a client tells the router's worker set as outputs arrive (`router.workers`)."""

    def on_outputs(self, worker_id: str, kv_events: Sequence[KVEvent],
                   stats: EngineStats) -> None:
        """The worker's prefix-cache changes and its load after its latest step."""

    def on_unreachable(self, worker_id: str, exc: WorkerUnavailableError) -> None:
        """The worker could not be reached (its requests' streams fail with `exc`)."""


class WorkerClient(abc.ABC):
    """How the router talks to one worker. Methods may raise `router.errors.
    WorkerUnavailableError` when the worker cannot be reached. A stream raises
    `workers.contract.protocol.InvalidRequestError` for a request the worker refuses, before the
    first event; a worker refuses an operation its role does not do with `ValueError`."""

    @property
    @abc.abstractmethod
    def worker_id(self) -> str: ...

    @abc.abstractmethod
    def attach(self, listener: WorkerListener) -> None:
        """Start telling `listener` the worker's KV events and load as they arrive."""

    # ---- the primitives a client implements -----------------------------------------------

    @abc.abstractmethod
    def open(self, cmd: StreamCommand) -> TokenStream:
        """Send a streaming command; its events, until all its samples finish."""

    @abc.abstractmethod
    def send(self, cmd: Abort) -> None:
        """Send a command that opens no stream (it goes with the next batch)."""

    @abc.abstractmethod
    async def call(self, call: Call[R]) -> R:
        """Ask the worker `call` and wait for its answer; a caller that gives up (a cancel, a
        deadline) undoes what the call began there (`Call.undone_by_abort`)."""

    async def close(self) -> None:
        """Release what the client holds (its channel, an in-process engine). An optional hook:
        a client that holds nothing keeps this default, which does nothing."""
        return None

    # ---- the operations, by name ------------------------------------------------------------

    async def info(self) -> WorkerInfo:
        return await self.call(Info())

    def generate(self, req: WorkerRequest, prefix: PrefixFetch | None = None) -> TokenStream:
        """The whole request on this worker (aggregated), all n samples; with `prefix` (from
        another worker's `export_prefix`) that part of the prompt's KV is pulled, not
        computed (a failed pull only means it is computed)."""
        return self.open(Generate(req, prefix))

    async def export_prefix(self, request_id: str, block_hashes: Sequence[int],
                            reader_tp_size: int = 1) -> KVHandoff | None:
        """Offer the KV of the leading `block_hashes` this worker caches (up to the first miss)
        under a lease per TP rank, for the worker that will run `request_id` (of
        `reader_tp_size` ranks) to pull; None when it caches none of them."""
        return await self.call(ExportPrefix(request_id, tuple(block_hashes), reader_tp_size))

    async def prefill(self, req: WorkerRequest, decode_tp_size: int = 1,
                      prefix: PrefixFetch | None = None) -> PrefillResult:
        """Run the prompt to its first token and offer its KV under a lease per TP rank, each
        for the decode worker's `decode_tp_size` ranks to pull; with `prefix` (another
        worker's `export_prefix`) that part of the prompt is pulled first, not computed.
        Raises `InvalidRequestError` for a bad request; cancelling leaves nothing held."""
        return await self.call(Prefill(req, decode_tp_size, prefix))

    def decode_from_handoff(self, req: WorkerRequest, first_token_id: int,
                            handoff: KVHandoff | None) -> TokenStream:
        """The events after `first_token_id`. With `handoff` (from `prefill`) the prompt's KV
        is pulled, and `KVPullFailed` is raised before any event when that fails; with None
        the worker computes the prompt's KV itself."""
        return self.open(DecodeFromHandoff(req, first_token_id, handoff))

    async def hot_prefixes(self, max_blocks: int) -> tuple[HotPrefix, ...]:
        """Hand-off, source: the prefixes requests hit here lately (`HotPrefixes`)."""
        return await self.call(HotPrefixes(max_blocks))

    async def land_prefix(self, request_id: str, fetch: PrefixFetch,
                          token_ids: Sequence[int]) -> int:
        """Hand-off, target: pull another worker's prefix into this cache (`LandPrefix`)."""
        return await self.call(LandPrefix(request_id, fetch, tuple(token_ids)))

    async def export_running(self, request_id: str,
                             reader_tp_size: int = 1) -> dict[int, KVHandoff]:
        """Live migration, source: offer the running request's blocks (`ExportRunning`)."""
        return await self.call(ExportRunning(request_id, reader_tp_size))

    async def prepare_migration(self, request_id: str,
                                exported: dict[int, KVHandoff]) -> dict[int, int]:
        """Live migration, target: pull them ahead of the `resume` (`PrepareMigration`)."""
        return await self.call(PrepareMigration(request_id, exported))

    async def pause(self, request_id: str, reader_tp_size: int = 1) -> Paused:
        """Live migration, source: stop the request between two steps (`Pause`)."""
        return await self.call(Pause(request_id, reader_tp_size))

    async def cancel_migration(self, request_id: str) -> None:
        """Live migration that will not happen: both sides let go now (`CancelMigration`);
        harmless when nothing is held."""
        await self.call(CancelMigration(request_id))

    def resume(self, req: WorkerRequest, samples: Sequence[ResumedSample]) -> TokenStream:
        """The events of `samples` after each one's sent tokens, its first output tokens,
        which other workers sampled and sent (one failed mid-stream); the worker computes the
        KV of the prompt and those tokens itself (with their `kv`, a live migration's, it
        pulls it). Greedy and seeded output equal an uninterrupted run."""
        return self.open(Resume(req, tuple(samples)))

    async def abort(self, request_id: str) -> None:
        """Cancel a request wherever it is on the worker; unknown ids are ignored."""
        self.send(Abort(request_id))

    async def stats(self) -> EngineStats:
        """The worker's load, asked now (the router routes on the pushed copy instead)."""
        return await self.call(Stats())

    async def kv_snapshot(self) -> KVSnapshot:
        return await self.call(SnapshotKV())

    async def health(self) -> bool:
        """True when the worker can take requests."""
        return await self.call(Health())


class WorkerChannel(abc.ABC):
    """The wire to one worker: carries call records (`call`) and reads the output stream
    (`next_outputs`); it knows no operation by name. Each raises `WorkerUnavailableError` when
    the worker cannot be reached; the worker's own refusals (`InvalidRequestError`,
    `ValueError` for a role) are raised as the worker raised them.

    `output_interval_s`: the least time between two output messages the client asks of the
    worker (`next_outputs`); steps faster than it are merged into one message, and a stream
    then shows one chunk per interval (a 1.5 ms step streamed every 4 ms read as a 4 ms
    inter-token latency). Between processes a message is a framed pickle on a socket: 1 ms
    bounds a tiny model's message rate (its steps take under a millisecond on a CPU). It was
    4 ms when each message was a Ray call (embedded model at one stream: 440 tokens/s with a
    message per step, 780-1,070 with 4 ms); on the socket, the embedded model on the Ray app
    (`benchmarks/serving.py --layers ray --models tiny`, two alternating rounds) streamed as
    much or more at 1 ms and with none as at 4 ms (8 streams 4.3-4.7k tokens/s against
    3.2-3.5k, 64 streams 7.3-8.8k against 5.0-7.0k) with an ITL p50 of 1 ms, not 4. In one
    process a message is a return value: none (`cluster.inprocess_client`)."""

    worker_id: str
    output_interval_s: float = OUTPUT_INTERVAL_S

    @abc.abstractmethod
    async def call(self, call: Call[R]) -> R:
        """The worker's answer to `call` (`workers.serving.dispatch`)."""

    @abc.abstractmethod
    async def next_outputs(self, subscriber: str, timeout_s: float,
                           min_interval_s: float = 0.0) -> WorkerOutputs:
        """`subscriber`'s next output message, within about `timeout_s` (a heartbeat with no
        events when nothing happened), at least `min_interval_s` after its last."""

    async def close(self) -> None:
        """Release the channel (and what it owns: an in-process worker). An optional hook: a
        channel that owns nothing keeps this default, which does nothing."""
        return None
