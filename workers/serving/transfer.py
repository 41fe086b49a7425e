"""A worker's side of the KV handoff: its transfer agents (one per tensor-parallel rank's shard
of the cache), the leases it offers, and the pulls it makes. No torch at import.

The agents run where the caches are: in this process for a single-rank engine (or a CPU
pipeline-parallel group, whose caches this process maps), or in each rank of a worker group,
driven from here through `kvtransfer.remote.RemoteAgent` (same interface).

A prefilled request's blocks are offered under one lease per rank; once every rank's lease has
ended (pulled, cancelled or expired) `free_held(request_id)` runs, which frees the blocks between
steps. A pull lands every rank's heads from the handoff records that hold them; any transfer
error is a `KVPullFailed` naming its kind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from workers.contract.protocol import KVPullFailed

if TYPE_CHECKING:
    from kvtransfer import KVLayout, RemoteAgent, TransferAgent
    from kvtransfer.handoff import KVHandoff
    from workers.engine.core import Engine

logger = logging.getLogger(__name__)

Pull = Callable[[list[int]], Awaitable[None]]
PULL_RATE_WEIGHT = 0.2  # of each pull in the moving average of the pull rate


def kv_layouts(engine: Engine) -> list[KVLayout]:
    """The transfer layer's view of each TP rank's share of the engine's cache (one agent per
    rank)."""
    from kvtransfer import KVLayout

    from workers.kernels.kv_quant import encoding

    by_rank = engine.kv_caches_by_rank()
    return [KVLayout.from_caches(caches, tp_rank=r, tp_size=len(by_rank),
                                 encoding=encoding(caches[0].dtype))
            for r, caches in enumerate(by_rank)]


class WorkerTransfer:
    """The transfer agents of one worker's engine, started on first use. Event-loop thread."""

    def __init__(self, worker_id: str, engine: Engine, free_held: Callable[[str], None], *,
                 transport: str, host: str, lease_s: float, pull_timeout_s: float) -> None:
        """`free_held(request_id)`: called (on the event loop) once every lease of a request
        has ended. `lease_s`: how long offered blocks wait for their puller at most;
        `pull_timeout_s`: how long a pull waits for its KV to land."""
        for name, value in (("lease_s", lease_s), ("pull_timeout_s", pull_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        self.worker_id = worker_id
        self.engine = engine
        self.free_held = free_held
        self.transport = transport
        self.host = host
        self.lease_s = lease_s
        self.pull_timeout_s = pull_timeout_s
        self.started: list[TransferAgent | RemoteAgent] = []  # empty until `agents()` ran
        self._lock = asyncio.Lock()
        # offered blocks -> [request id, leases not yet ended] of the held requests they belong
        # to (one tuple may be held twice); a request holds one lease per TP rank
        self._leased: dict[tuple[int, ...], list[list]] = {}

    async def agents(self) -> list[TransferAgent | RemoteAgent]:
        """The agents, one per TP rank (each serves and pulls that rank's heads), listening."""
        async with self._lock:
            if not self.started:
                self.started = await self._start_agents()
            return self.started

    async def _start_agents(self) -> list[TransferAgent | RemoteAgent]:
        from kvtransfer import RemoteAgent, TransferAgent, TransportConfig, self_check

        config = TransportConfig(self.transport, self.host)
        hosts = self.engine.kv_agent_hosts()
        if hosts is not None:  # each rank checks its transport as its agent starts
            agents: list = []
            try:
                for host in hosts:
                    agents.append(await RemoteAgent.connect(host, config,
                                                            on_release=self._on_release))
            except BaseException:
                for agent in agents:
                    await agent.close()
                raise
            return agents
        # the transport moves a test pattern to itself first: a broken path is an error here,
        # at start, not a slow or failed first handoff
        await self_check(config)
        agents = [TransferAgent(layout, caches, config, on_release=self._on_release)
                  for layout, caches in zip(kv_layouts(self.engine),
                                            self.engine.kv_caches_by_rank())]
        for agent in agents:
            await agent.start()
        return agents

    def offer(self, request_id: str, block_ids: list[int], decode_tp_size: int) -> KVHandoff:
        """Lease a held request's blocks for a decode worker of `decode_tp_size` ranks to pull.
        Keys and values are split by heads: every rank offers its heads, each lease waiting for
        the decode ranks that need them (decode TP / this TP when larger, else 1). A latent
        cache (MLA) is whole on every rank: rank 0 alone offers it, once per decode rank. Call
        with the agents started (`agents()`), with no await between the prefill's end and
        this."""
        from kvtransfer.handoff import KVHandoff

        agents = self.started
        if agents[0].layout.kind == "latent":
            agents, readers = agents[:1], decode_tp_size
        else:
            readers = max(1, decode_tp_size // len(agents))
        handoffs = [agent.offer(request_id, block_ids, lease_s=self.lease_s, readers=readers)
                    for agent in agents]
        self._leased.setdefault(tuple(block_ids), []).append([request_id, len(handoffs)])
        return KVHandoff(tuple(handoffs))

    def _on_release(self, block_ids: Sequence[int]) -> None:
        """A lease ended: once every rank's lease of the request ended, free its blocks."""
        key = tuple(block_ids)
        owners = self._leased.get(key)
        if not owners:
            logger.error("worker %s: a lease ended on blocks %s it never offered",
                         self.worker_id, list(key)[:8])
            return
        owners[0][1] -= 1
        if owners[0][1] > 0:
            return
        request_id = owners.pop(0)[0]
        if not owners:
            del self._leased[key]
        self.free_held(request_id)

    @property
    def num_leases(self) -> int:
        """Leases offered and not yet ended, over every rank."""
        return sum(agent.num_leases for agent in self.started)

    def cancel(self, request_id: str) -> None:
        """End the request's leases now (their blocks are freed through `free_held`)."""
        for agent in self.started:
            agent.cancel(request_id)

    async def puller(self, request_id: str, handoff: KVHandoff) -> Pull:
        """The pull of `handoff` into given blocks: every local rank's agent pulls its heads
        from the records that hold them. The pull raises `KVPullFailed`."""
        from kvtransfer import TransferError

        agents = await self.agents()

        async def pull(block_ids: list[int]) -> None:
            # every rank's pull ends (landed or failed) before the blocks may be reused
            start = time.perf_counter()
            results = await asyncio.gather(*(agent.pull(list(handoff.ranks), block_ids,
                                                        timeout=self.pull_timeout_s)
                                             for agent in agents), return_exceptions=True)
            read_bytes = 0
            for result in results:
                if isinstance(result, TransferError):
                    raise KVPullFailed(request_id, type(result).__name__, str(result)) from None
                if isinstance(result, BaseException):
                    raise result
                read_bytes += result.read_bytes
            # the rate of the reads it went in, every rank's (each merged with other pulls from
            # the same source rank)
            self._measured(read_bytes, time.perf_counter() - start)

        return pull

    def _measured(self, num_bytes: int, seconds: float) -> None:
        """A pull's rate into the engine's moving average (reported in its `EngineStats`: the
        router prices a prefix fetch with it)."""
        if seconds <= 0:
            return
        rate, old = num_bytes / seconds, self.engine.kv_pull_bytes_per_s
        self.engine.kv_pull_bytes_per_s = rate if not old else old + PULL_RATE_WEIGHT * (rate
                                                                                        - old)

    async def close(self) -> None:
        """Stop serving KV: every lease ends."""
        agents, self.started = self.started, []
        for agent in agents:
            await agent.close()
