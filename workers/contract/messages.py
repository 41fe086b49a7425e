"""The messages of the worker channel: what a router sends a worker and what comes back.
Torch-free; every record is typed and versioned where it crosses a process.

Out: the streaming commands (`Generate`, `DecodeFromHandoff`, `Resume`) and `Abort`, batched
per event-loop turn (`router.channel`). Back: one `WorkerOutputs` per engine step per
subscriber, with typed failures (`RequestFailed`); `prefill` answers with a `PrefillResult`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.contract.protocol import (
    EngineOverloaded,
    EngineShutDown,
    EngineStats,
    InvalidRequestError,
    KVPullFailed,
    TokenEvent,
    WorkerRequest,
)
from workers.contract.prefix_cache import KVEvent

if TYPE_CHECKING:
    from kvtransfer.handoff import KVHandoff


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill worker returns: the first token's event and, when the request goes on,
    the KV handoff a decode worker pulls (None: the request finished at its first token)."""

    first: TokenEvent  # finish_reason is None unless the request ended here
    handoff: KVHandoff | None


class FailureKind(str, enum.Enum):
    """Why a request ended with an error on a worker (`RequestFailed.kind`)."""

    INVALID_REQUEST = "invalid_request"  # refused before its first event (`InvalidRequestError`)
    KV_PULL_FAILED = "kv_pull_failed"  # its handoff's KV could not land (`KVPullFailed`)
    ENGINE_SHUT_DOWN = "engine_shut_down"  # the worker is going away (`EngineShutDown`)
    ENGINE_ERROR = "engine_error"  # a step failed
    OVERLOADED = "overloaded"  # refused: the worker's waiting queue is full (`EngineOverloaded`)
    MOVED = "moved"  # paused here for a live migration: another worker continues it


@dataclass(frozen=True)
class RequestFailed:
    """A request that ended with an error on the worker; nothing of it is held there any more."""

    request_id: str
    kind: FailureKind
    message: str
    param: str | None = None  # the bad field, for INVALID_REQUEST
    pull_kind: str | None = None  # `KVPullFailed.kind`, for KV_PULL_FAILED

    @classmethod
    def from_exception(cls, request_id: str, exc: BaseException) -> RequestFailed:
        if isinstance(exc, InvalidRequestError):
            return cls(request_id, FailureKind.INVALID_REQUEST, exc.message, param=exc.param)
        if isinstance(exc, KVPullFailed):
            return cls(request_id, FailureKind.KV_PULL_FAILED, exc.reason, pull_kind=exc.kind)
        if isinstance(exc, EngineShutDown):
            return cls(request_id, FailureKind.ENGINE_SHUT_DOWN, str(exc))
        if isinstance(exc, EngineOverloaded):
            return cls(request_id, FailureKind.OVERLOADED, exc.reason)
        if isinstance(exc, RequestMoved):
            return cls(request_id, FailureKind.MOVED, str(exc))
        return cls(request_id, FailureKind.ENGINE_ERROR, f"{type(exc).__name__}: {exc}")

    def to_exception(self) -> Exception:
        """The exception the worker raised, for the router's stream of this request."""
        if self.kind is FailureKind.INVALID_REQUEST:
            return InvalidRequestError(self.message, param=self.param)
        if self.kind is FailureKind.KV_PULL_FAILED:
            return KVPullFailed(self.request_id, self.pull_kind or "other", self.message)
        if self.kind is FailureKind.ENGINE_SHUT_DOWN:
            return EngineShutDown(self.message)
        if self.kind is FailureKind.OVERLOADED:
            return EngineOverloaded(self.request_id, self.message)
        if self.kind is FailureKind.MOVED:
            return RequestMoved(self.message)
        return RuntimeError(self.message)


# Commands: the streaming operations a router sends a worker. Their events come back on the
# worker's output channel (`WorkerOutputs`), not as a stream per request.


