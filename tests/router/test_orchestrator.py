"""Every branch of the orchestrator, on scripted fake workers (no engine, milliseconds each):
routing, retry, fallback to local prefill, KV-pull failure, migration, and cancellation at each
point. What a client would notice: the exact token sequence, the error it gets, and that every
worker was told to let go of the request."""

from __future__ import annotations

import asyncio

import pytest

from router.errors import BadRequestError, NoHealthyWorkerError, WorkerUnavailableError
from tests.router.fakes import FakeWorker, Script, expected_tokens, orchestrator
from workers.contract.protocol import SamplingParams, WorkerRequest, WorkerRole

PREFILL, DECODE, BOTH = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.BOTH
GONE = WorkerUnavailableError("x", "the process died")
_ids = iter(range(10**6))


def request(num_tokens: int = 40, max_tokens: int = 6, n: int = 1) -> WorkerRequest:
    rid = next(_ids)
    return WorkerRequest(f"r{rid}", tuple(range(rid, rid + num_tokens)),
                         SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def collect(gen) -> list[int]:
    return [t async for event in gen.events() for t in event.token_ids]


def test_aggregated_deployment_streams_from_one_worker():
    async def go():
        w = FakeWorker("w0")
        o = await orchestrator(w)
        req = request()
        gen = await o.generate(req)
        assert await collect(gen) == expected_tokens(req)
        assert w.calls.streams == [("generate", req.request_id)] and not w.calls.aborts
        assert o.counters.num_requests == 1 and o.counters.num_disaggregated == 0

    run(go())


def test_disaggregated_request_gets_its_first_token_from_prefill_and_the_rest_from_decode():
    async def go():
        p, d = FakeWorker("p0", PREFILL), FakeWorker("d0", DECODE)
        o = await orchestrator(p, d)
        req = request()
        gen = await o.generate(req)
        assert gen.worker_id == "p0" and gen.decode_worker_id == "d0"
        assert await collect(gen) == expected_tokens(req)
        assert p.calls.prefills == [req.request_id] and not p.calls.aborts
        assert d.calls.handoffs[0].request_id == req.request_id  # the typed handoff, whole
        assert o.counters.num_disaggregated == 1 and not o.counters.fallbacks
        assert o.generations.metrics.kv_bytes.labels("decode", "d0")._value.get() == (
            3 * 2 * 2 * 16 * 2 * 8 * 4)  # blocks x layers x K,V x tokens x heads x dim x fp32

    run(go())


def test_routing_choices_short_prompt_n_above_one_and_no_prefill_worker_run_aggregated():
    async def go():
        p, d = FakeWorker("p0", PREFILL), FakeWorker("d0", DECODE)
        o = await orchestrator(p, d)
        for req, reason in ((request(num_tokens=4), "short_prompt"),
                            (request(n=2), "unsupported_params")):
            gen = await o.generate(req)
            assert gen.worker_id == "d0"
            await collect(gen)
            assert o.counters.aggregated[reason] == 1
        o.workers.mark_unhealthy("p0")
        gen = await o.generate(request())
        assert gen.worker_id == "d0" and o.counters.fallbacks["no_prefill_worker"] == 1
        assert not p.calls.prefills

    run(go())


def test_a_refused_request_is_a_bad_request_and_nothing_is_retried():
    async def go():
        p, d = FakeWorker("p0", PREFILL, Script(refuse=True)), FakeWorker("d0", DECODE)
        o = await orchestrator(p, d)
        with pytest.raises(BadRequestError, match="refuses"):
            await o.generate(request())
        assert len(p.calls.prefills) == 1 and not d.calls.streams
        agg = await orchestrator(FakeWorker("w0", BOTH, Script(refuse=True)))
        with pytest.raises(BadRequestError):
            await agg.generate(request())

    run(go())


def test_a_failed_prefill_is_retried_on_another_prefill_worker():
    async def go():
        bad = FakeWorker("p0", PREFILL, Script(prefill_error=GONE))
        good, d = FakeWorker("p1", PREFILL), FakeWorker("d0", DECODE)
        o = await orchestrator(bad, good, d)
        req = request()
        gen = await o.generate(req)
        assert gen.worker_id == "p1" and await collect(gen) == expected_tokens(req)
        assert o.counters.fallbacks == {"prefill_error": 1}
        assert not o.workers.is_healthy("p0")  # unreachable: routed around from now on

    run(go())


def test_when_every_prefill_fails_the_request_runs_whole_on_a_decode_worker():
    async def go():
        bad = [FakeWorker(f"p{i}", PREFILL, Script(prefill_error=RuntimeError("boom")))
               for i in range(2)]
        d = FakeWorker("d0", DECODE)
        o = await orchestrator(*bad, d, prefill_retries=1)
        req = request()
        gen = await o.generate(req)
        assert gen.worker_id == "d0" and await collect(gen) == expected_tokens(req)
        assert o.counters.fallbacks == {"prefill_error": 2, "prefill_failed": 1}
        assert o.counters.aggregated == {"prefill_failed": 1}

    run(go())


def test_a_failed_kv_pull_makes_the_decode_worker_compute_the_prompt_and_ends_the_lease():
    async def go():
        p, d = FakeWorker("p0", PREFILL), FakeWorker("d0", DECODE, Script(fail_pull=True))
        o = await orchestrator(p, d)
        req = request()
        gen = await o.generate(req)
        assert await collect(gen) == expected_tokens(req)  # nothing repeated or lost
        assert d.calls.handoffs[1] is None  # asked again, without the handoff
        assert p.calls.aborts == [req.request_id]  # the lease ended
        assert o.counters.fallbacks == {"kv_pull_failed": 1}
        assert o.generations.metrics.kv_failures.labels("decode", "d0", "LeaseExpired")._value.get() == 1

    run(go())


@pytest.mark.parametrize("layout", ["aggregated", "disaggregated"])
def test_a_stream_whose_worker_fails_mid_way_moves_to_another_worker(layout):
    async def go():
        flaky = FakeWorker("d0", DECODE if layout == "disaggregated" else BOTH,
                           Script(stream_error=GONE, error_after=2))
        other = FakeWorker("d1", DECODE if layout == "disaggregated" else BOTH)
        workers = [flaky, other] + ([FakeWorker("p0", PREFILL)] if layout == "disaggregated"
                                    else [])
        o = await orchestrator(*workers, migration_retries=1)
        o.workers.note_routed("d1")  # d0 looks idler: the request starts there
        req = request(max_tokens=8)
        gen = await o.generate(req)
        assert await collect(gen) == expected_tokens(req)
        assert other.calls.streams == [("resume", req.request_id)]
        assert gen.streamed_by == ["d0", "d1"]
        assert o.counters.fallbacks == {"decode_worker_failed": 1}
        assert not o.workers.is_healthy("d0")

    run(go())


def test_a_stream_fails_when_its_migrations_are_used_up_or_no_worker_is_left():
    async def go():
        a = FakeWorker("w0", BOTH, Script(stream_error=GONE, error_after=1))
        b = FakeWorker("w1", BOTH, Script(stream_error=GONE, error_after=1))
        o = await orchestrator(a, b, migration_retries=5)
        gen = await o.generate(request())
        # w0 failed, w1 failed, none left: the client is told 503, not an internal error
        with pytest.raises(NoHealthyWorkerError, match="no other could continue it"):
            await collect(gen)
        assert o.counters.fallbacks == {"decode_worker_failed": 1}
        c = FakeWorker("w2", BOTH, Script(stream_error=GONE, error_after=1))
        o = await orchestrator(c, FakeWorker("w3", BOTH), migration_retries=0)
        o.workers.note_routed("w3")
        with pytest.raises(NoHealthyWorkerError):
            await collect(await o.generate(request()))

    run(go())


def test_a_stream_waits_for_a_replacement_worker_within_migration_wait():
    async def go():
        a = FakeWorker("w0", BOTH, Script(stream_error=GONE, error_after=2))
        o = await orchestrator(a, migration_retries=1, migration_wait_s=5.0)
        req = request(max_tokens=8)
        gen = await o.generate(req)

        async def replace_later() -> None:
            await asyncio.sleep(0.3)
            await o.workers.add(FakeWorker("w1", BOTH))

        adder = asyncio.ensure_future(replace_later())
        assert await collect(gen) == expected_tokens(req)
        await adder
        assert gen.streamed_by == ["w0", "w1"]

    run(go())


def test_an_unreachable_aggregated_worker_is_a_503_and_is_marked_down():
    async def go():
        w = FakeWorker("w0", BOTH)
        o = await orchestrator(w)
        w.closed = True
        with pytest.raises(NoHealthyWorkerError):
            await o.generate(request())
        assert not o.workers.is_healthy("w0")
        with pytest.raises(NoHealthyWorkerError):  # no healthy worker left to choose
            await o.generate(request())

    run(go())


def test_closing_during_the_handover_aborts_the_decode_stream_and_the_prefill_lease():
    async def go():
        p, d = FakeWorker("p0", PREFILL), FakeWorker("d0", DECODE, Script(hang_after=0))
        o = await orchestrator(p, d)
        req = request()
        gen = await o.generate(req)
        events = gen.events()
        assert (await events.__anext__()).token_ids == expected_tokens(req)[:1]
        pending = asyncio.ensure_future(events.__anext__())  # the KV is on its way
        await asyncio.sleep(0.01)
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await events.aclose()
        assert d.calls.aborts == [req.request_id] and p.calls.aborts == [req.request_id]

    run(go())


def test_closing_after_the_kv_landed_aborts_only_the_decode_worker():
    async def go():
        p, d = FakeWorker("p0", PREFILL), FakeWorker("d0", DECODE)
        o = await orchestrator(p, d)
        req = request(max_tokens=20)
        gen = await o.generate(req)
        events = gen.events()
        for _ in range(3):
            await events.__anext__()
        await events.aclose()
        assert d.calls.aborts == [req.request_id] and not p.calls.aborts

    run(go())


def test_cancelling_while_the_prefill_runs_aborts_it_on_the_prefill_worker():
    async def go():
        p, d = FakeWorker("p0", PREFILL, Script(hang_prefill=True)), FakeWorker("d0", DECODE)
        o = await orchestrator(p, d)
        req = request()
        task = asyncio.ensure_future(o.generate(req))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert p.calls.aborts == [req.request_id] and not d.calls.streams

    run(go())


def test_cancelling_before_the_first_aggregated_token_aborts_the_stream():
    async def go():
        w = FakeWorker("w0", BOTH, Script(hang_after=0))
        o = await orchestrator(w)
        req = request()
        task = asyncio.ensure_future(o.generate(req))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert w.calls.aborts == [req.request_id]

    run(go())


def test_the_worker_sets_loads_follow_reports_routing_draining_and_removal():
    from workers.contract.protocol import EngineStats

    async def go():
        workers = [FakeWorker(f"w{i}") for i in range(3)]
        o = await orchestrator(*workers)
        ws = o.workers
        before = ws.pool_loads(WorkerRole.BOTH, WorkerRole.DECODE)
        assert before.worker_ids == ["w0", "w1", "w2"]
        ws.note_routed("w1")
        ws.note_routed("w1")
        assert before[1].num_waiting == 2  # a pool's loads are the set's rows, not a copy
        ws.on_outputs("w1", (), EngineStats(1, 3, 0.5, 10, 0, 20, num_waiting_for_kv=1,
                                            num_pending_prompt_tokens=77))
        assert before[1] == ws.loads(["w1"])[0]
        assert (before[1].num_waiting, before[1].num_running, before[1].kv_usage,
                before[1].num_pending_prompt_tokens) == (2, 3, 0.5, 77)  # the report wins
        ws.draining.add("w0")
        assert [x.healthy for x in ws.pool_loads(WorkerRole.BOTH)] == [False, True, True]
        assert ws.is_healthy("w0") and "w0" not in ws.healthy_workers()
        await ws.remove("w2")
        assert before.without(()).worker_ids == ["w0", "w1"]  # read before, still knows
        assert ws.pool_loads(WorkerRole.BOTH).worker_ids == ["w0", "w1"]
        await ws.add(FakeWorker("w3"))  # a new row, never a reused one
        assert ws.pool_loads(WorkerRole.BOTH).worker_ids == ["w0", "w1", "w3"]
        assert before.without(()).worker_ids == ["w0", "w1"]

    run(go())
