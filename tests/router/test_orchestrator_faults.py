"""The orchestrator under failure and overload, on scripted fake workers: an aggregated request
whose worker fails before its first token starts elsewhere; a full cluster refuses with 429 and
Retry-After instead of queueing; a worker removed while its prefix cache is being read leaves
no ghost entry in the prefix index."""

from __future__ import annotations

import asyncio

import pytest

from router.errors import NoHealthyWorkerError, OverloadedError, WorkerUnavailableError
from tests.router.fakes import FakeWorker, Script, expected_tokens, orchestrator
from tests.router.test_orchestrator import collect, request, run
from workers.contract.protocol import EngineOverloaded, EngineStats, WorkerRole
from workers.contract.prefix_cache import KVSnapshot

BOTH, PREFILL, DECODE = WorkerRole.BOTH, WorkerRole.PREFILL, WorkerRole.DECODE
GONE = WorkerUnavailableError("w0", "the process died")


def report(worker: FakeWorker, waiting: int = 0, pending_tokens: int = 0) -> None:
    """The worker pushes a load report, as its channel does after each step."""
    assert worker.listener is not None
    worker.listener.on_outputs(worker.worker_id, (), EngineStats(
        waiting, 0, 0.0, 256, 0, 256, num_pending_prompt_tokens=pending_tokens))


def test_an_aggregated_request_whose_worker_fails_before_its_first_token_starts_elsewhere():
    async def go():
        bad = FakeWorker("w0", BOTH, Script(stream_error=GONE, error_after=0))
        good = FakeWorker("w1", BOTH)
        o = await orchestrator(bad, good, policy="round_robin")
        for _ in range(2):  # whichever the policy picks first, both requests succeed
            req = request()
            gen = await o.generate(req)
            assert gen.worker_id == "w1" and await collect(gen) == expected_tokens(req)
        assert not o.workers.is_healthy("w0")
        assert o.counters.fallbacks.get("start_failed", 0) <= 1

    run(go())


def test_when_every_worker_fails_to_start_it_the_client_gets_a_503_naming_them():
    async def go():
        ws = [FakeWorker(f"w{i}", BOTH, Script(stream_error=WorkerUnavailableError(
            f"w{i}", "it is shutting down"))) for i in range(2)]
        o = await orchestrator(*ws)
        with pytest.raises(NoHealthyWorkerError, match=r"tried w0, w1"):
            await o.generate(request())
        assert o.counters.fallbacks == {"start_failed": 2}

    run(go())


def test_an_engine_error_before_the_first_token_is_not_spread_to_other_workers():
    async def go():
        bad = FakeWorker("w0", BOTH, Script(stream_error=RuntimeError("the step failed")))
        other = FakeWorker("w1", BOTH)
        o = await orchestrator(bad, other, policy="round_robin")
        with pytest.raises(RuntimeError, match="the step failed"):
            for _ in range(2):  # round robin reaches w0 within two requests
                await collect(await o.generate(request()))
        assert not [s for s in other.calls.streams if s[1] == bad.calls.streams[0][1]]

    run(go())


def test_workers_refusing_as_overloaded_give_429_with_retry_after():
    async def go():
        ws = [FakeWorker(f"w{i}", BOTH, Script(stream_error=EngineOverloaded("r", "queue full")))
              for i in range(2)]
        o = await orchestrator(*ws, retry_after_s=3)
        with pytest.raises(OverloadedError) as caught:
            await o.generate(request())
        assert caught.value.status == 429 and caught.value.headers == {"Retry-After": "3"}
        assert all(o.workers.is_healthy(w.worker_id) for w in ws)  # overloaded is not down

    run(go())


def test_admission_refuses_only_when_every_healthy_worker_is_full():
    async def go():
        a, b = FakeWorker("w0", BOTH), FakeWorker("w1", BOTH)
        o = await orchestrator(a, b, max_waiting_per_worker=4, max_pending_tokens_per_worker=1000)
        report(a, waiting=4)
        req = request()  # w1 still has room: routed there
        gen = await o.generate(req)
        assert gen.worker_id == "w1" and await collect(gen) == expected_tokens(req)
        report(b, pending_tokens=1000)
        with pytest.raises(OverloadedError, match="every worker's queue is full") as caught:
            await o.generate(request())
        assert caught.value.status == 429 and "Retry-After" in caught.value.headers
        assert o.counters.num_refused_overloaded == 1
        assert not a.calls.streams[1:] and len(b.calls.streams) == 1  # nothing was sent
        report(a)  # w0 drained its queue: admitted again
        assert (await o.generate(request())).worker_id == "w0"

    run(go())


def test_a_disaggregated_cluster_admits_on_the_prefill_pool():
    async def go():
        p, d = FakeWorker("p0", PREFILL), FakeWorker("d0", DECODE)
        o = await orchestrator(p, d, max_waiting_per_worker=2)
        report(p, waiting=2)
        with pytest.raises(OverloadedError):
            await o.generate(request())
        assert not p.calls.prefills

    run(go())


class _SlowSnapshotWorker(FakeWorker):
    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id, BOTH)
        self.reading = asyncio.Event()
        self.release = asyncio.Event()
        self.slow = False

    async def kv_snapshot(self) -> KVSnapshot:
        if self.slow:
            self.reading.set()
            await self.release.wait()
            return KVSnapshot(f"epoch-{self.worker_id}", 1, frozenset({11, 12}))
        return await super().kv_snapshot()


def test_a_worker_removed_while_its_cache_is_read_leaves_no_ghost_in_the_prefix_index():
    async def go():
        w = _SlowSnapshotWorker("w0")
        o = await orchestrator(w, FakeWorker("w1", BOTH))
        w.slow = True
        resync = asyncio.get_running_loop().create_task(o.workers._resync("w0"))
        await w.reading.wait()
        await o.workers.remove("w0")
        w.release.set()
        await resync
        assert "w0" not in o.workers.index.workers()

    run(go())


class _RemovesOthersWorker(FakeWorker):
    """Its stream fails before the first token; meanwhile the other workers named leave the
    set (a drain, a directory resync), so the loads the retry was routed on are stale."""

    def __init__(self, worker_id: str, leaving: list[str]) -> None:
        super().__init__(worker_id, BOTH, Script(stream_error=GONE))
        self.leaving = leaving
        self.orchestrator = None

    def generate(self, req, prefix=None):
        for wid in self.leaving:
            asyncio.get_running_loop().create_task(self.orchestrator.workers.remove(wid))
        self.leaving = []
        return super().generate(req, prefix)


def test_a_retry_never_routes_to_a_worker_that_left_the_set_meanwhile():
    async def go():
        first = _RemovesOthersWorker("w0", ["w1"])
        o = await orchestrator(first, FakeWorker("w1", BOTH), FakeWorker("w2", BOTH),
                               policy="round_robin")
        first.orchestrator = o
        req = request()
        gen = await o.generate(req)  # w0 fails; w1 has left; not a KeyError but w2
        assert gen.worker_id == "w2" and await collect(gen) == expected_tokens(req)

    run(go())


def test_a_request_while_every_worker_is_being_replaced_gets_a_503():
    """The model's shape (block size, context) outlives the workers: with none in the set
    (all being replaced), a request is told 503, not an internal error."""
    async def go():
        o = await orchestrator(FakeWorker("w0", BOTH))
        await o.workers.remove("w0")
        assert o.block_size > 0
        with pytest.raises(NoHealthyWorkerError):
            await o.generate(request())

    run(go())
