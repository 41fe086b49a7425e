"""benchmarks/drain.py end to end at a tiny shape: both modes drain every stream, live migration
recomputes nothing where replay recomputes every context, and the texts agree."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.conftest import import_benchmark


@pytest.fixture(scope="module")
def bench():
    yield from import_benchmark("drain")


def test_a_tiny_drain_moves_every_stream_live_and_by_replay(bench, tmp_path, capsys):
    result = bench.main(["--streams", "3", "--min-context", "60", "--max-context", "120",
                         "--output-len", "30", "--warm-tokens", "4", "--steady-s", "0.2",
                         "--out", str(tmp_path / "out.json")])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    live, replay = result["live"], result["replay"]
    assert live["moved"] == replay["moved"] == 3 and not live["errors"] + replay["errors"]
    assert live["recomputed_tokens"] == 0
    assert replay["recomputed_tokens"] >= result["setup"]["sum_of_contexts"]
    assert result["identical_texts"] == "3/3"
    assert live["drain_s"] > 0 and replay["drain_s"] > 0
