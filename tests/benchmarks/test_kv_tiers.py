"""benchmarks/kv_tiers.py end to end at a tiny shape: both runs serve every turn, the host tier
finds the conversations' evicted history again, and the last line carries the ratios."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.conftest import import_benchmark


@pytest.fixture(scope="module")
def bench():
    yield from import_benchmark("kv_tiers")


def test_a_tiny_run_serves_later_turns_from_the_host_tier(bench, tmp_path, capsys):
    result = bench.main(["--parts", "tiers", "--model", "tiny", "--conversations", "6",
                         "--turns", "3",
                         "--system-len", "64", "--user-len", "32", "--reply-len", "4",
                         "--concurrency", "1", "--out", str(tmp_path / "out.json")])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads((tmp_path / "out.json").read_text()) == result
    without, with_tier = result["runs"]["without_host_tier"], result["runs"]["with_host_tier"]
    assert without["completed"] == with_tier["completed"] == 18
    # six conversations, a primary pool for a quarter of them (at least one whole one): turns
    # come back after their history was evicted, and only the host tier still has it
    assert with_tier["cached_tokens"] > 2 * without["cached_tokens"]
    assert with_tier["hit_rate"] > 0.45  # of at most 224 / 396: every earlier turn found
    assert {"ttft_p90_ratio", "ttft_p50_later_turns_ratio"} <= set(result)


def test_a_tiny_fetch_run_pulls_what_it_would_recompute(bench, tmp_path, capsys):
    result = bench.main(["--parts", "fetch", "--fetch-lengths", "80,160", "--transports", "tcp",
                         "--repeats", "1", "--out", str(tmp_path / "out.json")])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    rows = result["fetch"]["tcp"]["lengths"]
    for length, row in rows.items():
        # every full block before the last token came from worker A: only the tail (at least
        # one token, whose logits give the first output) was computed on worker B
        assert row["measured"]["fetch_cached_tokens"] == (int(length) - 1) // 16 * 16
        assert row["measured"]["recompute_s"] > 0 and row["measured"]["fetch_s"] > 0
        assert row["predicted"]["fetch_cost"] is not None  # B measured its pulls and prefill
    assert "fetch_tcp_160_speedup_ratio" in result
