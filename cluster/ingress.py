"""The router as a Ray Serve deployment: the OpenAI HTTP app and the gRPC `Generation` service,
side by side, over one `router.app.Router` per replica.

With `router.ingress: direct` (the default) each replica serves both on the configured ports
itself (`router.server.FrontEnds`, SO_REUSEPORT so replicas on one node share them) and Serve
runs no proxy: no Ray hop per streamed chunk. With `serve`, Serve's proxies take the ports and
forward to the replica's ASGI app and gRPC methods below (what KubeRay's serve Service expects).

Each replica keeps its worker set in step with the `Directory` (every `kv_poll_interval_s`):
new workers are added (their prefix-cache snapshot seeds the index), draining ones get no new
requests, gone ones are removed (their streams fail over), and a worker an operator switched to
another role (`cleave role`: `switch_role` below, on one replica) is switched by the others too.
Requests go from here straight to the engine actors over one output channel per worker
(`cluster.worker_client.RayChannel`), which also pushes each worker's load and KV events.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, NoReturn
from collections.abc import AsyncIterator

import grpc
from ray import serve

from cluster.config import CleaveConfig
from cluster.directory import WorkerEntry
from cluster.plan_board import DirectoryBoard, plan_bounds
from cluster.settings import model_path, router_config, router_cores
from cluster.status import speculation
from cluster.worker_client import ray_worker_client
from router.app import Router
from router.channel import ChannelClient
from router.grpc_server import GenerationService
from router.openai.api import create_app
from router.proto.cleave.v1 import generate_pb2 as pb
from router.role_plan import RoleSwitch
from router.server import FrontEnds
from workers.contract.protocol import WorkerRole

logger = logging.getLogger(__name__)

WORKERS_TIMEOUT_S = 600.0  # a router replica waits this long for a first decode-capable worker
DECODE_CAPABLE = ("decode", "both")
DIRECTORY_TIMEOUT_S = 10.0  # a directory call answers within this or is tried again later


class _ServeGrpcContext:
    """What `GenerationService` needs of a gRPC context, over Serve's `RayServegRPCContext`:
    an abort sets the status the proxy returns."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return list(self._context.invocation_metadata())

    async def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        self._context.set_code(code)
        self._context.set_details(details)
        raise _Aborted(details)


class _Aborted(Exception):
    """Ends a gRPC handler with the status set on its context."""


