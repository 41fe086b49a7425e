"""The SLO planner's decisions on made-up profiles and traffic (pure: no workers): pools sized
to the targets, the layout following the prompt mix, hysteresis, the profile fitted from
steps, the traffic window's classes, and the role switches that carry a plan out."""

from __future__ import annotations

import dataclasses
import math

import pytest

from router.planner import (
    AGGREGATED,
    Plan,
    PlanInput,
    PoolBounds,
    RequestClass,
    SloPlanner,
    SloTargets,
    best_plan,
    layout,
    overshoot,
)
from router.planner import prefill_pool
from router.profiles import ProfileFitter, StepProfile
from router.queueing import fewest, queue_wait_s
from router.role_plan import WorkerState, role_changes
from router.traffic import TrafficWindow
from workers.contract.protocol import WorkerRole

# an H200-like 8B profile (benchmarks/results/gpu_roofline.json: 4096-token prefill 107 ms,
# decode 4.9 ms at batch 1, 19.1 ms at 256)
GPU = StepProfile(prefill_fixed_s=0.002, prefill_s_per_token=0.026e-3, decode_fixed_s=0.0049,
                  decode_s_per_seq=0.000055, transfer_s_per_token=0.002e-3, max_batch=256,
                  chunk_tokens=2048, source="gpu_roofline")
TARGETS = SloTargets(ttft_s=0.5, itl_s=0.01)
CHAT = RequestClass(rate=50.0, prompt_tokens=128, output_tokens=128)
SUMMARIZE = RequestClass(rate=20.0, prompt_tokens=8192, output_tokens=64)


def plan_for(*classes: RequestClass, targets: SloTargets = TARGETS, **bounds: int):
    return best_plan(PlanInput(tuple(classes), GPU, targets, PoolBounds(**bounds)))


def test_short_chat_runs_aggregated_and_long_prompts_get_a_prefill_pool():
    chat = plan_for(CHAT)
    assert chat.feasible and chat.prefill == 0 and chat.threshold_tokens == AGGREGATED
    mixed = plan_for(CHAT, SUMMARIZE)
    # 8k-token prompts stall decode past the gap bound (2,048-token chunks: 55 ms against
    # 5 x 10 ms): they are handed off
    assert mixed.feasible and mixed.prefill >= 1
    assert mixed.threshold_tokens <= SUMMARIZE.prompt_tokens
    assert mixed.ttft_s <= TARGETS.ttft_s and mixed.itl_s <= TARGETS.itl_s
    aggregated = layout(PlanInput((CHAT, SUMMARIZE), GPU, TARGETS), AGGREGATED)
    assert not aggregated.feasible and "stalls decode" in aggregated.reason


def test_pools_grow_with_the_rate_and_a_tighter_target_costs_workers():
    small = plan_for(CHAT, SUMMARIZE)
    big = plan_for(RequestClass(500.0, 128, 128), RequestClass(200.0, 8192, 64))
    assert big.prefill > small.prefill and big.decode > small.decode
    tight = plan_for(CHAT, SUMMARIZE, targets=SloTargets(ttft_s=0.5, itl_s=0.007))
    assert tight.feasible and tight.decode > small.decode


def test_every_layout_the_planner_did_not_pick_costs_at_least_as_many_workers():
    inp = PlanInput((CHAT, SUMMARIZE), GPU, TARGETS)
    chosen = best_plan(inp)
    for threshold in (0, 129, AGGREGATED):
        other = layout(inp, threshold)
        assert not other.feasible or other.workers >= chosen.workers


def test_a_target_the_bounds_cannot_meet_is_planned_at_the_bounds_and_said_so():
    plan = plan_for(RequestClass(5000.0, 4096, 128), max_prefill=2, max_decode=3)
    assert not plan.feasible and plan.prefill <= 2 and plan.decode == 3
    assert "target" in plan.reason


def test_no_traffic_keeps_the_minimum_and_bad_targets_are_refused():
    assert plan_for(min_decode=2).decode == 2 and plan_for().prefill == 0
    with pytest.raises(ValueError, match="percentile"):
        SloTargets(0.5, 0.05, percentile=1.0)
    with pytest.raises(ValueError, match="max_decode"):
        PoolBounds(min_decode=4, max_decode=2)


def test_queue_wait_is_zero_when_lightly_loaded_and_unbounded_when_saturated():
    assert queue_wait_s(1.0, 0.05, 0.9) == 0.0  # rho 0.05
    assert queue_wait_s(10.0, 0.1, 0.9) == float("inf")
    assert 0 < queue_wait_s(8.0, 0.1, 0.9) < queue_wait_s(9.0, 0.1, 0.9)
    # M/M/1's p90 wait: ln(rho / 0.1) / (mu - lambda)
    assert queue_wait_s(8.0, 0.1, 0.9) == pytest.approx(math.log(8.0) / 2.0)
    # one pooled queue of 4 servers waits less than 4 queues of a quarter of the load each
    assert queue_wait_s(32.0, 0.1, 0.9, servers=4) < queue_wait_s(8.0, 0.1, 0.9)
    assert fewest(1, 1 << 20, lambda n: n >= 1000) == 1000  # doubling, then bisection
    assert fewest(1, 8, lambda n: False) == 8  # none meets it: the bound


