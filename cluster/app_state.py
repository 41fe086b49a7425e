"""Reading the Cleave application's state on Ray Serve (`cluster.launch`, `cleave serve`): its
status, bounded in time (Serve's own read waits forever once its controller or Ray's GCS is
gone), a one-line description of it, and the requests still in flight."""

from __future__ import annotations

import threading
from typing import Any

APP_NAME = "cleave"
STATUS_TIMEOUT_S = 10.0  # the longest one reading of the state waits (Serve may be gone)


def app_status(timeout_s: float = STATUS_TIMEOUT_S) -> Any:
    """Serve's status of the application, or None before it exists. Raises TimeoutError when
    Serve does not answer within `timeout_s`: with its controller or Ray's GCS gone,
    `serve.status` waits forever, and `cleave serve` then hung on a signal, even a second."""
    from ray import serve

    answer: list[tuple[bool, Any]] = []

    def read() -> None:
        try:
            answer.append((True, serve.status().applications.get(APP_NAME)))
        except BaseException as exc:  # noqa: BLE001 -- raised in the caller's thread
            answer.append((False, exc))

    # a daemon thread: one left waiting on a dead cluster must not hold the process's exit
    reader = threading.Thread(target=read, name="cleave-serve-status", daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not answer:
        raise TimeoutError(f"Serve did not give the application's state within {timeout_s} s")
    ok, value = answer[0]
    if not ok:
        raise value
    return value


def describe(app: Any) -> str:
    """One line: the application's state, each deployment's running replicas, and what the
    ones short of their target are waiting for (Serve's message)."""
    if app is None:
        return "waiting for the application"
    parts, waiting = [], []
    for name, d in sorted(app.deployments.items()):
        running = sum(n for state, n in d.replica_states.items() if str(state).endswith("RUNNING"))
        total = sum(d.replica_states.values())
        parts.append(f"{name} {running}/{total}")
        if (running < total or d.status.value != "HEALTHY") and d.message.strip():
            # a failed constructor's message is a traceback: its last line says what went wrong
            waiting.append(f"{name}: {d.message.strip().splitlines()[-1].strip()[:300]}")
    line = f"{app.status.value.lower()}: " + ", ".join(parts)
    return line + (" (waiting: " + "; ".join(waiting) + ")" if waiting else "")


def serving(app: Any) -> bool:
    """A router replica runs: it serves (it started only once a decode-capable worker had
    registered), whatever else is still pending or failed."""
    if app is None:
        return False
    router = app.deployments.get("router")
    return router is not None and any(
        str(state).endswith("RUNNING") and n for state, n in router.replica_states.items())


def in_flight(timeout_s: float = 5.0) -> int:
    """Requests in flight: at one router replica and on every worker's engine (0 for what
    cannot be reached: an application not serving, or no longer)."""
    import ray
    from ray import serve

    try:
        if not serving(app_status(timeout_s)):
            return 0
        count = serve.get_deployment_handle("router", app_name=APP_NAME).status.remote().result(
            timeout_s=timeout_s)["num_in_flight"]
        entries = serve.get_deployment_handle("directory", app_name=APP_NAME).entries.remote(
            ).result(timeout_s=timeout_s)
    except Exception:  # noqa: BLE001 -- no router or directory answers: nothing reaches the workers
        return 0
    for ref in [e.actor.num_in_flight.remote() for e in entries]:
        try:
            count += ray.get(ref, timeout=timeout_s)
        except Exception:  # noqa: BLE001 -- a dead engine has nothing left to finish
            pass
    return count



def gone_or_unknown() -> bool:
    """The application is deleted, or Serve can no longer say."""
    try:
        return app_status() is None
    except Exception:  # noqa: BLE001 -- the controller is gone too
        return True
