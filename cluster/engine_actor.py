"""One worker's engine as a Ray actor: the child actor a pool replica starts and the routers call.

The pool's Serve replica (`cluster.deployments.WorkerReplica`) owns this actor and its
lifetime; routers hold its handle (from the directory) and call it directly, so a request goes
router -> engine with no hop through Serve. Every method is async and runs on the actor's one
event loop, where the engine's `AsyncEngine` also steps.

Every router replica is a subscriber: it sends its call records (`workers.contract.calls`:
commands in batches as `Submit`, `Prefill`, ...) and long-polls its output channel
(`next_outputs`, one `WorkerOutputs` message per engine step with every new token of its
requests, their failures, the KV events it has not seen and the engine's load) on a socket the
actor serves (`channel_address`, `cluster.socket_calls`), where the worker's one dispatch answers
them (`workers.serving.dispatch`). No per-token call, no stream per request, and no method
here per operation: the actor's own methods are its pool's (readiness, health, load, draining).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import TYPE_CHECKING

import ray
from ray.util.placement_group import PlacementGroup

from workers.contract.protocol import EngineStats, WorkerInfo

if TYPE_CHECKING:
    from cluster.rank_actor import RankPlace
    from cluster.settings import WorkerOptions
    from cluster.socket_calls import CallServer
    from workers.engine.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What the actor builds: one `workers.serving.worker.Worker` (settings from
    `cluster.settings`)."""

    worker_id: str
    role: str  # "prefill", "decode" or "both"
    engine: EngineConfig  # model included
    worker: WorkerOptions  # how its KV moves
    torch_threads: int | None = None  # None: torch's default
    cpu_affinity: tuple[int, ...] | None = None  # the pool's cores to claim from (None: unpinned)
    cores_per_rank: int = 1  # how many each rank claims


@dataclasses.dataclass(frozen=True)
class ActorInfo:
    """What `ready()` returns: the worker's description and where it runs."""

    worker: WorkerInfo
    pid: int
    node_id: str
    ranks: tuple[RankPlace, ...]  # where each rank actor runs (empty: ranks in this process)
    cores: tuple[int, ...] | None  # the host cores this process is pinned to (None: unpinned)


class EngineActor:
    """A `Worker` behind Ray. Build with
    `ray.remote(EngineActor).options(...).remote(spec, placement_group)`; `ready()` returns once
    the model is loaded."""

    def __init__(self, spec: EngineSpec, placement_group: PlacementGroup | None = None) -> None:
        """`placement_group`: the replica's, one bundle per rank, on this actor's node. An
        engine of more than one rank starts rank i as a Ray actor in bundle i, holding the
        bundle's resources (`cluster.rank_actor`); None: its ranks are spawned processes."""
        if spec.torch_threads:
            import torch

            torch.set_num_threads(spec.torch_threads)
        from cluster.rank_actor import RayActorLauncher
        from workers.serving.worker import Worker

        self.spec = spec
        config = spec.engine
        self.rank_launcher = (RayActorLauncher(placement_group, spec.cpu_affinity,
                                               spec.cores_per_rank)
                              if placement_group is not None and config.world_size > 1
                              else None)
        self._cores = None  # the ranks run here: this process holds their cores
        if spec.cpu_affinity is not None and self.rank_launcher is None:
            from cluster.cpu_affinity import claim_and_pin

            self._cores = claim_and_pin(spec.cpu_affinity, spec.cores_per_rank)
            logger.info("worker %s pinned to cores %s", spec.worker_id, self._cores.cores)
        self._host = ray.util.get_node_ip_address()
        self.worker = Worker.from_config(spec.worker_id, config, spec.role,
                                         rank_launcher=self.rank_launcher, host=self._host,
                                         **dataclasses.asdict(spec.worker))
        self._channel: CallServer | None = None  # started at the first `channel_address`

    async def ready(self) -> ActorInfo:
        """Once the model is loaded and the transfer agents passed the transport's self-check
        (workers that hand KV off)."""
        w = self.worker
        if w.role != "both":
            await w.agents()
        ranks = self.rank_launcher.ranks if self.rank_launcher is not None else []
        places = tuple([await r.actor.place.remote() for r in ranks])
        return ActorInfo(w.info, os.getpid(), ray.get_runtime_context().get_node_id(), places,
                         self._cores.cores if self._cores is not None else None)

    async def channel_address(self) -> tuple[str, int, bytes]:
        """Where a router sends its calls without a Ray call each (`cluster.socket_calls`): the
        host, port and token of a socket this actor serves on its node's address (where its KV
        transfer listens too), started at the first ask. Ray hands the token only to holders
        of this actor's handle."""
        if self._channel is None:
            from cluster.inprocess_client import InProcessChannel
            from cluster.socket_calls import CHANNEL_METHODS, CallServer, serve_channel

            handler = serve_channel(InProcessChannel(self.worker))
            self._channel = await CallServer(handler, CHANNEL_METHODS).start(self._host)
        return self._host, self._channel.port, self._channel.token

    # ---- load, events, health --------------------------------------------------------------

    async def stats(self) -> EngineStats:
        """The worker's load (its pool's autoscaling and `cleave drain` read it)."""
        return self.worker.stats()

    async def health(self) -> bool:
        """False once the engine loop has died or the actor was marked broken (its pool
        replica's health check; routers ask the worker on its socket)."""
        return self.worker.health()

    async def inject_fault(self, point: str, action: str, seconds: float = 0.0,
                           times: int = 1) -> None:
        """Arm a fault point in this process (`kvtransfer.faults`; the soak and tests). Raises
        unless the actor was started with CLEAVE_FAULT_INJECTION=1 in its environment."""
        from kvtransfer import faults

        faults.arm(point, action, seconds, times)

    async def resources(self) -> dict[str, int]:
        """What this worker holds for others: KV leases offered and their blocks, pulls and
        prefill calls under way (all 0 on an idle worker; the soak's leak check)."""
        return self.worker.resources()

    async def mark_broken(self, reason: str) -> None:
        """Fail health checks from now on (tests: a broken engine)."""
        self.worker.mark_broken(reason)

    async def num_in_flight(self) -> int:
        """Requests still on the engine: queued, running, or waiting for their KV."""
        st = self.worker.stats()
        return st.num_waiting + st.num_running + st.num_waiting_for_kv

    async def wait_idle(self, timeout_s: float) -> int:
        """Wait until no request is in flight and no other worker is still to pull KV from
        here (a handed-off prefix, a moved stream's blocks: each under a lease), or until
        `timeout_s` passes; returns the requests left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (await self.num_in_flight() or self.worker.resources()["leases"]) \
                and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return await self.num_in_flight()

    async def shutdown(self) -> None:
        if self._channel is not None:
            await self._channel.stop()
        await self.worker.shutdown()
