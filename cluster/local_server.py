"""Running the router: HTTP (uvicorn) and gRPC (grpc.aio) in one event loop, over in-process
engine workers on one machine: aggregated ("both") workers, and/or prefill and decode pools
joined by KV handoffs over a real transport (TCP on 127.0.0.1 by default).

What runs is an `InProcessPlan` (`cluster.settings`): `cleave serve --in-process` makes it
from the cluster config, as the Ray app makes its settings; `LocalServeConfig` is a shorthand
for tests and embedding (one engine for every pool). `serve_local` blocks until SIGINT/SIGTERM;
`LocalServer` runs the same stack on a background thread. Building the workers imports torch
(in `workers`), the router modules themselves never do.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from cluster import event_loop
from cluster.config import RouterSettings
from cluster.inprocess_client import SUBSCRIBER, in_process_client
from cluster.settings import InProcessPlan, PoolPlan, WorkerOptions
from router.app import Router, RouterConfig
from router.channel import ChannelClient
from router.server import FrontEnds

if TYPE_CHECKING:
    from workers.serving.worker import Worker

logger = logging.getLogger(__name__)


# worker ids are `<prefix>-i`; an aggregated pool's workers are `worker-i`
_ID_PREFIX = {"aggregated": "worker"}


@dataclass(frozen=True)
class LocalServeConfig:
    """A shorthand for an `InProcessPlan` (tests, embedding): one engine for every pool, and
    any fields of `RouterConfig`, `EngineConfig` and `WorkerOptions`, the cluster config's or
    not; what is left out takes those records' defaults."""

    model_path: str
    # aggregated ("both") workers; None: 1 without prefill/decode pools, else 0
    num_workers: int | None = None
    host: str = RouterSettings.model_fields["host"].default
    http_port: int = RouterSettings.model_fields["http_port"].default  # 0: any free port
    grpc_port: int = RouterSettings.model_fields["grpc_port"].default  # 0: any free port
    router: dict[str, Any] = field(default_factory=dict)  # RouterConfig fields
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields besides model
    num_prefill_workers: int = 0  # "prefill" workers (prompt to first token, KV handed off)
    num_decode_workers: int = 0  # "decode" workers (continue handoffs, run short prompts)
    transport: str = WorkerOptions.transport  # the KV transport between workers
    worker: dict[str, Any] = field(default_factory=dict)  # WorkerOptions fields (lease_s, ...)

    def __post_init__(self) -> None:
        for name in ("num_prefill_workers", "num_decode_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_workers is not None and self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        if self.num_both_workers + self.num_decode_workers < 1:
            raise ValueError(
                f"at least one worker must decode: num_workers={self.num_workers}, "
                f"num_decode_workers={self.num_decode_workers} (num_prefill_workers="
                f"{self.num_prefill_workers} only prefill)")
        for name in ("http_port", "grpc_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")

    @property
    def num_both_workers(self) -> int:
        if self.num_workers is not None:
            return self.num_workers
        return 0 if self.num_prefill_workers or self.num_decode_workers else 1

    def plan(self) -> InProcessPlan:
        from workers.engine.config import EngineConfig

        engine = EngineConfig(model=self.model_path, **self.engine)
        worker = WorkerOptions(**{"transport": self.transport, **self.worker})
        counts = (("aggregated", "both", self.num_both_workers),
                  ("prefill", "prefill", self.num_prefill_workers),
                  ("decode", "decode", self.num_decode_workers))
        return InProcessPlan(RouterConfig(self.model_path, **self.router),
                             tuple(PoolPlan(name, role, n, engine, worker)
                                   for name, role, n in counts if n),
                             self.host, self.http_port, self.grpc_port)


def build_workers(plan: InProcessPlan, process_per_worker: bool = False) -> list[ChannelClient]:
    """Each pool's workers, one engine each with its own KV cache (blocking: loads the model).
    Ids: `worker-i` (aggregated), `prefill-i`, `decode-i`. `process_per_worker`: each in a
    process of its own (`cluster.process_worker`), pinned to its pool's `cpu_affinity`, or
    unpinned with an equal share of this machine's cores as torch threads."""
    specs = [(f"{_ID_PREFIX.get(pool.name, pool.name)}-{i}", pool)
             for pool in plan.pools for i in range(pool.replicas)]
    if process_per_worker:
        from cluster.process_worker import ProcessChannel, ProcessWorkerSpec, share_of_cores

        threads = share_of_cores(sum(pool.cpu_affinity is None for _, pool in specs))
        channels: list[ProcessChannel] = []
        try:
            for wid, pool in specs:
                channels.append(ProcessChannel(ProcessWorkerSpec(
                    wid, pool.engine, pool.role, plan.host, asdict(pool.worker),
                    pool.cpu_affinity, pool.cores_per_rank, threads)).start())
        except BaseException:
            for channel in channels:  # nothing started is left running
                if channel.process is not None:
                    channel.process.kill()
            raise
        return [ChannelClient(c, SUBSCRIBER, plan.router.deadlines) for c in channels]
    from workers.serving.worker import Worker

    return [in_process_client(Worker.from_config(wid, pool.engine, pool.role, host=plan.host,
                                                 **asdict(pool.worker)), plan.router.deadlines)
            for wid, pool in specs]


class _Stack:
    """Router, HTTP and gRPC servers sharing one running event loop."""

    def __init__(self, plan: InProcessPlan, clients: list[ChannelClient]) -> None:
        self.config = plan
        self.clients = clients
        self.router = Router(plan.router, list(clients))
        self.front = FrontEnds(self.router, plan.host, plan.http_port, plan.grpc_port)

    @property
    def http_port(self) -> int:
        return self.front.http_port

    @property
    def grpc_port(self) -> int:
        return self.front.grpc_port

    async def serve(self, ready: Callable[[int, int], None] | None = None) -> None:
        """Serve until the HTTP server stops; `ready(http_port, grpc_port)` once both listen
        (and the HTTP server holds SIGINT and SIGTERM)."""
        await self.router.start()
        await self.front.start()
        try:
            if ready is not None:
                ready(self.http_port, self.grpc_port)
            logger.info("serving %s: HTTP on %s:%d, gRPC on %s:%d", self.router.model_name,
                        self.config.host, self.http_port, self.config.host, self.grpc_port)
            await self.front.wait()
        finally:
            await self.front.stop()
            await self.router.stop()
            for client in self.clients:
                await client.close()

    def request_stop(self) -> None:
        self.front.request_stop()


def serve_local(plan: InProcessPlan, process_per_worker: bool = False,
                ready: Callable[[int, int], None] | None = None) -> None:
    """Serve `plan` (`cluster.settings.in_process_plan`) until SIGINT or SIGTERM; `ready`
    as `_Stack.serve`'s. Must run on the main thread (uvicorn takes the signals)."""
    stack = _Stack(plan, build_workers(plan, process_per_worker))
    event_loop.run(stack.serve(ready))


class LocalServer:
    """The `serve_local` stack on a background thread: `start()` returns once both ports
    listen, `stop()` shuts everything down and joins the thread."""

    def __init__(self, config: LocalServeConfig | InProcessPlan,
                 process_per_worker: bool = False) -> None:
        self.config = config
        self.plan = config if isinstance(config, InProcessPlan) else config.plan()
        self.clients = build_workers(self.plan, process_per_worker)
        self._stack = _Stack(self.plan, self.clients)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="cleave-router", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def router(self) -> Router:
        return self._stack.router

    @property
    def workers(self) -> list[Worker]:
        """The in-process workers behind the clients (tests look inside them; not with
        `process_per_worker`)."""
        # in process, each client's channel is an `InProcessChannel`, which holds its worker
        return [c.channel.worker  # type: ignore[attr-defined]  # an InProcessChannel's
                for c in self.clients]

    @property
    def http_port(self) -> int:
        return self._stack.http_port

    @property
    def grpc_port(self) -> int:
        return self._stack.grpc_port

    def _run(self) -> None:
        self.loop = event_loop.new_event_loop()
        try:
            self.loop.run_until_complete(self._stack.serve(lambda *_: self._ready.set()))
        except BaseException as exc:  # noqa: BLE001 -- surfaced by start()
            self._error = exc
            self._ready.set()
        finally:
            self.loop.close()

    def start(self, timeout_s: float = 60.0) -> LocalServer:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the server did not start within {timeout_s}s")
        if self._error is not None:
            raise RuntimeError(f"the server failed to start: {self._error!r}") from self._error
        return self

    def call(self, coro: Any, timeout_s: float = 30.0) -> Any:
        """Run a coroutine on the server's loop (e.g. to read a worker's stats) and wait."""
        if self.loop is None:
            raise RuntimeError("the server is not running")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.loop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stack.request_stop)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the server did not stop within {timeout_s}s")
