"""The Ray job entry point and the pieces of the cluster that need no Ray: the example
configs, the KV-event log every router replica reads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster.config import CleaveConfig
from cluster.engine_actor import _EventLog
from workers.protocol import BlockRemoved, BlockStored

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


def _stored(seq: int) -> BlockStored:
    return BlockStored(epoch="e1", seq=seq, block_hashes=(seq,), parent_hash=None,
                       token_ids=(seq,), block_size=1)


def test_every_router_replica_reads_every_kv_event_once():
    log = _EventLog(size=4)
    log.extend([_stored(0), _stored(1)])
    assert [e.seq for e in log.read("router-a")] == [0, 1]
    log.extend([_stored(2)])
    assert [e.seq for e in log.read("router-a")] == [2]
    assert [e.seq for e in log.read("router-b")] == [0, 1, 2]  # a new reader starts at the oldest
    log.extend([_stored(3), BlockRemoved(epoch="e1", seq=4, block_hashes=(0,))])
    assert [e.seq for e in log.read("router-a")] == [3, 4]
    assert [e.seq for e in log.read("router-b")] == [3, 4]
    assert log.read("router-a") == []


def test_a_router_that_falls_behind_the_log_sees_a_sequence_gap():
    """The gap makes its prefix index resync from the worker's snapshot."""
    log = _EventLog(size=4)
    log.extend([_stored(0)])
    assert [e.seq for e in log.read("slow")] == [0]
    log.extend([_stored(seq) for seq in range(1, 8)])  # 7 more: only 4..7 are kept
    assert [e.seq for e in log.read("slow")] == [4, 5, 6, 7]
