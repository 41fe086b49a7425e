"""A real router (HTTP + gRPC) over real in-process engine workers on the tiny model."""

from __future__ import annotations

import time
from typing import Callable

import pytest

from cluster.local_server import LocalServeConfig, LocalServer

API_KEY = "test-key"
MAX_BODY_BYTES = 64 * 1024
NUM_BLOCKS = 96  # per worker; small so a leaked request shows in the free-block count


def start_server(model: str, num_workers: int = 2, **router: object) -> LocalServer:
    config = LocalServeConfig(model, num_workers=num_workers, http_port=0, grpc_port=0,
                              router={"api_keys": (API_KEY,), "max_body_bytes": MAX_BODY_BYTES,
                                      "kv_poll_interval_s": 0.2, **router},
                              engine={"num_blocks": NUM_BLOCKS, "max_num_batched_tokens": 512})
    return LocalServer(config).start()


def start_pools(model: str, *, threshold: int, worker: dict | None = None,
                engine: dict | None = None, **serve: object) -> LocalServer:
    """A server whose layout (aggregated and/or prefill and decode pools) `serve` gives, with
    prompts shorter than `threshold` uncached tokens kept off the prefill pool; `engine`:
    engine settings beside the cache's size."""
    config = LocalServeConfig(model, http_port=0, grpc_port=0,
                              router={"api_keys": (API_KEY,), "kv_poll_interval_s": 0.2,
                                      "disagg_threshold_tokens": threshold},
                              engine={"num_blocks": NUM_BLOCKS, "max_num_batched_tokens": 512,
                                      **(engine or {})},
                              worker=worker or {}, **serve)
    return LocalServer(config).start()


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = start_server(tiny_model)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return f"http://127.0.0.1:{server.http_port}"


def slow_steps(server: LocalServer, delay_s: float) -> LocalServer:
    """Slow every engine step of `server`'s workers by `delay_s` (a stream is still running
    when a test moves it or kills its worker)."""
    for client in server.clients:
        engine = client.channel.worker.engine
        real_step = engine.step

        def slow_step(real_step=real_step):
            time.sleep(delay_s)
            return real_step()

        engine.step = slow_step
    return server


def free_blocks(server: LocalServer) -> list[int]:
    return [server.call(c.stats()).num_free_blocks for c in server.clients]


def wait_until(condition: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """Poll `condition` every 50 ms until it holds or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def all_blocks_free(server: LocalServer) -> bool:
    return free_blocks(server) == [NUM_BLOCKS] * len(server.clients)