def test_the_planner_grows_at_once_and_shrinks_only_after_its_window():
    planner = SloPlanner(down_ticks=3)
    busy = PlanInput((RequestClass(400.0, 128, 128), RequestClass(100.0, 8192, 64)), GPU,
                     TARGETS)
    quiet = PlanInput((CHAT,), GPU, TARGETS)
    first = planner.decide(quiet)
    grown = planner.decide(busy)
    assert grown.workers > first.workers  # at once
    held = [planner.decide(quiet) for _ in range(2)]
    assert all(p.workers == grown.workers for p in held)  # the total is held
    assert "held" in held[-1].reason
    assert planner.decide(quiet).workers == first.workers  # three quiet ticks in a row


def test_the_layout_changes_only_for_one_that_saves_workers():
    planner = SloPlanner(down_ticks=1)
    mixed = PlanInput((CHAT, SUMMARIZE), GPU, TARGETS)
    split = planner.decide(mixed)
    assert split.threshold_tokens != AGGREGATED
    chat = PlanInput((CHAT,), GPU, TARGETS)
    kept = planner.decide(chat)  # the split layout still meets the targets at no more workers
    if layout(chat, split.threshold_tokens).workers <= best_plan(chat).workers:
        assert kept.threshold_tokens == split.threshold_tokens
    else:
        assert kept.threshold_tokens == best_plan(chat).threshold_tokens


# one CPU core running the small preset (a 2,048-token prompt ~2.3 s, decode ~15 ms a step),
# two workers, an ITL target whose gap bound (5 ITLs) is 0.3 s: `benchmarks/planner.py`'s case
CPU = StepProfile(prefill_fixed_s=0.005, prefill_s_per_token=1.1e-3, decode_fixed_s=0.015,
                  decode_s_per_seq=0.003, chunk_tokens=2048)
CPU_TARGETS = SloTargets(ttft_s=11.3, itl_s=0.06)
TWO = PoolBounds(0, 2, 1, 2, 2)


def cpu(*classes: RequestClass) -> PlanInput:
    return PlanInput(classes, CPU, CPU_TARGETS, TWO)


def test_when_nothing_meets_the_targets_a_stalling_layout_is_not_the_smallest_miss():
    long = cpu(RequestClass(0.3, 2048, 64))
    aggregated = layout(long, AGGREGATED)
    # aggregated meets TTFT and ITL on average but a 2,048-token prefill stalls its streams
    assert aggregated.ttft_s < CPU_TARGETS.ttft_s and aggregated.itl_s < CPU_TARGETS.itl_s
    assert aggregated.gap_s > 5 * CPU_TARGETS.itl_s and not aggregated.feasible
    chosen = best_plan(long)
    assert not chosen.feasible and chosen.prefill == 1 and chosen.decode == 1
    assert overshoot(chosen, CPU_TARGETS) < overshoot(aggregated, CPU_TARGETS)


def test_a_layout_past_the_bounds_keeps_a_prefill_worker_and_is_predicted_at_its_size():
    long = cpu(RequestClass(0.4, 2048, 64))  # one prefill worker at 90% load
    split = layout(long, 0)
    assert (split.prefill, split.decode, split.feasible) == (1, 1, False)
    # the TTFT predicted is one prefill worker's, past the target, not two workers' within it
    at_one = prefill_pool([RequestClass(0.4, 2048, 64)], long, 0.0, at=1)[1]
    assert split.ttft_s > CPU_TARGETS.ttft_s
    assert split.ttft_s == pytest.approx(at_one, abs=0.1)


def test_between_layouts_that_both_miss_the_layout_changes_only_for_a_clearly_smaller_miss():
    planner = SloPlanner(down_ticks=1)
    assert planner.decide(cpu(RequestClass(1.0, 128, 128))).threshold_tokens == AGGREGATED
    near = cpu(RequestClass(2.0, 300, 128))  # handing off misses by a little less
    assert best_plan(near).threshold_tokens == 0
    assert overshoot(layout(near, 0), CPU_TARGETS) > 0.8 * overshoot(layout(near, AGGREGATED),
                                                                       CPU_TARGETS)
    assert planner.decide(near).threshold_tokens == AGGREGATED  # kept: no switch for that
    far = cpu(RequestClass(2.0, 400, 128))  # aggregated misses by much more
    assert planner.decide(far).threshold_tokens == 0


def test_a_fitted_profile_recovers_the_step_costs_it_saw():
    prior = StepProfile(0.0, 1e-3, 0.05, 0.01)
    fitter = ProfileFitter(prior, min_samples=8)
    assert fitter.profile() == prior
    for batch in range(1, 33):
        for ctx in (100.0, 900.0):
            fitter.observe_decode(batch, ctx, 0.004 + batch * (0.0002 + ctx * 1e-7))
    fitter.observe_prefill_rate(3e-5)
    fit = fitter.profile()
    assert fit.decode_fixed_s == pytest.approx(0.004, rel=1e-6)
    assert fit.decode_s_per_seq == pytest.approx(0.0002, rel=1e-6)
    assert fit.decode_s_per_ctx_token == pytest.approx(1e-7, rel=1e-6)
    assert fit.prefill_s_per_token == 3e-5


