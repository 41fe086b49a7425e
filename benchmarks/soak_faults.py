"""The soak's faults, injected into a live Cleave application on Ray from the driver.

Server-side faults reach the running processes: engine actors killed (`ray.kill`, Serve replaces
the replica), a router or the directory replica killed (Serve restarts it), and fault points
armed in an engine actor's process (`EngineActor.inject_fault`, `kvtransfer.faults`: a KV pull
that fails or stalls past its timeout, an engine step that hangs past the watchdog), and a pool
scaled down and up under load (a replica stopped as Serve stops one on scale-down: drained
first, then killed; Serve starts its replacement). Hostile
input goes through the front door (malformed, oversized, out-of-range bodies) and must be
refused with an OpenAI-shaped 4xx. Client-side faults (disconnects, gRPC cancel and deadline,
duplicate request ids) are `soak_workload.Variant`s.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import httpx

APP = "cleave"
SERVER_FAULTS = ("kill_prefill", "kill_decode", "kv_pull_raise", "kv_pull_stall",
                 "step_stall", "kill_router", "kill_directory", "scale_down_up")
INPUT_FAULTS = ("malformed_json", "oversized_body", "bad_seed", "unknown_field",
                "lone_surrogate", "missing_key")


@dataclass
class Injected:
    fault: str
    target: str
    ok: bool = True  # for input faults: refused as it should be
    detail: str = ""
    skipped: bool = False  # not injected: no target alive (all being replaced), or it died first


class Cluster:
    """What the driver can reach of the application: the directory's worker entries (each
    with its engine actor) and the Serve replicas' actors."""

    def __init__(self, pull_timeout_s: float, step_timeout_s: float) -> None:
        self.pull_timeout_s = pull_timeout_s
        self.step_timeout_s = step_timeout_s

    def entries(self, pool: str | None = None) -> list:
        from ray import serve

        entries = serve.get_deployment_handle("directory", app_name=APP).entries.remote() \
            .result(timeout_s=30)
        return [e for e in entries if pool is None or e.pool == pool]

    def stats(self) -> dict:
        """Each live worker's `EngineStats`, asked now."""
        import ray

        entries = self.entries()
        refs = [e.actor.stats.remote() for e in entries]
        out = {}
        for entry, ref in zip(entries, refs):
            try:
                out[entry.worker_id] = ray.get(ref, timeout=30)
            except Exception:  # noqa: BLE001 -- a replica being replaced: not counted
                pass
        return out

    def replica_actors(self, deployment: str) -> list[str]:
        from ray.util.state import list_actors

        name = f"ServeReplica:{APP}:{deployment}"
        return [a.name for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000)
                if a.class_name == name]

    def inject(self, fault: str, rng: random.Random) -> Injected:
        import ray

        if fault == "scale_down_up":
            pool = rng.choice(("prefill", "decode"))
            names = self.replica_actors(f"pool-{pool}")
            if not names:
                return Injected(fault, "-", False, f"no {pool} replica alive", skipped=True)
            name = rng.choice(sorted(names))
            replica = ray.get_actor(name, namespace="serve")
            ray.get(replica.perform_graceful_shutdown.remote(), timeout=120)  # drains
            ray.kill(replica, no_restart=True)
            return Injected(fault, name)
        if fault in ("kill_router", "kill_directory"):
            deployment = "router" if fault == "kill_router" else "directory"
            names = self.replica_actors(deployment)
            if not names:
                return Injected(fault, "-", False, f"no {deployment} replica alive", skipped=True)
            name = rng.choice(sorted(names))
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            return Injected(fault, name)
        pool = "prefill" if fault in ("kill_prefill", "kv_pull_stall") else "decode"
        if fault == "step_stall":
            pool = rng.choice(("prefill", "decode"))
        if fault == "kv_pull_raise":
            pool = "decode"
        entries = self.entries(pool)
        if not entries:
            return Injected(fault, "-", False, f"no {pool} worker registered", skipped=True)
        entry = rng.choice(sorted(entries, key=lambda e: e.worker_id))
        if fault.startswith("kill_"):
            ray.kill(entry.actor, no_restart=True)
        elif fault == "kv_pull_raise":
            ray.get(entry.actor.inject_fault.remote("kv.pull", "raise"), timeout=30)
        elif fault == "kv_pull_stall":  # the source stalls mid-transfer past the pull timeout
            ray.get(entry.actor.inject_fault.remote("kv.serve", "stall",
                                                    self.pull_timeout_s + 1.0), timeout=30)
        elif fault == "step_stall":  # one step hangs past the watchdog's bound
            ray.get(entry.actor.inject_fault.remote("engine.step", "stall",
                                                    self.step_timeout_s + 2.0), timeout=30)
        return Injected(fault, entry.worker_id)


async def send_bad_input(http: httpx.AsyncClient, fault: str, model: str,
                         max_body_bytes: int, retry_s: float = 60.0) -> Injected:
    """Hostile input at the front door: it must be refused with a 4xx carrying an
    OpenAI-shaped error that names what was wrong, and no traceback. While no router answers
    (one was just killed and is coming back) it is sent again, for `retry_s` at most."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_s
    while True:
        try:
            return await _send_bad_input(http, fault, model, max_body_bytes)
        except httpx.TransportError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(1.0)


async def _send_bad_input(http: httpx.AsyncClient, fault: str, model: str,
                          max_body_bytes: int) -> Injected:
    url, headers = "/v1/completions", dict(http.headers)
    good = {"model": model, "prompt": "hello", "max_tokens": 4}
    expect = 400
    if fault == "malformed_json":
        content = b'{"model": "' + model.encode() + b'", "prompt": "hi", '
        r = await http.post(url, content=content, headers={"Content-Type": "application/json"})
    elif fault == "oversized_body":
        expect = 413
        r = await http.post(url, json={**good, "prompt": "x" * (max_body_bytes + 1)})
    elif fault == "bad_seed":
        r = await http.post(url, json={**good, "seed": 2**70})
    elif fault == "unknown_field":
        r = await http.post(url, json={**good, "frobnicate": True})
    elif fault == "lone_surrogate":
        content = ('{"model": "%s", "prompt": "bad \\ud800 text", "max_tokens": 4}' % model)
        r = await http.post(url, content=content.encode(),
                            headers={"Content-Type": "application/json"})
    elif fault == "missing_key":
        expect = 401
        headers.pop("authorization", None)
        async with httpx.AsyncClient(base_url=str(http.base_url), timeout=30) as bare:
            r = await bare.post(url, json=good)
    else:
        raise ValueError(f"unknown input fault {fault!r}")
    shaped = '"error"' in r.text and "Traceback" not in r.text
    ok = r.status_code == expect and shaped
    return Injected(fault, url, ok, f"{r.status_code}: {r.text[:160]}")
