"""Where a served token's CPU goes: each process's CPU seconds (user + system, from /proc) over
one load-generator measurement, divided by the output tokens it streamed, grouped by the role
the process plays (router, engines, the load generator itself, the rest of Ray).

On a machine whose cores the server and its client share, the sum over the roles bounds the
throughput: `cores * 1e6 / total_us_per_token` tokens/s. `tokens_vs_cpu_bound_ratio` (measured
over that bound) near 1 says the machine was saturated, so only fewer microseconds per token
anywhere, not less waiting, can raise it; well under 1, something waited (a lock, a step, the
network). Linux only (/proc); elsewhere `CpuBudget` reports nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

Roles = Callable[[], dict[str, list[int]]]  # role -> pids, resolved when a measurement starts
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """A process's user + system CPU seconds so far; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime


def descendants(pid: int) -> list[int]:
    """`pid` and every process under it (an in-process server's worker processes)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, ()))
    return found


def roles_below(markers: dict[str, str]) -> Roles:
    """The processes this one started, and theirs, by role: the first role whose marker their
    command line holds ("" holds for all), else "other"."""

    def resolve() -> dict[str, list[int]]:
        out: dict[str, list[int]] = {role: [] for role in markers} | {"other": []}
        for pid in descendants(os.getpid())[1:]:  # this process is the load generator
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace")
            except OSError:
                continue
            out[next((r for r, m in markers.items() if m in title), "other")].append(pid)
        return out

    return resolve


class CpuBudget:
    """`start()` before a measurement, `stop(output_tokens)` after it: microseconds of CPU per
    output token by role, "loadgen" (this process) among them, their "total", and the bound."""

    def __init__(self, roles: Roles) -> None:
        self.roles = roles
        self._pids: dict[str, list[int]] = {}
        self._before: dict[int, float] = {}
        self._mine = 0.0

    def start(self) -> None:
        self._pids = self.roles()
        self._before = {p: s for pids in self._pids.values() for p in pids
                        if (s := cpu_seconds(p)) is not None}
        self._mine = _own_cpu_s()

    def stop(self, output_tokens: float) -> dict:
        if not output_tokens or not Path("/proc/self/stat").exists():
            return {}
        used = {"loadgen": _own_cpu_s() - self._mine}
        for role, pids in self._pids.items():
            used[role] = sum(after - self._before[p] for p in pids if p in self._before
                             and (after := cpu_seconds(p)) is not None)
        per_token = {role: round(s / output_tokens * 1e6, 1) for role, s in used.items()}
        total = sum(used.values()) / output_tokens * 1e6
        cores = len(os.sched_getaffinity(0))
        return {"cpu_us_per_token": per_token | {"total": round(total, 1)}, "cores": cores,
                "cpu_bound_tokens_per_s": round(cores * 1e6 / total, 1) if total else None}


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system