def test_the_traffic_window_gives_the_mix_and_plans_for_a_burst_at_once():
    window = TrafficWindow(window_s=10.0, burst_s=2.0)
    for i in range(100):  # 10/s of chat for 10 s
        window.arrived(i * 0.1, 120, 100)
    (chat,) = window.classes(10.0)
    assert chat.rate == pytest.approx(10.0, rel=0.02) and chat.prompt_tokens == 120
    for i in range(100):  # then 50/s of long prompts for 2 s
        window.arrived(10.0 + i * 0.02, 3000, 50)
    chat, long = window.classes(12.0)
    assert (chat.prompt_tokens, long.prompt_tokens) == (120, 3000)
    # the long prompts ran at 50/s in the last 2 s, not 10/s over the window: planned at once
    assert long.rate == pytest.approx(50.0, rel=0.05)
    assert chat.rate == pytest.approx(80 / 10.0, rel=0.05)  # what the window holds of it


def test_a_rare_class_bunching_in_the_burst_window_is_not_planned_as_a_burst():
    window = TrafficWindow(window_s=15.0, burst_s=5.0)
    for i in range(3):  # a 0.2/s class: one arrival at 0 s, then two close together
        window.arrived((0.0, 13.0, 14.5)[i], 2048, 64)
    (long,) = window.classes(15.0)
    assert long.rate == pytest.approx(3 / 15.0)  # the window's rate, not 2 in 5 s
    for i in range(5):  # five in the last 2 s: a burst
        window.arrived(15.0 + i * 0.4, 2048, 64)
    (long,) = window.classes(17.0)
    assert long.rate == pytest.approx(7 / 5.0)
    with pytest.raises(ValueError, match="min_burst"):
        TrafficWindow(min_burst=0)


def workers(*spec: tuple[str, WorkerRole, bool, int]) -> list[WorkerState]:
    return [WorkerState(*s) for s in spec]


def test_decode_workers_with_the_fewest_streams_switch_to_prefill_under_pressure():
    plan = plan_for(CHAT, SUMMARIZE)
    need = plan.prefill
    flexible = workers(*[(f"w{i}", WorkerRole.BOTH, True, 10 - i)
                         for i in range(plan.workers)])
    changes = role_changes(flexible, plan)
    switched = [wid for wid, role in changes.switches if role == WorkerRole.PREFILL]
    assert len(switched) == need
    assert switched == [f"w{plan.workers - 1 - i}" for i in range(need)]  # fewest streams
    assert changes.switchable_replicas == plan.workers


def test_switches_go_back_when_prefill_pressure_ends_and_dedicated_workers_never_switch():
    chat = Plan(prefill=0, decode=3, threshold_tokens=AGGREGATED, feasible=True, ttft_s=0.1,
                itl_s=0.01, reason="")
    ws = workers(("p0", WorkerRole.PREFILL, False, 0), ("f1", WorkerRole.PREFILL, True, 0),
                 ("d0", WorkerRole.DECODE, False, 5), ("f2", WorkerRole.BOTH, True, 3))
    changes = role_changes(ws, chat)
    assert changes.switches == (("f1", WorkerRole.BOTH),)
    assert changes.prefill_replicas == 0  # the dedicated prefill pool shrinks to the plan


def test_between_layouts_that_both_miss_a_switch_waits_until_the_smaller_miss_lasts():
    planner = SloPlanner(down_ticks=3)
    chat = cpu(RequestClass(1.0, 128, 128))
    far = cpu(RequestClass(2.0, 400, 128))  # handing off misses by much less (test above)
    assert planner.decide(chat).threshold_tokens == AGGREGATED
    # a slow phase's estimate swinging: the smaller miss for one tick, then not, never switches
    for _ in range(4):
        assert planner.decide(far).threshold_tokens == AGGREGATED
        assert planner.decide(chat).threshold_tokens == AGGREGATED
    # three ticks in a row: it switches on the third
    assert [planner.decide(far).threshold_tokens for _ in range(3)] == [AGGREGATED,
                                                                        AGGREGATED, 0]


def test_a_handoffs_path_counts_in_the_prefill_pools_ttft():
    """A disaggregated prompt's first token waits for its handoff (`StepProfile.handoff_s`:
    the prefill call's return with its KV offer, measured by benchmarks/planner_overheads.py)."""
    slow = dataclasses.replace(GPU, handoff_fixed_s=0.05, handoff_s_per_token=1e-5)
    inp = PlanInput((SUMMARIZE,), GPU, TARGETS, PoolBounds())
    _, ttft = prefill_pool(inp.classes, inp, 0.005, at=8)
    _, slower = prefill_pool(inp.classes, dataclasses.replace(inp, profile=slow), 0.005, at=8)
    assert slower - ttft == pytest.approx(0.05 + 8192 * 1e-5)
