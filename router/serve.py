"""Running the router: HTTP (uvicorn) and gRPC (grpc.aio) in one event loop, over in-process
engine workers (aggregated serving on one machine).

`serve_local` blocks until SIGINT/SIGTERM; `LocalServer` runs the same stack on a background
thread for tests and embedding. Building the workers imports torch (in `workers`), the router
modules themselves never do.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from router.app import Router, RouterConfig
from router.grpc_server import create_grpc_server
from router.inprocess import InProcessWorkerClient
from router.openai.api import create_app

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5


@dataclass(frozen=True)
class LocalServeConfig:
    model_path: str
    num_workers: int = 1
    host: str = "127.0.0.1"
    http_port: int = 8000  # 0: any free port
    grpc_port: int = 50051  # 0: any free port
    router: dict[str, Any] = field(default_factory=dict)  # RouterConfig fields
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields besides model

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {self.num_workers}")
        for name in ("http_port", "grpc_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")


def build_workers(model_path: str, num_workers: int,
                  engine: dict[str, Any]) -> list[InProcessWorkerClient]:
    """One engine per worker, each with its own KV cache (blocking: loads the model)."""
    from workers.config import EngineConfig
    from workers.worker import Worker

    config = EngineConfig(model=model_path, **engine)
    return [InProcessWorkerClient(Worker.from_config(f"worker-{i}", config))
            for i in range(num_workers)]


class _Stack:
    """Router, HTTP and gRPC servers sharing one running event loop."""

    def __init__(self, config: LocalServeConfig, clients: list[InProcessWorkerClient]) -> None:
        self.config = config
        self.clients = clients
        self.router = Router(RouterConfig(config.model_path, **config.router), list(clients))
        self.http_port = 0
        self.grpc_port = 0
        self._uvicorn: uvicorn.Server | None = None

    async def serve(self, ready: threading.Event | None = None) -> None:
        c = self.config
        await self.router.start()
        grpc_server, self.grpc_port = create_grpc_server(self.router, c.host, c.grpc_port)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((c.host, c.http_port))
        self.http_port = sock.getsockname()[1]
        self._uvicorn = uvicorn.Server(uvicorn.Config(
            create_app(self.router), log_level="warning", lifespan="off",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
        await grpc_server.start()
        http_task = asyncio.ensure_future(self._uvicorn.serve(sockets=[sock]))
        try:
            while not self._uvicorn.started and not http_task.done():
                await asyncio.sleep(0.01)
            if ready is not None:
                ready.set()
            logger.info("serving %s: HTTP on %s:%d, gRPC on %s:%d", self.router.model_name,
                        c.host, self.http_port, c.host, self.grpc_port)
            await http_task
        finally:
            self._uvicorn.should_exit = True
            await asyncio.gather(http_task, return_exceptions=True)
            await grpc_server.stop(GRACEFUL_SHUTDOWN_S)
            await self.router.stop()
            for client in self.clients:
                await client.close()
            sock.close()

    def request_stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True


def serve_local(model_path: str, num_workers: int = 1, host: str = "127.0.0.1",
                http_port: int = 8000, grpc_port: int = 50051,
                api_keys: tuple[str, ...] | list[str] = (), *,
                router_options: dict[str, Any] | None = None,
                engine_options: dict[str, Any] | None = None) -> None:
    """Serve `model_path` with `num_workers` in-process engines until SIGINT or SIGTERM.

    `router_options` are `RouterConfig` fields (served_model_name, policy, max_in_flight,
    max_body_bytes, max_n, ...), `engine_options` `EngineConfig` fields (block_size,
    num_blocks, max_model_len, ...). Must run on the main thread (uvicorn takes the signals).
    """
    config = LocalServeConfig(model_path, num_workers, host, http_port, grpc_port,
                              router={**(router_options or {}), "api_keys": tuple(api_keys)},
                              engine=engine_options or {})
    stack = _Stack(config, build_workers(model_path, num_workers, config.engine))
    asyncio.run(stack.serve())


class LocalServer:
    """The `serve_local` stack on a background thread: `start()` returns once both ports
    listen, `stop()` shuts everything down and joins the thread."""

    def __init__(self, config: LocalServeConfig) -> None:
        self.config = config
        self.clients = build_workers(config.model_path, config.num_workers, config.engine)
        self._stack = _Stack(config, self.clients)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="cleave-router", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def router(self) -> Router:
        return self._stack.router

    @property
    def http_port(self) -> int:
        return self._stack.http_port

    @property
    def grpc_port(self) -> int:
        return self._stack.grpc_port

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        try:
            self.loop.run_until_complete(self._stack.serve(self._ready))
        except BaseException as exc:  # surfaced by start()
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
