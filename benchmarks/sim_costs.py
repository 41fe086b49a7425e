"""The control plane's own costs at a number of workers, measured apart from a simulation (on a
shared machine a long simulation's wall times are noisy; these are medians of short repeats,
in this process's CPU time):
one load report into the router's table, one routing decision (queue admission and the
routing policy over a pool), one decode pick, and one planner tick (the traffic window's
classes, the fitted profile, the plan, the role actuator over every worker)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

from router.decode_policy import get_decode_policy
from router.loads import LoadTable
from router.planner import PlanInput, PoolBounds, SloPlanner, SloTargets
from router.policy import get_policy
from router.prefix_index import PrefixIndex
from router.profiles import ProfileFitter, StepProfile
from router.role_plan import WorkerState, role_changes
from router.traffic import TrafficWindow
from workers.contract.protocol import WorkerRole


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()  # this process's CPU: the machine is shared
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def control_plane_costs(workers: int, rate: float, profile: StepProfile, targets: SloTargets,
                        seed: int = 0) -> dict[str, float]:
    """Each cost in microseconds (the tick in milliseconds) at `workers` workers and `rate`
    arrivals a second in the traffic window."""
    rng = random.Random(seed)
    table = LoadTable.empty()
    ids = [f"w{i}" for i in range(workers)]
    for wid in ids:
        table.add(wid)
        table.report(wid, rng.randrange(4), rng.randrange(200), rng.random(),
                     rng.randrange(4096), True, prefill_s_per_token=1e-4)
    pool = table.select(table.rows_of(ids))
    index, route = PrefixIndex(), get_policy("prefix_aware")
    decode = get_decode_policy("least_loaded")
    it = iter(range(1 << 62))

    def report() -> None:
        wid = ids[next(it) % workers]
        table.report(wid, 3, 40, 0.5, 1000, True, prefill_s_per_token=1e-4)

    def decide() -> None:
        if pool.any_with_room(256, 1 << 20):
            route.choose((), pool, index)

    def pick() -> None:
        decode.pick((), pool, index).release()

    window = TrafficWindow(window_s=10.0, burst_s=2.0)
    for i in range(int(rate * 10)):
        window.arrived(i / rate, rng.choice((128, 2048)), 100)
    fitter, planner = ProfileFitter(profile), SloPlanner()
    states = [WorkerState(wid, WorkerRole.BOTH, True, rng.randrange(200)) for wid in ids]

    def tick() -> None:
        inp = PlanInput(window.classes(10.0), fitter.profile() or profile, targets,
                        PoolBounds(0, workers, 1, workers, workers))
        role_changes(states, planner.decide(inp))

    return {"report_us": 1e6 * _median_s(lambda: [report() for _ in range(1000)], 7) / 1000,
            "route_us": 1e6 * _median_s(lambda: [decide() for _ in range(200)], 7) / 200,
            "decode_pick_us": 1e6 * _median_s(lambda: [pick() for _ in range(200)], 7) / 200,
            "planner_tick_ms": 1e3 * _median_s(tick, 5)}


__all__ = ["control_plane_costs"]
