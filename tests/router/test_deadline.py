"""Deadline-aware admission and role switching on scripted fake workers: a request whose own
TTFT target no worker can meet under the pushed load is refused with 429 and Retry-After before
any worker is asked anything; a switchable worker is routed under its new role at once."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from router.deadline import ttft_deadline_s
from router.config import RouterConfig
from router.errors import BadRequestError, OverloadedError
from router.live_migration import LiveMigrations
from router.orchestrator import PREFILL_POOL
from router.role_switch import switch_role
from router.slo_control import SloControl
from tests.router.fakes import FakeWorker, expected_tokens, orchestrator
from workers.contract.protocol import EngineStats, SamplingParams, WorkerRequest, WorkerRole

S_PER_TOKEN = 1e-4  # each fake's measured prefill rate: 10k prompt tokens a second


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def request(num_tokens: int = 40) -> WorkerRequest:
    return WorkerRequest(f"r{num_tokens}", tuple(range(num_tokens)),
                         SamplingParams(max_tokens=4, temperature=0.0))


def report(worker: FakeWorker, pending_tokens: int) -> None:
    """The worker pushes a load: `pending_tokens` prompt tokens queued there."""
    assert worker.listener is not None
    worker.listener.on_outputs(worker.worker_id, (), EngineStats(
        1, 0, 0.0, 256, 0, 256, num_pending_prompt_tokens=pending_tokens,
        prefill_s_per_token=S_PER_TOKEN))


def test_the_header_gives_the_deadline_in_seconds_and_a_bad_one_is_a_400():
    assert ttft_deadline_s({"x-slo-ttft-ms": "250"}) == 0.25
    assert ttft_deadline_s({}) is None
    for bad in ("0", "-5", "soon", "nan", "1e12"):
        with pytest.raises(BadRequestError, match="x-slo-ttft-ms"):
            ttft_deadline_s({"x-slo-ttft-ms": bad})


def test_a_deadline_no_worker_can_meet_is_refused_before_any_work():
    async def go():
        a, b = FakeWorker("a"), FakeWorker("b")
        o = await orchestrator(a, b)
        report(a, 20_000)  # 2 s of prompts queued
        report(b, 5_000)  # 0.5 s
        with pytest.raises(OverloadedError) as refused:
            await o.generate(request(), ttft_deadline_s=0.2)
        assert refused.value.headers["Retry-After"] == "1"
        assert "x-slo-ttft-ms" in refused.value.message
        assert a.calls.streams == b.calls.streams == []  # nothing started anywhere
        assert o.counters.num_refused_deadline == 1
        # a looser deadline, or none, is served on the worker that can meet it
        req = request(41)
        gen = await o.generate(req, ttft_deadline_s=1.0)
        assert [t async for e in gen.events() for t in e.token_ids] == expected_tokens(req)
        assert b.calls.streams == [("generate", req.request_id)]
        await (await o.generate(request(42))).aclose()

    run(go())


def test_a_deadline_is_predicted_from_the_prompts_queued_ahead_of_it_not_behind():
    """A worker queueing earliest deadline first reports the prompt tokens a deadline request
    would wait behind (`num_due_prompt_tokens`): a long queue without deadlines behind it
    does not get the request refused; the same queue in arrival order does."""
    async def go():
        a = FakeWorker("a")
        o = await orchestrator(a)
        stats = EngineStats(1, 0, 0.0, 256, 0, 256, num_pending_prompt_tokens=20_000,
                            prefill_s_per_token=S_PER_TOKEN)
        a.listener.on_outputs("a", (), stats)  # fcfs: all 2 s of it ahead
        with pytest.raises(OverloadedError):
            await o.generate(request(), ttft_deadline_s=0.2)
        a.listener.on_outputs("a", (), dataclasses.replace(stats, num_due_prompt_tokens=500))
        req = request(43)
        gen = await o.generate(req, ttft_deadline_s=0.2)  # 54 ms ahead of it: admitted
        assert [t async for e in gen.events() for t in e.token_ids] == expected_tokens(req)
        assert o.counters.num_refused_deadline == 1

    run(go())


def test_a_switchable_worker_is_routed_as_prefill_once_assigned_and_back():
    async def go():
        a, b = FakeWorker("a"), FakeWorker("b")
        o = await orchestrator(a, b)
        o.workers.assign_role("a", WorkerRole.PREFILL)
        assert o.workers.pool(*PREFILL_POOL) == ["a"]
        req = request(40)  # past the fakes' threshold of 8 tokens: handed off
        gen = await o.generate(req)
        assert [t async for e in gen.events() for t in e.token_ids] == expected_tokens(req)
        assert a.calls.prefills == [req.request_id]
        assert b.calls.streams == [("decode_from_handoff", req.request_id)]
        o.workers.assign_role("a", WorkerRole.BOTH)
        assert o.workers.pool(*PREFILL_POOL) == []

    run(go())


def test_a_worker_started_for_one_half_does_not_switch():
    async def go():
        o = await orchestrator(FakeWorker("d", WorkerRole.DECODE), FakeWorker("b"))
        with pytest.raises(ValueError, match="started as 'decode'"):
            o.workers.assign_role("d", WorkerRole.PREFILL)

    run(go())


def test_a_switch_back_to_the_decode_pool_waits_for_the_prompts_queued_there():
    async def go():
        a, b = FakeWorker("a"), FakeWorker("b")
        o = await orchestrator(a, b)
        migrations = LiveMigrations(o.workers, o.counters)
        to_prefill = await switch_role(o.workers, migrations, "a", WorkerRole.PREFILL)
        assert (to_prefill.moved, o.workers.role_of("a")) == (0, WorkerRole.PREFILL)
        assert "a" not in o.workers.draining
        report(a, 4096)  # a long prompt still queued there
        back = asyncio.create_task(switch_role(o.workers, migrations, "a", WorkerRole.BOTH))
        await asyncio.sleep(0.05)
        assert not back.done() and "a" in o.workers.draining  # routed nothing meanwhile
        assert o.workers.role_of("a") == WorkerRole.PREFILL
        a.listener.on_outputs("a", (), EngineStats(0, 0, 0.0, 256, 0, 256))  # done
        switch = await back
        assert switch.after == WorkerRole.BOTH and switch.seconds >= 0.05
        assert o.workers.pool(*PREFILL_POOL) == [] and "a" not in o.workers.draining

    run(go())


def test_the_live_planner_fits_a_profile_from_pushed_steps_then_moves_the_threshold_and_roles():
    """`SloControl` over fake workers: no plan before a profile is fitted; then long prompts
    arriving make it hand them off (a switchable worker becomes a prefill worker) while the
    short ones stay whole."""
    async def go():
        workers = [FakeWorker(f"w{i}") for i in range(4)]
        o = await orchestrator(*workers)
        clock = [1000.0]  # the steps' times as pushed, not this machine's sleeps
        control = SloControl(RouterConfig("fake-model", slo_ttft_ms=2000, slo_itl_ms=30),
                             o.workers, LiveMigrations(o.workers, o.counters),
                             clock=lambda: clock[0])
        o.workers.observers.append(control.observe)
        for i in range(20):  # the last 10 s: 2/s of 4,096-token prompts, 2/s of chat
            control.traffic.arrived(clock[0] - 10 + i / 2, 4096, 64)
            control.traffic.arrived(clock[0] - 10 + i / 2, 100, 100)
        assert control.decide() is None  # no profile yet
        for step in range(40):  # pure decode steps, 10 ms + 0.1 ms a sequence
            running = 1 + step % 20
            clock[0] += 0.01 + running * 1e-4
            workers[0].listener.on_outputs("w0", (), EngineStats(
                0, running, 0.1, 256, 0, 256, prefill_s_per_token=1e-4))
        plan = control.decide()
        # a 2,048-token chunk (0.2 s) would stall decode past 5 x 30 ms: long prompts go to
        # a prefill pool
        assert plan is not None and plan.feasible and 1 <= plan.prefill < 4, plan
        assert plan.threshold_tokens <= 4096
        o.split = control.split_policy(o.split)
        assert o.split.threshold_tokens == plan.threshold_tokens
        switched = await control.apply()
        assert len(switched) == plan.prefill
        assert sorted(o.workers.pool(*PREFILL_POOL)) == sorted(switched)

    run(go())


def test_a_request_with_a_deadline_is_served_ahead_of_the_queue_it_joins(tiny_model):
    """Through the HTTP API on one worker running one sequence at a time: four requests without
    a deadline are sent (one runs, three queue), then one with `x-slo-ttft-ms`: the engine
    queues it first (`scheduling_policy=deadline`), so it finishes second, not last."""
    import threading

    import httpx

    from cluster.local_server import LocalServeConfig, LocalServer
    from tests.router.conftest import API_KEY, NUM_BLOCKS, slow_steps, wait_until

    config = LocalServeConfig(tiny_model, num_workers=1, http_port=0, grpc_port=0,
                              router={"api_keys": (API_KEY,), "kv_poll_interval_s": 0.2},
                              engine={"num_blocks": NUM_BLOCKS, "max_num_seqs": 1})
    srv = slow_steps(LocalServer(config).start(), 0.05)
    finished: list[str] = []
    errors: list[str] = []

    def send(name: str, headers: dict[str, str]) -> None:
        r = httpx.post(f"http://127.0.0.1:{srv.http_port}/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {API_KEY}", **headers},
                       json={"model": srv.router.model_name, "prompt": [5, 6, 7, 8],
                             "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        (finished if r.status_code == 200 else errors).append(f"{name} {r.status_code}")

    def waiting() -> int:
        return srv.call(srv.clients[0].stats()).num_waiting

    try:
        threads = [threading.Thread(target=send, args=(f"plain{i}", {})) for i in range(4)]
        for t in threads:
            t.start()
        assert wait_until(lambda: waiting() == 3, 10.0), waiting()
        due = threading.Thread(target=send, args=("due", {"x-slo-ttft-ms": "60000"}))
        due.start()
        for t in [*threads, due]:
            t.join(60)
        assert not errors, errors
        assert [f.split()[0] for f in finished].index("due") == 1, finished
    finally:
        srv.stop()
