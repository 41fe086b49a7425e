"""Ray for the cluster tests: one local instance per test module that needs it (fractional
CPUs so every replica fits 2 cores, one torch thread per engine), the Cleave application
deployed on it, and helpers to watch Serve."""

from __future__ import annotations

import glob
import os
import pathlib
import socket
import time
from typing import Any, Callable

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

RAY_CPUS = 8  # logical: replicas reserve fractions of these
APP = "cleave"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def app_config(model: str, **overrides: Any) -> dict[str, Any]:
    """A small deployment of `model`: 1 prefill + 1 decode replica by default."""
    http, grpc = free_ports(2)
    pool = {"cpus_per_rank": 0.25, "engine": {"num_blocks": 256}}
    config = {"model": {"path": model, "served_model_name": "tiny"},
              "pools": {"prefill": dict(pool), "decode": dict(pool)},
              "router": {"http_port": http, "grpc_port": grpc, "disagg_threshold_tokens": 16,
                         "kv_poll_interval_s": 0.25}}
    for key, value in overrides.items():
        config[key] = value
    return config


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str,
             interval_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


def running_replicas(deployment: str) -> int:
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or deployment not in app.deployments:
        return 0
    states = app.deployments[deployment].replica_states
    return sum(n for state, n in states.items() if str(state).endswith("RUNNING"))


def router_status() -> dict[str, Any]:
    from ray import serve

    return serve.get_deployment_handle("router", app_name=APP).status.remote().result(
        timeout_s=30)


def directory_entries() -> list[Any]:
    from ray import serve

    return serve.get_deployment_handle("directory", app_name=APP).entries.remote().result(
        timeout_s=30)


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray instance for this module, stopped after it."""
    import ray

    ray.shutdown()
    ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 1024**2)
    yield ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed Ray-app test shows the Serve replicas' warnings and errors (their logs live in
    the Ray session's folder, gone with a CI machine): the cause of a 500 is there."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed or "local_ray" not in item.fixturenames:
        return
    logs = sorted(glob.glob("/tmp/ray/session_latest/logs/serve/replica_*.log"))
    lines = [f"{os.path.basename(path)}: {line[:400]}" for path in logs
             for line in pathlib.Path(path).read_text(errors="replace").splitlines()
             if line.startswith(("WARNING", "ERROR")) or "Error" in line]
    if lines:
        report.sections.append(("Serve replicas' warnings and errors", "\n".join(lines[-80:])))
