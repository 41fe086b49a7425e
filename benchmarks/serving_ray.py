"""`cleave serve` as a subprocess for the serving benchmarks: the Ray application as a user starts
it (its own local Ray, the router and the worker pools as Serve deployments), and stopped again
with nothing of it left running.

The subprocess gets a Ray temp folder of its own (`RAY_TMPDIR`), so the Ray processes it starts
can be told from any other Ray on this machine (other test sessions included): only those are
ended, by pid, if SIGTERM to `cleave serve` leaves any behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

CLEAVE = str(Path(sys.executable).parent / "cleave")
RAY_PROCESS_NAMES = ("raylet", "gcs_server", "ray::", "default_worker.py", "dashboard/agent.py",
                     "log_monitor.py", "runtime_env/agent", "monitor.py")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ray_processes(marker: str = "") -> set[int]:
    """Pids of Ray's daemons and workers on this machine whose command line holds `marker`,
    and every process under those (Ray's workers rename themselves `ray::...`)."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True,
                         text=True).stdout
    parent, ours = {}, set()
    for line in out.splitlines():
        pid, ppid, args = line.split(None, 2) if len(line.split(None, 2)) == 3 else (
            *line.split(None, 1), "")
        parent[int(pid)] = int(ppid)
        if marker in args and any(name in args for name in RAY_PROCESS_NAMES):
            ours.add(int(pid))
    for pid in parent:  # descendants of the matched daemons
        p, seen = parent.get(pid), set()
        while p and p not in seen and p not in ours:
            seen.add(p)
            p = parent.get(p)
        if p in ours:
            ours.add(pid)
    return ours


class ServerProcess:
    """A `cleave serve` subprocess: its stderr drained on a thread (the last 200 lines kept,
    so a chatty server never blocks on a full pipe), stopped with SIGTERM."""

    command: list[str]
    http_port: int
    _proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def pid(self) -> int:
        assert self._proc is not None, "not started"
        return self._proc.pid

    def _spawn(self, env: dict[str, str] | None = None, stdout: int = subprocess.DEVNULL) -> None:
        self._stderr: list[str] = []
        self._proc = subprocess.Popen(self.command, env=env, stdout=stdout,
                                      stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._drain_stderr, daemon=True).start()

    def _drain_stderr(self) -> None:
        for line in self._proc.stderr:
            self._stderr.append(line)
            del self._stderr[:-200]

    def stderr_tail(self, chars: int = 2000) -> str:
        return "".join(self._stderr)[-chars:]

    def _wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Until `/health` lists a healthy worker. Raises `RuntimeError` (with the server's
        last stderr) when it exits first, `TimeoutError` after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"cleave serve exited: {self.stderr_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).json().get("healthy_workers"):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(poll_s)
        raise TimeoutError(f"cleave serve not ready within {timeout_s:.0f}s")

    def _terminate(self, timeout_s: float) -> int | None:
        """SIGTERM, wait up to `timeout_s`, then kill; the exit code (None: never started)."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
        try:
            return self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return self._proc.wait()


class RayApp(ServerProcess):
    """`cleave serve` with `prefill` prefill and `decode` decode replicas of `model`, on a local
    Ray of `num_cpus` logical CPUs. `start()` returns once it prints its ready message; `stop()`
    sends SIGTERM and waits until its Ray processes are gone (returns any it had to kill)."""

    def __init__(self, model: str, served_model_name: str, *, prefill: int = 1, decode: int = 1,
                 disagg_threshold: int = 64, num_cpus: float = 4, device: str = "cpu",
                 extra_args: tuple[str, ...] = (), config: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        """`config`: a Cleave config file whose pools (and router settings) are used as they
        are; then `prefill`, `decode` and `disagg_threshold` are not passed. `env`: variables
        set for `cleave serve` (and the Ray it starts) beside this process's."""
        self.env = env or {}
        self.http_port, self.grpc_port = free_ports(2)
        self.served_model_name = served_model_name
        # short: Ray puts unix sockets under it (108-byte limit)
        self._tmp = tempfile.mkdtemp(prefix="crb-", dir="/tmp")
        layout = (["--config", config] if config is not None else
                  ["--prefill-workers", str(prefill), "--decode-workers", str(decode),
                   "--disagg-threshold-tokens", str(disagg_threshold)])
        self.command = [CLEAVE, "serve", "--model", model, "--served-model-name",
                        served_model_name, "--port", str(self.http_port), "--grpc-port",
                        str(self.grpc_port), *layout, "--num-cpus", str(num_cpus),
                        "--device", device, *extra_args]

    def start(self, timeout_s: float = 300.0) -> RayApp:
        env = dict(os.environ, RAY_TMPDIR=self._tmp, RAY_AUTH_MODE="disabled",
                   RAY_USAGE_STATS_ENABLED="0", **self.env)
        env.pop("RAY_ADDRESS", None)  # its own local Ray, never a cluster this shell points at
        self._spawn(env, stdout=subprocess.PIPE)
        ready, deadline = "", time.monotonic() + timeout_s
        try:
            while "curl" not in ready:  # the ready message ends with a curl to paste
                line = self._proc.stdout.readline()
                if not line and self._proc.poll() is not None:
                    raise RuntimeError(f"cleave serve exited with {self._proc.returncode}: "
                                       f"{self.stderr_tail()}\nraylet.out: "
                                       f"{self.raylet_log_tail()}")
                ready += line
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cleave serve not ready within {timeout_s:.0f}s: "
                                       f"{self.stderr_tail()}")
        except BaseException:
            self.stop()
            raise
        return self

    def raylet_log_tail(self, chars: int = 1500) -> str:
        """The end of this app's raylet log (why Ray went away, when it did)."""
        logs = sorted(Path(self._tmp).glob("ray/session_*/logs/raylet.out"))
        return logs[-1].read_text(errors="replace")[-chars:] if logs else "(none)"

    def stop(self, timeout_s: float = 120.0) -> dict:
        """SIGTERM, wait, then end (by pid) any Ray process of this app still running after
        30 s. Returns {"exit_code", "killed_ray_pids"}; idempotent."""
        code = self._terminate(timeout_s)
        deadline = time.monotonic() + 30
        while (left := ray_processes(self._tmp)) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self._tmp, ignore_errors=True)
        return {"exit_code": code, "killed_ray_pids": sorted(left)}

    def ray_pids(self) -> list[int]:
        """Pids of every Ray process of this app (its daemons and workers)."""
        return ray_processes(self._tmp)

    def processes(self, name: str) -> list[int]:
        """Pids of this app's Ray worker processes whose title holds `name` (e.g.
        "EngineActor": Ray titles an actor's process `ray::<class>.<method>`)."""
        found = []
        for pid in ray_processes(self._tmp):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if name.encode() in title:
                found.append(pid)
        return sorted(found)
