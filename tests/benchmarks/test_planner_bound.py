"""The planner bound's (`benchmarks/planner_bound.py`) steady phases and its scoring of the
trace from them, without Ray: synthetic curves where each class has its own best layout."""

from __future__ import annotations

import argparse

import pytest

from tests.benchmarks.conftest import import_benchmark


@pytest.fixture(scope="module")
def bound():
    yield from import_benchmark("planner_bound")


def test_each_steady_phase_is_seeded_and_carries_its_class_and_rate(bound):
    args = argparse.Namespace(chat_rates=[4.0, 8.0], summary_rates=[1.0], phase_s=20.0,
                              short_input=8, short_output=4, long_input=32, long_output=2,
                              seed=0)
    steady = bound.phases(args, vocab=100)
    assert steady == bound.phases(args, vocab=100)
    assert list(steady) == ["short@4", "short@8", "long@1"]
    for key, arrivals in steady.items():
        assert all(0 <= a.at_s < 20.0 for a in arrivals)
        assert {(len(a.spec.prompt), a.spec.kind) for a in arrivals} == (
            {(32, "long")} if key == "long@1" else {(8, "short")})
    assert len(steady["short@8"]) > len(steady["short@4"]) > len(steady["long@1"]) > 0


def phase(goodput: float, offered: float) -> dict:
    return {"goodput": goodput, "offered": offered, "slo_met_fraction": goodput / offered}


# aggregated keeps chat within the SLO at both rates and loses summaries; 1P+1D the reverse;
# conditional serves chat on one worker (all of it at 1/s, half at 3/s) and summaries whole
CURVES = {
    "aggregated": {"short@1": phase(1.0, 1.0), "short@3": phase(2.9, 3.0),
                   "long@0.5": phase(0.1, 0.5), "long@2": phase(0.0, 2.0)},
    "disaggregated": {"short@1": phase(0.5, 1.0), "short@3": phase(0.6, 3.0),
                      "long@0.5": phase(0.5, 0.5), "long@2": phase(1.0, 2.0)},
    "conditional": {"short@1": phase(1.0, 1.0), "short@3": phase(1.5, 3.0),
                    "long@0.5": phase(0.5, 0.5), "long@2": phase(1.0, 2.0)},
}


def test_the_trace_is_scored_by_its_best_fixed_layout_and_the_layouts_stitched_per_phase(bound):
    out = bound.score(CURVES, [1.0, 3.0], [0.5, 2.0])
    rows = {(r["chat_rate"], r["summary_rate"]): r for r in out["grid"]}
    # chat 1/s, summaries 0.5/s: conditional meets every phase, nothing to gain
    assert rows[1.0, 0.5]["best_fixed"] == "conditional"
    assert rows[1.0, 0.5]["stitched_vs_best_fixed_goodput_ratio"] == 1.0
    # chat 3/s: aggregated in chat, 1P+1D or conditional in summaries
    low = rows[3.0, 0.5]
    assert low["best_fixed"] == "aggregated"
    assert low["best_fixed_goodput"] == pytest.approx((2 * 2.9 + 0.1) / 3, abs=1e-3)
    assert low["stitched_goodput"] == pytest.approx((2 * 2.9 + 0.5) / 3, abs=1e-3)
    # summaries 2/s: no layout meets 90% of them, so no planner meets the target there
    assert rows[3.0, 2.0]["stitched_goodput"] is None
    assert rows[3.0, 2.0]["stitched_vs_best_fixed_goodput_ratio"] is None
    assert rows[3.0, 2.0]["offered_vs_best_fixed_goodput_ratio"] == pytest.approx(
        (2 * 3.0 + 2.0) / (2 * 2.9 + 0.0), abs=1e-3)
    assert out["max_at_rates"] == (3.0, 0.5)
    assert out["max_stitched_vs_best_fixed_goodput_ratio"] == pytest.approx(
        (2 * 2.9 + 0.5) / (2 * 2.9 + 0.1), abs=1e-3)


def test_each_layout_meets_90_percent_up_to_its_highest_rate_that_did(bound):
    assert bound.meets_up_to(CURVES, "short", [1.0, 3.0]) == {
        "aggregated": 3.0, "disaggregated": None, "conditional": 1.0}
    assert bound.meets_up_to(CURVES, "long", [0.5, 2.0]) == {
        "aggregated": None, "disaggregated": 0.5, "conditional": 0.5}