@dataclass(frozen=True)
class PrefixFetch:
    """The KV of a prompt's leading blocks, held by another worker under a lease
    (`export_prefix`): pulled before the request starts, instead of recomputed."""

    handoff: KVHandoff
    block_hashes: tuple[int, ...]  # the prompt's leading blocks the handoff holds, in order


@dataclass(frozen=True)
class Generate:
    """Run the whole request here (aggregated), n samples; with `prefix`, pull that part of
    the prompt's KV first (a failed pull only means it is computed here)."""

    req: WorkerRequest
    prefix: PrefixFetch | None = None

    @property
    def num_samples(self) -> int:
        return self.req.params.n


@dataclass(frozen=True)
class DecodeFromHandoff:
    """Continue after `first_token_id` (sampled and sent by a prefill worker): pull the
    prompt's KV from `handoff`, or with None compute it here."""

    req: WorkerRequest
    first_token_id: int
    handoff: KVHandoff | None

    num_samples = 1


@dataclass(frozen=True)
class MigratedKV:
    """A live migration's KV of one sample (`ResumedSample.kv`): the blocks a first pull landed
    here (`prepare_migration`), and the source's handoff of the rest, written since (None:
    none)."""

    num_kv_tokens: int  # tokens whose KV the source had computed when it paused
    num_landed_blocks: int
    handoff: KVHandoff | None


@dataclass(frozen=True)
class PausedSample:
    """One sample of a request a live migration's source paused (`Paused`)."""

    index: int  # the sample's index in the request (0 unless n > 1)
    output_token_ids: tuple[int, ...]  # its output so far: the target continues after them
    num_kv_tokens: int
    handoff: KVHandoff | None  # its blocks past those exported before, under a lease


@dataclass(frozen=True)
class Paused:
    """What a live migration's source answers when it pauses a request (`pause`): each of its
    samples still running, by index (those that finished before the pause are not moved)."""

    samples: tuple[PausedSample, ...]


class RequestMoved(Exception):
    """A request's stream on its source worker ended because it moved to another worker."""


@dataclass(frozen=True)
class ResumedSample:
    """One sample of a `Resume`: its index in the request, the output tokens other workers
    sampled and sent, and with `kv` (a live migration) where its KV is pulled from."""

    index: int
    sent_token_ids: tuple[int, ...]
    kv: MigratedKV | None = None


@dataclass(frozen=True)
class Resume:
    """Continue each of `samples` after its sent tokens (sampled and sent by other workers):
    compute the KV of the prompt and those tokens here, or, with every sample's `kv` (a live
    migration), pull it. The samples finished before are not among them."""

    req: WorkerRequest
    samples: tuple[ResumedSample, ...]

    @classmethod
    def one(cls, req: WorkerRequest, sent_token_ids: Sequence[int],
            kv: MigratedKV | None = None) -> Resume:
        """A single-sample request's continuation."""
        return cls(req, (ResumedSample(0, tuple(sent_token_ids), kv),))

    @property
    def with_kv(self) -> bool:
        return self.samples[0].kv is not None

    @property
    def num_samples(self) -> int:
        return len(self.samples)


@dataclass(frozen=True)
class Abort:
    """Cancel a request wherever it is on the worker (running, queued, or prefilled and
    leased); unknown ids are ignored."""

    request_id: str


StreamCommand = Generate | DecodeFromHandoff | Resume
Command = Generate | DecodeFromHandoff | Resume | Abort

OUTPUTS_VERSION = 1


@dataclass(frozen=True)
class WorkerOutputs:
    """Everything a worker has for one subscriber (a router) since its last message: one per
    engine step, or several steps' merged when the subscriber reads slower than the engine
    steps. Sent on a heartbeat too, with no events, so `stats` stays fresh."""

    events: tuple[TokenEvent, ...]  # new tokens of the subscriber's requests, in step order
    failures: tuple[RequestFailed, ...]  # its requests that ended with an error
    kv_events: tuple[KVEvent, ...]  # the worker's prefix-cache changes (every subscriber)
    stats: EngineStats  # the worker's load after the last step
    version: int = OUTPUTS_VERSION
