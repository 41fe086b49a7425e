"""benchmarks/scale_down.py end to end at a tiny shape: every policy removes the worker it names
under load without a failed request; the hand-off moves the hottest cache's prefixes."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.conftest import import_benchmark


@pytest.fixture(scope="module")
def bench():
    yield from import_benchmark("scale_down")


def test_a_tiny_scale_down_under_each_policy(bench, tmp_path, capsys):
    result = bench.main(["--groups", "6", "--prefix-len", "64", "--num-blocks", "64",
                         "--rate", "20", "--warm-s", "1.5", "--window-s", "2",
                         "--out", str(tmp_path / "out.json")])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    for policy in bench.POLICIES:
        run = result[policy]
        assert not run["errors"] and run["before"]["requests"] and run["after"]["requests"]
        assert 0.0 < run["before"]["hit_rate"] <= 1.0
        assert result[f"{policy}_hit_rate_ratio"] is not None
    default, hottest = result["serve_default"], result["hottest"]
    assert default["victim"] == default["newest"] and default["handed_off_prefixes"] == 0
    assert hottest["handed_off_prefixes"] == 0
    for policy in ("hottest", "hottest_hand_off"):
        worth = result[policy]["recent_hit_blocks"]
        assert result[policy]["victim"] == max(worth, key=worth.get)
    cold = result["cold_first_hand_off"]
    # the victim's cache is worth least (workers tied there: `coldest` takes the last added)
    worth = cold["recent_hit_blocks"]
    assert worth[cold["victim"]] == min(worth.values())
    # the hottest cache has prefixes to hand off, and they land
    assert result["hottest_hand_off"]["handed_off_prefixes"] >= 1
    assert result["hottest_hand_off"]["handed_off_blocks"] >= 4
