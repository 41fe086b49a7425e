"""The engine's waiting queue: first come first served, except that requests with a TTFT
deadline go ahead of those due later or never, earliest first (`scheduling_policy=deadline`,
the default); `fcfs` keeps arrival order. A preempted request keeps its place at the front."""

from __future__ import annotations

import dataclasses

from tests.workers.factories import create_request, create_scheduler, fake_step


def admitted_order(order_by_deadline: bool) -> list[str]:
    """The order five requests (one running first, then four queued: two without a deadline,
    two with) reach the running set, one sequence at a time."""
    scheduler = create_scheduler(max_num_seqs=1, num_blocks=32)
    scheduler.config = dataclasses.replace(scheduler.config, order_by_deadline=order_by_deadline)
    deadlines = {"first": None, "plain-a": None, "due-late": 20.0, "plain-b": None,
                 "due-soon": 10.0}
    seen: list[str] = []
    for name, deadline in deadlines.items():
        req = create_request(name, [1, 2, 3], max_tokens=2, ignore_eos=True)
        req.deadline = deadline
        scheduler.add(req)
        if name == "first":  # running before the others arrive
            seen.append(fake_step(scheduler).chunks[0].request.request_id)
    for _ in range(40):
        for chunk in fake_step(scheduler).chunks:
            if chunk.request.request_id not in seen:
                seen.append(chunk.request.request_id)
    return seen


def test_requests_with_a_deadline_are_admitted_earliest_due_first_ahead_of_the_rest():
    assert admitted_order(True) == ["first", "due-soon", "due-late", "plain-a", "plain-b"]


def test_fcfs_admits_in_arrival_order():
    assert admitted_order(False) == ["first", "plain-a", "due-late", "plain-b", "due-soon"]


def test_a_preempted_request_stays_ahead_of_a_new_request_due_sooner():
    scheduler = create_scheduler()
    preempted = create_request("preempted", [1, 2, 3])
    scheduler.add(preempted)
    fake_step(scheduler)
    scheduler._preempt(preempted)
    scheduler.running.remove(preempted)
    due = create_request("due", [4, 5, 6])
    due.deadline = 1.0
    scheduler.add(due)
    assert [r.request_id for r in scheduler.waiting] == ["preempted", "due"]


def test_the_prompt_tokens_a_deadline_waits_behind_leave_out_the_queue_without_one():
    """What the engine reports for the router's deadline admission: the running requests'
    prompt left and the queued requests with a deadline, not those without (under fcfs, every
    pending token: the field is left None)."""
    from workers.engine.load import engine_stats
    from workers.engine.waiting_order import prompt_tokens_before_due

    scheduler = create_scheduler(max_num_seqs=1, num_blocks=64)
    scheduler.add(create_request("running", list(range(1, 9)), max_tokens=4, ignore_eos=True))
    fake_step(scheduler)  # its 8 prompt tokens computed
    for name, n, deadline in (("plain", 40, None), ("due", 7, 5.0), ("plain2", 30, None)):
        req = create_request(name, list(range(1, n + 1)))
        req.deadline = deadline
        scheduler.add(req)
    assert [r.request_id for r in scheduler.waiting] == ["due", "plain", "plain2"]
    assert scheduler.num_pending_prompt_tokens == 77
    assert prompt_tokens_before_due(scheduler.running, scheduler.waiting) == 7
    stats = engine_stats(scheduler, scheduler.kv, _NoCosts(), None, 0.0, 0.0)
    assert (stats.num_pending_prompt_tokens, stats.num_due_prompt_tokens) == (77, 7)
    scheduler.config = dataclasses.replace(scheduler.config, order_by_deadline=False)
    assert engine_stats(scheduler, scheduler.kv, _NoCosts(), None, 0.0, 0.0
                        ).num_due_prompt_tokens is None


class _NoCosts:
    """`StepCosts` before any step was measured."""

    host_hit_cost = prefill_s_per_token = 0.0
    num_prompt_tokens_computed = 0
