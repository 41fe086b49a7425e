"""`cleave serve --in-process --process-per-worker` as a subprocess for the serving benchmarks:
the router in one process, each worker in a process of its own (pinned by its pool's
`cpu_affinity`), no Ray. The same interface as `serving_ray.RayApp`."""

from __future__ import annotations

import subprocess
import time

import httpx
from serving_ray import CLEAVE, ServerProcess, free_ports


class LocalApp(ServerProcess):
    """`start()` returns once `/health` reports every worker; `stop()` sends SIGTERM and
    waits (then kills)."""

    def __init__(self, model: str, served_model_name: str, *, config: str,
                 num_workers: int) -> None:
        self.http_port, self.grpc_port = free_ports(2)
        self.num_workers = num_workers
        self.command = [CLEAVE, "serve", "--in-process", "--process-per-worker", "--config",
                        config, "--model", model, "--served-model-name", served_model_name,
                        "--port", str(self.http_port), "--grpc-port", str(self.grpc_port),
                        "--device", "cpu"]

    def start(self, timeout_s: float = 300.0) -> LocalApp:
        self._spawn()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"cleave serve exited with {self._proc.returncode}: "
                                   f"{self.stderr_tail()}")
            try:
                health = httpx.get(f"{self.base_url}/health", timeout=2).json()
                if len(health.get("healthy_workers", ())) == self.num_workers:
                    return self
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"cleave serve not ready within {timeout_s:.0f}s")

    @property
    def pid(self) -> int:
        return self._proc.pid

    def processes(self, name: str = "spawn_main") -> list[int]:
        """Pids of the server's children whose command line holds `name` (default: the
        worker processes multiprocessing spawned, not its resource tracker)."""
        out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(self._proc.pid)],
                             capture_output=True, text=True).stdout
        return sorted(int(line.split(None, 1)[0]) for line in out.splitlines()
                      if name in line)

    def stop(self, timeout_s: float = 60.0) -> dict:
        return {"exit_code": self._terminate(timeout_s)}
