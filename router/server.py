"""The router's own network front: the OpenAI HTTP app (uvicorn) and the gRPC service on one
event loop, bound by the process that holds the `Router`. Torch-free.

Used by `cleave serve --in-process` and by each router replica of the Ray app (direct ingress:
no proxy hop per token). With `reuse_port`, several router replicas on one node bind the same
ports (SO_REUSEPORT) and the kernel spreads connections across them; across nodes a load
balancer (a Kubernetes Service) does.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import grpc
import uvicorn

from router.app import Router
from router.grpc_server import create_grpc_server
from router.openai.api import create_app

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5


class _Server(uvicorn.Server):
    """uvicorn's server, which stops on SIGINT or SIGTERM as uvicorn does, without raising the
    signal again once it has stopped (uvicorn does, for whoever embeds it): the process that
    holds it stops on its own after. Re-raised, SIGINT ended `cleave serve --in-process` in a
    KeyboardInterrupt traceback (killed by SIGINT) and SIGTERM in exit status 143, where a
    graceful stop exits 0."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop without waiting for requests
        else:
            self.should_exit = True


class FrontEnds:
    """HTTP and gRPC servers over one `Router`. `start()` returns once both listen;
    `http_port` and `grpc_port` are then the bound ports (0 asks for any free one)."""

    def __init__(self, router: Router, host: str, http_port: int, grpc_port: int, *,
                 reuse_port: bool = False) -> None:
        self.router = router
        self.host = host
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.reuse_port = reuse_port
        self._uvicorn: _Server | None = None
        self._grpc: grpc.aio.Server | None = None
        self._http_task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None

    async def start(self) -> None:
        self._grpc, self.grpc_port = create_grpc_server(self.router, self.host, self.grpc_port,
                                                        reuse_port=self.reuse_port)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # every accepted connection inherits it (Linux): without it, a keep-alive client's
        # delayed ACKs hold each streamed chunk back by up to 40 ms (Nagle's algorithm)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((self.host, self.http_port))
        self._sock = sock
        self.http_port = sock.getsockname()[1]
        self._uvicorn = _Server(uvicorn.Config(
            create_app(self.router), log_level="warning", lifespan="off",
            timeout_keep_alive=self.router.config.http_keep_alive_s,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
        await self._grpc.start()
        self._http_task = asyncio.ensure_future(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started and not self._http_task.done():
            await asyncio.sleep(0.01)
        if self._http_task.done():
            await self._http_task  # raises why it stopped
            raise RuntimeError(f"the HTTP server on {self.host}:{self.http_port} stopped")

    @property
    def running(self) -> bool:
        return self._http_task is not None and not self._http_task.done()

    async def wait(self) -> None:
        """Until the HTTP server stops (`request_stop`, or a signal it handles)."""
        if self._http_task is not None:
            await self._http_task

    def request_stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True

    async def stop(self) -> None:
        """Finish what is in flight (up to `GRACEFUL_SHUTDOWN_S`), then close both servers."""
        self.request_stop()
        if self._http_task is not None:
            await asyncio.gather(self._http_task, return_exceptions=True)
        if self._grpc is not None:
            await self._grpc.stop(GRACEFUL_SHUTDOWN_S)
        if self._sock is not None:
            self._sock.close()
