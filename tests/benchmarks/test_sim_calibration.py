"""The simulator as `benchmarks/planner_calibrate.py` runs it against the Ray app: a given trace
replayed at its own times, every gap between tokens kept, two workers on one machine whose
steps slow each other by the co-run factor while both run (and only then), and steps drawn
from a measured spread. No timing."""

from __future__ import annotations

import dataclasses
import math

import pytest

import benchmarks.simulate as simulate
from benchmarks.sim_cluster import Req, Stretch
from router.profiles import StepProfile

# a 100-token prompt: 0.1 s alone; a decode step 10 ms
PROFILE = StepProfile(0.0, 1e-3, 0.01, 0.0, chunk_tokens=2048)


def replay(trace: list[Req], corun: float, spread: Stretch | None = None,
           layout: str = "aggregated", profile: StepProfile = PROFILE) -> list[Req]:
    simulate.PROFILE = profile
    run = simulate.Run(layout, 2, 10.0, 0, trace=trace)
    run.c.keep_gaps, run.c.corun = True, corun
    run.c.spreads = ((0.0, spread),) if spread else ()
    run.run(1.0)
    return run.requests


@pytest.fixture(autouse=True)
def _profile_back():
    before = simulate.PROFILE
    yield
    simulate.PROFILE = before


def test_a_trace_is_replayed_at_its_times_with_every_gap_kept() -> None:
    (r,) = replay([Req(2.5, 100, 4, 0)], corun=1.0)
    assert r.first == pytest.approx(2.6)  # its arrival plus its prefill, nothing drawn
    assert r.gaps == pytest.approx([0.01, 0.01, 0.01])  # each token after the first
    assert r.done == pytest.approx(2.63)


def test_two_workers_slow_each_other_only_while_both_step() -> None:
    alone = replay([Req(0.0, 100, 1, 0)], corun=2.0)
    assert alone[0].first == pytest.approx(0.1)  # the other worker idle: no slowdown
    both = replay([Req(0.0, 100, 1, 0), Req(0.0, 100, 1, 0)], corun=2.0)
    assert [r.first for r in both] == pytest.approx([0.2, 0.2])  # one on each, all along
    # the second arrives when the first is half done: 0.05 s alone, then both at half speed
    # until the first ends (0.05 s of work: 0.1 s), then the second alone for its rest
    staggered = replay([Req(0.0, 100, 1, 0), Req(0.05, 100, 1, 0)], corun=2.0)
    assert staggered[0].first == pytest.approx(0.15)
    assert staggered[1].first == pytest.approx(0.2)  # 0.05 s done at half speed, 0.05 alone
    apart = replay([Req(0.0, 100, 1, 0), Req(0.05, 100, 1, 0)], corun=1.0)
    assert [r.first for r in apart] == pytest.approx([0.1, 0.15])


def test_a_measured_spread_stretches_every_step_by_its_draw() -> None:
    flat = Stretch(((math.inf, ((0.0, 1.5), (1.0, 1.5))),))
    (r,) = replay([Req(0.0, 100, 3, 0)], corun=1.0, spread=flat)
    assert r.first == pytest.approx(0.15) and r.gaps == pytest.approx([0.015, 0.015])
    wide = Stretch(((math.inf, ((0.0, 1.0), (1.0, 3.0))),))
    (r,) = replay([Req(0.0, 100, 200, 0)], corun=1.0, spread=wide)
    assert min(r.gaps) >= 0.01 and max(r.gaps) <= 0.03
    assert max(r.gaps) > 0.025 and min(r.gaps) < 0.015  # drawn across the whole range


def test_a_step_draws_from_the_spread_measured_for_steps_of_its_length() -> None:
    """`planner_ttft_tail.py` measures the stretch by a window's length: a short decode step
    and a long prefill step each draw from their own bin."""
    by_length = Stretch(((0.05, ((0.0, 2.0), (1.0, 2.0))), (math.inf, ((0.0, 1.2), (1.0, 1.2)))))
    (r,) = replay([Req(0.0, 100, 3, 0)], corun=1.0, spread=by_length)
    assert r.first == pytest.approx(0.12)  # the 0.1 s prefill: the long bin's 1.2
    assert r.gaps == pytest.approx([0.02, 0.02])  # each 10 ms decode step: the short bin's 2


def test_each_phase_draws_from_the_spread_measured_under_its_load() -> None:
    """A spread measured per phase of the trace applies from that phase's start on."""
    simulate.PROFILE = PROFILE
    run = simulate.Run("aggregated", 2, 10.0, 0, trace=[Req(1.0, 100, 2, 0), Req(6.0, 100, 2, 1)])
    run.c.keep_gaps = True
    run.c.spreads = ((0.0, Stretch(((math.inf, ((0.0, 1.0), (1.0, 1.0))),))),
                     (5.0, Stretch(((math.inf, ((0.0, 2.0), (1.0, 2.0))),))))
    run.run(1.0)
    first, second = run.requests
    assert first.first - first.arrival == pytest.approx(0.1)  # before 5 s: exact
    assert second.first - second.arrival == pytest.approx(0.2)  # from 5 s on: twice as long


def test_a_handed_off_first_token_waits_for_the_handoffs_path_and_its_pull() -> None:
    """1P+1D: the first token reaches the client `handoff_s` after the prefill (the prefill
    call returns it with the KV offer); decoding starts once the KV is pulled."""
    profile = dataclasses.replace(PROFILE, handoff_fixed_s=0.04, handoff_s_per_token=1e-4,
                                  transfer_s_per_token=2e-4)
    (r,) = replay([Req(1.0, 100, 3, 0)], 1.0, layout="disagg_1to1", profile=profile)
    assert r.first == pytest.approx(1.0 + 0.1 + 0.04 + 100 * 1e-4)  # prefill, handoff_s
    assert r.gaps == pytest.approx([100 * 2e-4 + 0.01, 0.01])  # the pull, then a step each
    (one,) = replay([Req(1.0, 100, 1, 0)], 1.0, layout="disagg_1to1", profile=profile)
    assert one.first == pytest.approx(1.1)  # done at its prefill: nothing handed off
    (agg,) = replay([Req(1.0, 100, 3, 0)], 1.0, profile=profile)
    assert agg.first == pytest.approx(1.1)  # aggregated: no handoff
