"""benchmarks/routing_engines.py's core on four real tiny engines: a few multi-turn
conversations of two tenants, every policy plus the oracle, and the report a user reads."""

from __future__ import annotations

import asyncio

import pytest

from tests.benchmarks.conftest import import_benchmark


@pytest.fixture(scope="module")
def routing_engines():
    yield from import_benchmark("routing_engines")


def tiny_workload(bench, conv_per_s: float = 4.0):
    return bench.make_workload(seed=0, num_conversations=6, conv_per_s=conv_per_s,
                               num_tenants=2, vocab_size=512, system_tokens=(96, 160),
                               user_tokens=(8, 24), reply_tokens=(3, 6), turns=(2, 3),
                               think_s=0.1)


def test_workload_is_the_same_at_every_rate_but_for_arrival_times(routing_engines):
    slow, fast = tiny_workload(routing_engines, 1.0), tiny_workload(routing_engines, 4.0)
    assert slow.systems == fast.systems
    assert [c.turns for c in slow.conversations] == [c.turns for c in fast.conversations]
    assert [c.arrival_s for c in slow.conversations] == pytest.approx(
        [4 * c.arrival_s for c in fast.conversations])
    assert all(96 <= len(s) <= 160 for s in slow.systems)
    assert all(c.turns[0].think_s == 0 and len(c.turns) in (2, 3) for c in slow.conversations)


def test_report_of_a_tiny_run(routing_engines, tiny_model):
    workload = tiny_workload(routing_engines)
    level = asyncio.run(routing_engines.run_level(workload, tiny_model, {"num_blocks": 64},
                                                  warmup_conversations=1))
    results = level["policies"]
    assert list(results) == ["prefix_aware", "least_loaded", "round_robin", "oracle"]
    num_turns = sum(len(c.turns) for c in workload.conversations)
    warmup_turns = len(workload.conversations[0].turns)
    for report in results.values():
        assert report["requests"] == num_turns - warmup_turns  # the warm-up is not measured
        assert report["all_turns"]["requests"] == num_turns
        assert sum(report["requests_by_worker"].values()) == num_turns
        assert 0 < report["ttft_p50_s"] <= report["ttft_p90_s"] <= report["ttft_p99_s"]
        assert 0 <= report["hit_rate"] < 1
        assert report["throughput_output_tok_per_s"] > 0
        for key in ("hit_rate_vs_oracle_ratio", "ttft_p90_vs_round_robin_ratio",
                    "throughput_vs_round_robin_ratio", "chosen_vs_best_available_ratio"):
            assert report[key] >= 0, key
    # the same prompts reached every policy (replies have fixed lengths)
    assert len({r["prompt_tokens"] for r in results.values()}) == 1
    assert results["oracle"]["chosen_vs_best_available_ratio"] == 1.0
    assert results["round_robin"]["ttft_p90_vs_round_robin_ratio"] == 1.0
    # follow-up turns find their conversation's KV where prefix-aware routing sent them
    assert results["prefix_aware"]["hit_rate"] >= results["round_robin"]["hit_rate"]
    assert results["prefix_aware"]["hit_rate"] > 0.3
    assert level["prefix_aware_hit_rate_vs_oracle_ratio"] == (
        results["prefix_aware"]["hit_rate_vs_oracle_ratio"])