@serve.ingress()
class RouterIngress:
    """The Serve deployment class of the router (named `router`)."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
            self, config: dict[str, Any], directory: Any, *pools: Any) -> None:
        self.config = CleaveConfig.parse(config)
        cores = router_cores(self.config)
        if cores is not None:
            from cluster.cpu_affinity import pin_process

            pin_process(cores, torch_threads=False)
        self.directory = directory
        self.pools = pools  # bound so Serve deploys them; requests go to the engine actors
        self.subscriber = f"router-{serve.get_replica_context().replica_id.unique_id}"
        entries = await self._wait_for_workers()
        self.router_config = router_config(self.config, model_path(self.config))
        self.router = Router(self.router_config, [self._client(e) for e in entries])
        self.router.draining.update(e.worker_id for e in entries if e.draining)
        if self.router.slo is not None:  # one replica's planner decides; the pools follow it
            self.router.slo.share(DirectoryBoard(directory), self.subscriber,
                                  plan_bounds(self.config))
        await self.router.start()
        self.grpc = GenerationService(self.router)
        self.front: FrontEnds | None = None
        if self.config.router.ingress == "direct":  # no Serve proxy: this replica serves
            r = self.config.router
            self.front = FrontEnds(self.router, r.host, r.http_port, r.grpc_port,
                                   reuse_port=True)
            await self.front.start()
        self._drained: set[str] = set()  # workers whose streams and hot prefixes moved off
        self._switching: set[str] = set()  # workers `switch_role` is switching (sync skips them)
        self._sync = asyncio.get_running_loop().create_task(self._sync_forever())

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.router)

    def _client(self, entry: WorkerEntry) -> ChannelClient:
        return ray_worker_client(entry.worker_id, entry.actor, self.subscriber,
                                 self.router_config.deadlines)

    async def _entries(self) -> list[WorkerEntry]:
        """The directory's entries; `asyncio.TimeoutError` past DIRECTORY_TIMEOUT_S (a
        directory being restarted must not hang the router's sync or its start-up)."""
        return await asyncio.wait_for(self.directory.entries.remote(), DIRECTORY_TIMEOUT_S)

    async def _wait_for_workers(self) -> list[WorkerEntry]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WORKERS_TIMEOUT_S
        while True:
            try:
                entries = await self._entries()
            except TimeoutError:  # the directory restarting: ask again
                entries = []
            if any(e.role in DECODE_CAPABLE and not e.draining for e in entries):
                return entries
            if loop.time() > deadline:
                raise TimeoutError(f"no decode-capable worker registered within "
                                   f"{WORKERS_TIMEOUT_S:.0f}s")
            await asyncio.sleep(0.2)

    async def _sync_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.router.kv_poll_interval_s)
            try:
                await self.sync_workers()
            except Exception:  # the next round tries again
                logger.exception("router %s: reading the directory failed", self.subscriber)

    async def sync_workers(self) -> None:
        """Bring the router's worker set in step with the directory."""
        entries = {e.worker_id: e for e in await self._entries()}
        r = self.router
        for wid in [w for w in r.clients if w not in entries]:
            logger.info("router %s: worker %s is gone", self.subscriber, wid)
            await r.remove_worker(wid)
        for wid, entry in entries.items():
            if wid not in r.clients and not entry.draining:
                try:
                    await r.add_worker(self._client(entry))
                    logger.info("router %s: added worker %s", self.subscriber, wid)
                except Exception as exc:  # noqa: BLE001 -- not ready or gone again: next round
                    logger.warning("router %s: cannot add worker %s: %s", self.subscriber,
                                   wid, exc)
            if entry.draining and wid in r.clients and wid not in r.draining:
                # its running streams move to the other workers with their KV, so the drain
                # ends without waiting for them (nor recomputing them); its hottest prefixes
                # follow, so the pool keeps their hits
                # (a drain without KV is the recompute baseline: nothing is handed off either)
                moved = await r.drain(wid, with_kv=entry.drain_with_kv,
                                      hand_off_prefixes=entry.drain_with_kv)
                self._drained.add(wid)
                logger.info("router %s: draining %s, %d streams moved", self.subscriber, wid,
                            moved)
            elif not entry.draining and wid in r.draining:  # back in rotation
                r.draining.discard(wid)
                self._drained.discard(wid)
            if entry.assigned_role is not None and wid in r.clients and \
                    wid not in self._switching and \
                    r.workers.role_of(wid).value != entry.assigned_role:
                # another replica switched it (`cleave role`): move this replica's streams off
                switch = await r.switch_role(wid, WorkerRole(entry.assigned_role))
                logger.info("router %s: %s routed as %s, %d streams moved", self.subscriber,
                            wid, switch.after.value, switch.moved)
        self._drained &= set(entries)

    # ---- gRPC (`cleave.v1.Generation`, through Serve's gRPC proxy) -------------------------

    # An error sets the status on Serve's context and raises `_Aborted`: Serve's proxy sends
    # the status set before an exception (not INTERNAL).

    async def Generate(self, request: pb.GenerateRequest,
                       grpc_context: Any) -> AsyncIterator[pb.GenerateResponse]:
        async for response in self.grpc.Generate(request, _ServeGrpcContext(grpc_context)):
            yield response

    async def Models(self, request: pb.ModelsRequest, grpc_context: Any) -> pb.ModelsResponse:
        return await self.grpc.Models(request, _ServeGrpcContext(grpc_context))

    async def Health(self, request: pb.HealthRequest, grpc_context: Any) -> pb.HealthResponse:
        return await self.grpc.Health(request, _ServeGrpcContext(grpc_context))

    async def Embed(self, request: pb.EmbedRequest, grpc_context: Any) -> pb.EmbedResponse:
        return await self.grpc.Embed(request, _ServeGrpcContext(grpc_context))

    # ---- operations ------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        """Pools, workers, loads and routing counters as this replica sees them."""
        r = self.router
        loads = {load.worker_id: load for load in r.loads()}
        c = r.counters
        workers = []
        for wid, info in sorted(r.worker_infos.items()):
            load, stats = loads.get(wid), r.workers.stats(wid)
            workers.append({"worker_id": wid, "role": info.role.value,
                            "routed_as": r.workers.role_of(wid).value,
                            "healthy": bool(load and load.healthy) or wid in r.draining,
                            "draining": wid in r.draining,
                            "num_waiting": load.num_waiting if load else None,
                            "num_running": load.num_running if load else None,
                            "kv_usage": load.kv_usage if load else None,
                            "speculative": speculation(stats),
                            "lora_adapters": list(stats.lora_adapters) if stats else []})
        nodes = {e.worker_id: e.node_id for e in await self._entries()}
        for w in workers:
            w["node_id"] = nodes.get(str(w["worker_id"]))
        return {"router": self.subscriber, "model": r.model_name, "workers": workers,
                "num_requests": c.num_requests, "num_in_flight": r.in_flight,
                "num_disaggregated": c.num_disaggregated,
                "aggregated": dict(c.aggregated), "num_prompt_tokens": c.num_prompt_tokens,
                "num_predicted_cached_tokens": c.num_predicted_cached_tokens,
                "num_cached_tokens": c.num_cached_tokens, "fallbacks": dict(c.fallbacks),
                "num_live_migrations": c.num_live_migrations,
                "num_live_migrations_failed": c.num_live_migrations_failed,
                "planner": None if r.slo is None else r.slo.status()}

    async def drained(self, worker_id: str) -> bool:
        """Whether this replica has moved the draining worker's streams and handed off its
        hot prefixes (`Router.drain`); True for a worker it does not route to."""
        return worker_id in self._drained or worker_id not in self.router.clients

    async def switch_role(self, worker_id: str, role: str) -> RoleSwitch:
        """Route a worker started as "both" under `role` ("prefill", "decode" or "both") from
        now on (`cleave role`): this replica moves its streams away with their KV and switches
        it (`Router.switch_role`), then records the role in the directory, where the other
        replicas read it. Refused (`ValueError`) while the SLO planner runs: it owns the roles
        of the switchable workers and would switch them back at its next tick."""
        r = self.router
        if r.slo is not None:
            raise ValueError(f"the SLO planner (slo_ttft_ms / slo_itl_ms set) owns the roles of "
                             f"the workers started as 'both'; it would undo switching "
                             f"{worker_id!r} to {role!r} at its next tick")
        if worker_id not in r.clients:
            raise ValueError(f"no worker {worker_id!r} in router {self.subscriber}; expected one "
                             f"of {sorted(r.clients)}")
        if worker_id in self._switching:
            raise ValueError(f"worker {worker_id!r} is switching role already")
        want = WorkerRole(role)
        self._switching.add(worker_id)
        try:
            switch = await r.switch_role(worker_id, want)
            await asyncio.wait_for(self.directory.assign_role.remote(worker_id, want.value),
                                   DIRECTORY_TIMEOUT_S)
        finally:
            self._switching.discard(worker_id)
        return switch

    async def check_health(self) -> None:
        """Serve restarts a router replica whose directory sync died. No healthy worker is not
        the router's fault: requests get 503 until a pool recovers."""
        if self._sync.done() and not self._sync.cancelled():
            raise RuntimeError(f"router {self.subscriber}: the directory sync stopped: "
                               f"{self._sync.exception()!r}")
        if self.front is not None and not self.front.running:
            raise RuntimeError(f"router {self.subscriber}: its HTTP server stopped")

    async def __del__(self) -> None:
        """Serve is removing this replica: stop taking connections, finish what is in flight
        (up to `router.server.GRACEFUL_SHUTDOWN_S`), then stop."""
        self._sync.cancel()
        if self.front is not None:
            await self.front.stop()
        await self.router.stop()

