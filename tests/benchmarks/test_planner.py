"""The planner benchmark's (`benchmarks/planner.py`) trace, SLO scoring and comparison, without
Ray: the seeded three-phase trace, each layout's per-phase attainment and whole-trace goodput
from synthetic results, the best fixed layout in hindsight and the per-phase bound, and the
planner's router settings derived from the SLO. No timing threshold."""

from __future__ import annotations

import argparse

import pytest

from tests.benchmarks.conftest import import_benchmark


@pytest.fixture(scope="module")
def planner():
    yield from import_benchmark("planner")


@pytest.fixture(scope="module")
def loadgen():
    yield from import_benchmark("loadgen")


def args(**over) -> argparse.Namespace:
    base = dict(phase_s=10.0, rates=[4.0, 0.5, 4.0], short_input=8, short_output=4,
                long_input=32, long_output=2, seed=0, cores=[0, 1], threshold=512)
    return argparse.Namespace(**(base | over))


def test_the_trace_is_seeded_and_its_phases_carry_their_class_within_their_window(planner):
    a = planner.trace(args(), vocab=100)
    assert a == planner.trace(args(), vocab=100)
    assert a != planner.trace(args(seed=1), vocab=100)
    for x in a:
        assert x.phase * 10.0 <= x.at_s < (x.phase + 1) * 10.0
        want = (8, 4, "short") if x.phase != 1 else (32, 2, "long")
        assert (len(x.spec.prompt), x.spec.max_tokens, x.spec.kind) == want
    counts = [sum(x.phase == k for x in a) for k in range(3)]
    assert counts[0] > 4 * counts[1] and counts[2] > 4 * counts[1] > 0


SLO = {"ttft_ms": {"short": 100.0, "long": 1000.0}, "itl_ms": 50.0, "itl_sweep_ms": [50.0]}


def result(loadgen, kind: str, good: bool):
    return loadgen.RequestResult(kind, ok=True, ttft_s=0.05 if good else 5.0,
                                 itl_s=[0.01, 0.01], output_tokens=3)


def test_each_layout_is_scored_per_phase_and_the_planner_against_the_best_fixed(planner,
                                                                                 loadgen):
    arrivals = planner.trace(args(), vocab=100)
    # which phases each layout serves within the SLO
    serves = {"aggregated": {0, 2}, "disaggregated": set(), "conditional": {1},
              "planner": {0, 1, 2}}
    layouts = {}
    for name, phases in serves.items():
        results = [result(loadgen, a.spec.kind, a.phase in phases) for a in arrivals]
        layouts[name] = planner.layout_report(results, arrivals, SLO, 10.0, 3)
    n = [sum(a.phase == k for a in arrivals) for k in range(3)]
    agg = layouts["aggregated"]
    assert agg["phases"]["1"]["slo_met_fraction"] == 0 and agg["min_phase_attainment"] == 0
    assert agg["goodput"] == round((n[0] + n[2]) / 30.0, 3)
    out = planner.compare(layouts, 3, sum(n) / 30.0)
    assert out["best_fixed"] == "aggregated"
    assert out["best_per_phase"] == {"0": "aggregated", "1": "conditional", "2": "aggregated"}
    assert out["planner_vs_best_fixed_goodput_ratio"] == pytest.approx(
        sum(n) / (n[0] + n[2]), abs=2e-3)
    assert out["best_per_phase_vs_best_fixed_goodput_ratio"] == pytest.approx(
        out["planner_vs_best_fixed_goodput_ratio"], abs=2e-3)
    assert out["min_phase_attainment_planner"] == 1.0
    # every request met: the planner is at the bound any layout has
    assert out["offered_vs_best_fixed_goodput_ratio"] == pytest.approx(
        out["planner_vs_best_fixed_goodput_ratio"], abs=2e-3)


def test_the_planner_layout_is_one_aggregated_pool_with_targets_from_the_slo(planner):
    config = planner.config_for("planner", args(), SLO)
    assert config["pools"]["aggregated"]["replicas"]["max"] == 2
    # TTFT: the worst class's bound; ITL: the gap bound over the planner's max_gap_itl
    assert config["router"]["slo_ttft_ms"] == 1000.0
    assert config["router"]["slo_itl_ms"] == 50.0 / planner.MAX_GAP_ITL
    with pytest.raises(ValueError, match="aggregated layout first"):
        planner.config_for("planner", args(), None)
    assert "prefill" in planner.config_for("conditional", args(), None)["pools"]
