"""The loop Cleave's own processes run: uvloop's (as Ray's workers run theirs), unless
`CLEAVE_USE_UVLOOP=0`; the in-process server streams on it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from cluster import event_loop

uvloop = pytest.importorskip("uvloop", reason="uvloop is a dependency on Linux")


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_run_uses_uvloop_by_default(monkeypatch):
    monkeypatch.delenv("CLEAVE_USE_UVLOOP", raising=False)
    assert event_loop.run(_loop_type()) is uvloop.Loop


@pytest.mark.parametrize("value", ["0", "false", "No"])
def test_cleave_use_uvloop_0_keeps_asyncios_loop(monkeypatch, value):
    monkeypatch.setenv("CLEAVE_USE_UVLOOP", value)
    loop_type = event_loop.run(_loop_type())
    assert not issubclass(loop_type, uvloop.Loop)
    assert issubclass(loop_type, asyncio.BaseEventLoop)


def test_the_in_process_server_streams_on_uvloop_and_releases_each_slot(tiny_model):
    from tests.router.conftest import start_server

    server = start_server(tiny_model, num_workers=1)
    try:
        assert isinstance(server.loop, uvloop.Loop)
        with httpx.stream("POST", f"http://127.0.0.1:{server.http_port}/v1/completions",
                          headers={"Authorization": "Bearer test-key"}, timeout=60,
                          json={"prompt": [1, 2, 3], "max_tokens": 8, "stream": True,
                                "ignore_eos": True}) as r:
            chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
        assert r.status_code == 200 and len(chunks) >= 1
        assert server.call(_in_flight(server)) == 0  # the slot went back when the stream ended
    finally:
        server.stop()


async def _in_flight(server) -> int:  # noqa: ANN001 - a LocalServer
    for _ in range(100):  # the release runs as the response's background task, just after
        if server.router.in_flight == 0:
            break
        await asyncio.sleep(0.01)
    return server.router.in_flight
