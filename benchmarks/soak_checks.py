"""What the soak checks after its run: every worker idle with all its KV blocks free again and
no lease outstanding, no engine actor beyond the pools' replicas, no shared-memory file left
behind, and the router's memory close to its post-warm-up level."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import time
from pathlib import Path

from soak_faults import APP, Cluster


def settle(cluster: Cluster, expected_workers: int, timeout_s: float) -> dict:
    """Wait until every pool is back to its replicas and each worker is idle with all blocks
    free; returns {worker_id: stats dict} as last seen (whether or not it settled)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = cluster.stats()
        idle = len(stats) >= expected_workers and all(
            s.num_running == 0 and s.num_waiting == 0 and s.num_waiting_for_kv == 0
            and s.num_free_blocks == s.num_blocks for s in stats.values())
        if idle or time.monotonic() > deadline:
            return {wid: dataclasses.asdict(s) for wid, s in stats.items()}
        time.sleep(1.0)


def leases_outstanding(cluster: Cluster) -> dict[str, int]:
    """Each worker's leases, held handoffs, pulls and prefill calls still open
    (`EngineActor.resources`, summed)."""
    import ray

    out = {}
    for entry in cluster.entries():
        try:
            held = ray.get(entry.actor.resources.remote(), timeout=30)
            out[entry.worker_id] = sum(held.values())
            if out[entry.worker_id]:
                print(f"soak: {entry.worker_id} still holds {held}")
        except Exception as exc:  # noqa: BLE001 -- reported as unknown
            out[entry.worker_id] = -1
            print(f"soak: leases of {entry.worker_id} unknown: {exc!r}")
    return out


def alive_actors(class_name: str) -> int:
    from ray.util.state import list_actors

    return sum(1 for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000)
               if a.class_name == class_name)


def shm_files() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir()} if shm.is_dir() else set()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def router_memory() -> dict[str, int]:
    """RSS of each live router replica's process, by actor name."""
    from ray.util.state import list_actors

    out = {}
    for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10_000):
        if a.class_name == f"ServeReplica:{APP}:router" and a.pid:
            try:
                out[a.name] = rss_bytes(a.pid)
            except OSError:
                pass
    return out


def own_pid_children() -> int:
    """Processes under this driver (Ray's, once Ray is shut down, should be none)."""
    me, count = os.getpid(), 0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me:
                count += 1
    return count


class MemoryWatch:
    """Each router replica's RSS, sampled through the run. A replica's post-warm-up level is
    its first sample `WARMUP_S` after it appeared (a killed router's replacement warms up
    anew); the ratio is the largest of end / post-warm-up over the replicas that have both."""

    WARMUP_S = 45.0
    EVERY_S = 10.0

    def __init__(self) -> None:
        self.first_seen: dict[str, float] = {}
        self.after_warmup: dict[str, int] = {}
        self.last: dict[str, int] = {}

    def sample(self) -> None:
        now = time.monotonic()
        for name, rss in router_memory().items():
            seen = self.first_seen.setdefault(name, now)
            if name not in self.after_warmup and now - seen >= self.WARMUP_S:
                self.after_warmup[name] = rss
            self.last[name] = rss

    async def watch(self) -> None:
        while True:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(self.EVERY_S)

    def report(self) -> dict:
        both = [n for n in self.after_warmup if n in self.last]
        return {"router_memory_mib": {n: {"after_warmup": self.after_warmup[n] >> 20,
                                          "end": self.last[n] >> 20} for n in both},
                "router_memory_ratio": (round(max(self.last[n] / self.after_warmup[n]
                                                  for n in both), 3) if both else None)}


async def router_in_flight(base: str, api_key: str) -> int | None:
    """The router's admitted-and-unfinished requests after the run (`cleave_router_in_flight`;
    0 unless a slot leaked), as its /metrics says."""
    import httpx

    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {api_key}"}) as http:
        for _ in range(30):  # a router replica may just be coming back
            try:
                text = (await http.get(f"{base}/metrics", timeout=10)).text
            except httpx.TransportError:
                await asyncio.sleep(2.0)
                continue
            for line in text.splitlines():
                if line.startswith("cleave_router_in_flight "):
                    return int(float(line.split()[1]))
            return None
    return None


def refusal_reason(detail: str) -> str:
    """A refusal's kind: HTTP status and OpenAI error code, gRPC status, or the client's
    connection error (a router replica restarting)."""
    code = re.search(r'"code":\s*"([a-z_]+)"', detail)
    if code:
        return f"{detail.split(':', 1)[0]} {code.group(1)}"
    head = re.match(r"[A-Za-z_0-9]+", detail)
    return head.group(0) if head else detail[:40]
