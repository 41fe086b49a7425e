"""`cleave serve` as a user runs it: a real subprocess starting its own Ray, answering the
OpenAI client, and leaving nothing behind after SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.cluster.conftest import free_ports

pytestmark = pytest.mark.timeout(300)

CLEAVE = str(Path(sys.executable).parent / "cleave")


def ray_processes() -> set[int]:
    """Pids of Ray's daemons and workers on this machine."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    pids = set()
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if any(name in args for name in ("raylet", "gcs_server", "ray::", "default_worker.py",
                                         "dashboard/agent.py", "log_monitor.py")):
            pids.add(int(pid))
    return pids


def test_cleave_serve_starts_answers_and_stops_on_sigterm(tmp_path, tiny_model):
    http, grpc_port = free_ports(2)
    before = ray_processes()
    env = dict(os.environ, CLEAVE_CACHE_DIR=str(tmp_path), RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.Popen([CLEAVE, "serve", "--model", tiny_model, "--served-model-name",
                             "tiny", "--port", str(http), "--grpc-port", str(grpc_port),
                             "--num-cpus", "4", "--device", "cpu"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = ""
        deadline = time.monotonic() + 180
        while "curl" not in ready:  # the ready message ends with a curl to paste
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"cleave serve exited: {proc.stderr.read()}"
            ready += line
            assert time.monotonic() < deadline, "cleave serve did not get ready"
        assert f"http://127.0.0.1:{http}/v1" in ready and f"127.0.0.1:{grpc_port}" in ready
        assert httpx.get(f"http://127.0.0.1:{http}/health", timeout=30).status_code == 200
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="x",
                               max_retries=0, timeout=60)
        chat = client.chat.completions.create(model="tiny", max_tokens=4,
                                              messages=[{"role": "user", "content": "Hello!"}])
        assert chat.usage.completion_tokens == 4
    finally:
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    took = time.monotonic() - signalled
    err = proc.stderr.read()
    assert code == 0, err[-2000:]
    # idle, it must be gone well within Kubernetes' default 30 s grace period (issue 18: 10 s)
    assert took < 10.0, f"cleave serve took {took:.1f} s to exit after SIGTERM"
    assert "shutting down" in err
    deadline = time.monotonic() + 30
    while (left := ray_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"Ray processes left behind: {sorted(left)}"
