"""What a benchmark reads of a running Ray app beside its answers: the spans its processes
export (`Receiver`, an OTLP/HTTP endpoint) and its processes' scheduler accounting (`Probe`:
each engine thread's time on a core and waiting runnable for one, `/proc/<pid>/task/<tid>/
schedstat`; the CPU of the app's other processes by role, `/proc/<pid>/stat`; the cores' busy
time, `/proc/stat`). Linux only."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from serving_ray import RayApp


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP endpoint keeping every span posted: {trace id hex: {name: (start ns, end
    ns, attributes)}}."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb

        self.traces: dict[str, dict[str, tuple]] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                got = pb.ExportTraceServiceRequest()
                got.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
                for res in got.resource_spans:
                    for scope in res.scope_spans:
                        for s in scope.spans:
                            attrs = {a.key: a.value.string_value or a.value.int_value
                                     for a in s.attributes}
                            receiver.traces.setdefault(s.trace_id.hex(), {})[s.name] = (
                                s.start_time_unix_nano, s.end_time_unix_nano, attrs)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(pb.ExportTraceServiceResponse().SerializeToString())

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def schedstat(pid: int) -> dict[int, tuple[int, int]]:
    """{thread id: (ns on a CPU, ns runnable waiting for one)} of `pid`'s threads."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            run, wait, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
        except (OSError, ValueError):
            continue
        out[int(tid)] = (int(run), int(wait))
    return out


@dataclass(frozen=True)
class Probe:
    """What the client reads of the app: its engine processes (`pids`), each one's step loop
    thread (`steppers`: (pid, tid)), its other processes by role (`groups`)."""

    pids: list[int]
    steppers: list[tuple[int, int]] = field(default_factory=list)
    groups: dict[str, list[int]] = field(default_factory=dict)

    def snapshot(self) -> dict:
        """Every engine thread's schedstat, each group's CPU ticks, the cores' busy time."""
        return {"engines": {p: schedstat(p) for p in self.pids}, "busy_s": busy_s(),
                "groups": {g: sum(map(cpu_ticks, ps)) for g, ps in self.groups.items()}}

    def token(self) -> tuple:
        return (time.time_ns(), *(thread_stat(*s) for s in self.steppers))


def cpu_ticks(pid: int) -> int:
    """`pid`'s user and system CPU so far, in clock ticks (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


ROLES = (("controller", "ServeController"),)  # (group, a mark in its processes' titles)


def app_groups(app: RayApp, engines: list[int]) -> dict[str, list[int]]:
    """The app's processes other than its engines, by role: Serve's controller, the rest of
    Ray and `cleave serve` (Serve's proxy, the router, Ray's daemons), and this process (the
    client)."""
    groups: dict[str, list[int]] = {"client": [os.getpid()]}
    for pid in {app.pid, *app.ray_pids()} - set(engines):
        title = process_title(pid)
        role = next((r for r, mark in ROLES if mark in title), "ray_and_cli")
        groups.setdefault(role, []).append(pid)
    return groups


def process_title(pid: int) -> str:
    """`pid`'s command line as `ps` shows it (Ray's workers retitle themselves), cut short."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:60]
    except OSError:
        return ""


def thread_stat(pid: int, tid: int) -> tuple[int, int]:
    run, wait, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
    return int(run), int(wait)


def busy_s() -> float:
    """CPU seconds the machine's cores were busy since boot (`/proc/stat`)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait
    return (sum(ticks[:3]) + sum(ticks[5:8])) / os.sysconf("SC_CLK_TCK")
