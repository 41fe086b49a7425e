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
