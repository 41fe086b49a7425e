"""The Ray job entry point and the pieces of the cluster that need no Ray: the example
configs, the KV-event log every router replica reads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster.config import CleaveConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("cleave-*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_example_configs_load(path):
    config = CleaveConfig.from_yaml(path)
    assert config.pools.decode is not None


def test_the_job_entry_point_rejects_a_bad_config_naming_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools:\n  decode:\n    tp: 0\n")
    out = subprocess.run([sys.executable, "-m", "cluster.launch", "--config", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "pools.decode.tp" in out.stderr and "(got 0)" in out.stderr


def test_a_serve_that_never_answers_bounds_each_status_read(monkeypatch):
    """With Serve's controller or Ray's GCS gone, `serve.status` waits forever: `cleave serve`
    then hung on SIGTERM, and on the second signal too. Each read now gives up, and the
    shutdown's in-flight count reads nothing (0) instead of waiting."""
    import threading
    import time

    from ray import serve

    from cluster import app_state

    never = threading.Event()
    monkeypatch.setattr(serve, "status", lambda: never.wait())
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="within 0.2 s"):
        app_state.app_status(timeout_s=0.2)
    assert app_state.in_flight(timeout_s=0.2) == 0
    assert time.monotonic() - start < 5
    never.set()


def test_a_status_read_raises_what_serve_raised(monkeypatch):
    from ray import serve

    from cluster import app_state

    def broken():
        raise ConnectionError("the controller is gone")

    monkeypatch.setattr(serve, "status", broken)
    with pytest.raises(ConnectionError, match="controller is gone"):
        app_state.app_status(timeout_s=5)


def test_the_serve_replicas_start_without_torch(tiny_model):
    """Only a pool's `EngineActor` runs the engine: a pool replica (its module, the engine
    spec and the model check it builds), a router and the directory import no torch, each ~2 s
    of CPU less to start."""
    code = f"""
import sys
import cluster.app, cluster.autoscaling, cluster.directory, cluster.ingress, cluster.pool
from cluster.config import CleaveConfig
from workers.models.model_config import ModelConfig
from tests.cluster.conftest import app_config
config = CleaveConfig.parse(app_config({tiny_model!r}))
spec = cluster.pool.engine_spec(config, "decode", "decode-0")
config.check_against_model(ModelConfig.from_pretrained(spec.engine.model))
sys.exit(3 if "torch" in sys.modules else 0)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, f"torch was imported (rc {out.returncode}): {out.stderr[-2000:]}"
