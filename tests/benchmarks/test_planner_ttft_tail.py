"""`benchmarks/planner_ttft_tail.py`'s summaries of the Ray app's step loop (no app started):
how a window's CPU time stretched, by the window's length, and that as the simulator's
`Stretch`."""

from __future__ import annotations

import math

import pytest

from tests.benchmarks.conftest import import_benchmark


@pytest.fixture(scope="module")
def tail():
    yield from import_benchmark("planner_ttft_tail")


def test_windows_are_binned_by_their_cpu_time_and_stretched_by_their_wait(tail) -> None:
    # twenty 15 ms decode windows waiting 0-19 ms; one 100 ms prefill window waiting 50 ms
    windows = [(15.0, float(w)) for w in range(20)] + [(100.0, 50.0)]
    got = tail.spread(windows)
    assert got["windows"] == [0, 0, 20, 0, 0, 1, 0, 0]  # bins by CPU time: <20 ms, <160 ms
    short = dict(zip(got["quantiles"], got["ratios"][2]))
    assert short[0.5] == pytest.approx((15 + 10) / 15, abs=1e-3)  # the median's wait: 10 ms
    assert short[0.01] == 1.0 and short[0.99] == pytest.approx(34 / 15, abs=1e-3)
    assert got["ratios"][5] == [1.5] * len(got["quantiles"])
    assert got["ratios"][0] is None


def test_the_simulators_stretch_draws_a_step_from_its_lengths_bin(tail) -> None:
    windows = [(15.0, 15.0)] * 20 + [(100.0, 20.0)] * 20 + [(400.0, 0.0)] * 3
    stretch = tail.stretch_of(tail.spread(windows))
    assert stretch.draw(0.015, 0.5) == pytest.approx(2.0)  # a decode step: its own bin
    assert stretch.draw(0.1, 0.5) == pytest.approx(1.2)  # a prefill step
    assert stretch.draw(0.002, 0.9) == pytest.approx(2.0)  # no windows: the nearest bin's
    # three windows are too few: a 2,048-token prefill draws from the nearest full bin
    assert stretch.draw(1.5, 0.5) == pytest.approx(1.2)
    assert stretch.bins[-1][0] == math.inf


def test_a_spread_with_no_full_bin_is_refused(tail) -> None:
    with pytest.raises(ValueError, match="no bin has 20 windows"):
        tail.stretch_of(tail.spread([(15.0, 1.0)] * 5))
