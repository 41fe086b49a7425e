"""Where a routed request started, as the orchestrator hands it to the generation factory
(`router.streams.GenerationFactory`): `Start`, and `Handover`, the decode half of a
disaggregated request while its KV is on the way. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.worker_client import TokenStream, WorkerClient
from workers.contract.protocol import TokenEvent

if TYPE_CHECKING:
    from kvtransfer.handoff import KVHandoff


@dataclass
class Handover:
    """The decode half of a disaggregated request while its KV is on the way."""

    prefill: WorkerClient  # holds the prompt's blocks under a lease until the pull ends
    decode: WorkerClient
    handoff: KVHandoff
    started: float  # when the decode worker was given the handoff (time.monotonic())


@dataclass(frozen=True)
class Start:
    """A request whose first event arrived: `stream` yields the rest (`DONE`: it ended at its
    first token). `worker_id` sampled the first token; `decode_worker_id`, when set, streams
    the rest (`handover`: after pulling the KV from `worker_id`)."""

    first: TokenEvent
    stream: TokenStream
    worker_id: str
    predicted_cached_tokens: int  # prompt tokens the prefix index expected cached there
    decode_worker_id: str | None = None
    handover: Handover | None = None

    @property
    def streamer(self) -> str:
        """The worker that streams the tokens after the first."""
        return self.decode_worker_id or self.worker_id


class _Done:
    """The stream of a request that ended at its first token."""

    def __aiter__(self) -> _Done:
        return self

    async def __anext__(self) -> TokenEvent:
        raise StopAsyncIteration

    async def aclose(self) -> None:
        pass


DONE: TokenStream = _Done()

__all__ = ["DONE", "Handover", "Start"]
