"""Workers in their roles: a prefill worker hands a prompt's KV to a decode worker over real TCP
sockets on 127.0.0.1, and every block comes back however the handoff ends."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tests.workers.factories import create_request, create_scheduler, fake_step
from workers.engine.config import EngineConfig
from workers.engine.kv_cache import KVCacheManager
from workers.contract.messages import Abort, DecodeFromHandoff, FailureKind, Generate, Resume
from workers.contract.protocol import (
    EngineOverloaded,
    FinishReason,
    KVPullFailed,
    SamplingParams,
    WorkerRequest,
)
from workers.serving.worker import Worker

NUM_BLOCKS = 48
PROMPT = list(range(5, 45))  # 40 tokens: 2 full blocks of 16 and a partial one
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def make_worker(model: str, worker_id: str, role: str, **options: object) -> Worker:
    config = EngineConfig(model=model, num_blocks=NUM_BLOCKS, max_num_batched_tokens=256)
    return Worker.from_config(worker_id, config, role, **options)


def req(request_id: str, prompt: list[int] = PROMPT,
        params: SamplingParams = GREEDY) -> WorkerRequest:
    return WorkerRequest(request_id, tuple(prompt), params)


def decode_stream(worker: Worker, request_id: str, first: int, handoff, prompt=PROMPT,
                  params=GREEDY):
    return worker.stream(DecodeFromHandoff(req(request_id, prompt, params), first, handoff))


async def collect(stream) -> list[int]:
    return [t async for event in stream for t in event.token_ids]


async def until_all_free(*workers: Worker, timeout_s: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if all(w.stats().num_free_blocks == NUM_BLOCKS for w in workers):
            return True
        await asyncio.sleep(0.02)
    return False


@pytest.fixture(scope="module")
def trio(tiny_model, run):
    """A prefill, a decode and an aggregated worker, shared by the module's tests."""
    workers = (make_worker(tiny_model, "p", "prefill", lease_s=5.0),
               make_worker(tiny_model, "d", "decode", pull_timeout_s=5.0),
               make_worker(tiny_model, "b", "both"))
    yield workers
    for w in workers:
        run(w.shutdown())


def test_roles_are_checked(tiny_model, trio, run):
    prefill, decode, _ = trio
    with pytest.raises(ValueError, match="role"):
        Worker(prefill.worker_id, prefill.async_engine, role="verifier")

    async def wrong_halves() -> None:
        with pytest.raises(ValueError, match="has role 'decode'"):
            await decode.prefill(req("r", PROMPT, GREEDY))
        with pytest.raises(ValueError, match="has role 'prefill'"):
            await collect(decode_stream(prefill, "r", 1, None))

    run(wrong_halves())


def test_handoff_over_tcp_matches_aggregated_and_frees_every_block(trio, run):
    prefill, decode, both = trio

    async def go() -> tuple[list[int], list[int]]:
        want = await collect(both.stream(Generate(req("agg"))))
        result = await prefill.prefill(req("r1", PROMPT, GREEDY))
        assert result.handoff is not None and result.first.finish_reason is None
        assert all(h.address.startswith("tcp://127.0.0.1:") for h in result.handoff.ranks)
        assert prefill.engine.kv.ledger.num_held == 1  # held under the lease
        rest = await collect(decode_stream(decode, "r1", result.first.token_ids[0],
                                           result.handoff))
        assert await until_all_free(prefill, decode, both)
        assert prefill.engine.kv.ledger.num_held == 0 and all(a.num_leases == 0 for a in await prefill.agents())
        return want, result.first.token_ids + rest

    want, got = run(go())
    assert got == want and len(got) == GREEDY.max_tokens


def test_a_seeded_request_samples_the_same_tokens_on_every_path(trio, run):
    """A seed's draw at each output position depends on (seed, position) only: aggregated,
    handed off after the first token, and resumed elsewhere after 4 tokens give one text."""
    prefill, decode, both = trio
    seeded = dataclasses.replace(GREEDY, temperature=1.0, top_k=50, seed=2**63 - 7)

    async def go() -> None:
        want = await collect(both.stream(Generate(req("s-agg", PROMPT, seeded))))
        assert len(set(want)) > 2  # sampled, not a constant
        result = await prefill.prefill(req("s-dis", PROMPT, seeded))
        handed = result.first.token_ids + await collect(decode_stream(
            decode, "s-dis", result.first.token_ids[0], result.handoff, params=seeded))
        resumed = want[:4] + await collect(decode.stream(Resume.one(req("s-mig", PROMPT, seeded),
                                                                    want[:4])))
        assert handed == want and resumed == want
        other = dataclasses.replace(seeded, seed=12345)
        assert await collect(both.stream(Generate(req("s-other", PROMPT, other)))) != want
        assert await until_all_free(prefill, decode, both)

    run(go())


def test_a_salted_request_continued_on_a_decode_worker_caches_under_its_salt(trio, run):
    """The decode side keeps the request's cache_salt: its blocks are found only by requests
    of the same salt (an unsalted one was served them, and its usage showed it)."""
    _, decode, _ = trio
    prompt = [t + 300 for t in PROMPT]  # cached nowhere yet
    salted = WorkerRequest("salted", tuple(prompt), GREEDY, "tenant-a")

    async def first_cached(request_id: str, salt: str | None) -> int:
        stream = decode.stream(Generate(WorkerRequest(request_id, tuple(prompt), GREEDY, salt)))
        events = [e async for e in stream]
        return events[0].num_cached_tokens

    async def go() -> None:
        sent = await collect(trio[2].stream(Generate(req("ref", prompt))))
        await collect(decode.stream(Resume.one(salted, sent[:2])))
        assert await first_cached("unsalted", None) == 0
        assert await first_cached("other-salt", "tenant-b") == 0
        assert await first_cached("same-salt", "tenant-a") > 0

    run(go())


def test_a_full_waiting_queue_refuses_with_a_typed_overload(trio, run):
    prefill, _, both = trio

    async def go() -> None:
        both.max_waiting_requests = prefill.max_waiting_requests = 2
        try:
            both.submit("t", [Generate(req(f"q{i}")) for i in range(4)])  # none applied yet
            failures, finished = [], set()
            while len(failures) + len(finished) < 4:
                out = await both.next_outputs("t", 5.0)
                failures += out.failures
                finished |= {e.request_id for e in out.events if e.finish_reason is not None}
            assert finished == {"q0", "q1"}
            assert [(f.request_id, f.kind) for f in failures] == [
                ("q2", FailureKind.OVERLOADED), ("q3", FailureKind.OVERLOADED)]
            assert "max_waiting_requests" in failures[0].message
            calls = [asyncio.ensure_future(prefill.prefill(req(f"p{i}"))) for i in range(3)]
            await asyncio.gather(*calls, return_exceptions=True)
            assert isinstance(calls[2].exception(), EngineOverloaded)
            for call in calls[:2]:
                prefill.abort(call.result().first.request_id)
            assert await until_all_free(prefill, both)
        finally:
            both.max_waiting_requests = prefill.max_waiting_requests = 2048

    run(go())


def test_request_over_at_its_first_token_offers_nothing(trio, run):
    prefill = trio[0]

    async def go() -> None:
        one = dataclasses.replace(GREEDY, max_tokens=1)
        result = await prefill.prefill(req("r2", PROMPT, one))
        assert result.handoff is None and result.first.finish_reason is not None
        assert await until_all_free(prefill)

    run(go())


def test_cancelled_lease_makes_the_pull_fail_and_local_prefill_continues(trio, run):
    prefill, decode, both = trio

    async def go() -> None:
        want = await collect(both.stream(Generate(req("agg3"))))
        result = await prefill.prefill(req("r3", PROMPT, GREEDY))
        prefill.abort("r3")  # the lease ends: its blocks are freed, the pull finds nothing
        first = result.first.token_ids[0]
        with pytest.raises(KVPullFailed, match="LeaseExpired"):
            await collect(decode_stream(decode, "r3", first, result.handoff))
        assert await until_all_free(prefill, decode)
        rest = await collect(decode_stream(decode, "r3", first, None))
        assert [first, *rest] == want
        assert await until_all_free(prefill, decode)

    run(go())


def test_expired_lease_frees_the_held_blocks(tiny_model, run):
    async def go() -> None:
        prefill = make_worker(tiny_model, "p-short", "prefill", lease_s=0.2)
        try:
            await prefill.prefill(req("r4", PROMPT, GREEDY))
            assert prefill.stats().num_free_blocks < NUM_BLOCKS
            assert await until_all_free(prefill, timeout_s=3.0)
        finally:
            await prefill.shutdown()

    run(go())


def test_cancelled_prefill_and_cancelled_pull_leave_nothing_behind(trio, run):
    prefill, decode, _ = trio
    long_params = dataclasses.replace(GREEDY, max_tokens=50)

    async def go() -> None:
        task = asyncio.ensure_future(prefill.prefill(req("r5", PROMPT * 8, long_params)))
        await asyncio.sleep(0)  # queued, maybe computing
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        result = await prefill.prefill(req("r6", PROMPT, long_params))
        stream = decode_stream(decode, "r6", result.first.token_ids[0], result.handoff,
                               params=long_params)
        await stream.__anext__()  # the KV landed and decoding began
        await stream.aclose()  # the client went away
        prefill.abort("r6")
        assert await until_all_free(prefill, decode)
        assert prefill.engine.kv.ledger.num_held == 0

    run(go())


def test_an_abort_ends_a_prefill_call_under_way_and_frees_its_blocks(trio, run):
    """The router's cancel cannot cross a process boundary: it sends an Abort, which must end
    the worker's prefill call (it waited forever) and free what it held."""
    prefill, _, _ = trio
    long_params = dataclasses.replace(GREEDY, max_tokens=50)

    async def go() -> None:
        for delay_s in (0.0, 0.005, 0.02):  # at its start, mid-prefill, maybe done
            rid = f"ab{delay_s}"
            prompt = [t + int(delay_s * 1000) for t in PROMPT * 8]  # no prefix-cache hit
            task = asyncio.ensure_future(prefill.prefill(req(rid, prompt, long_params)))
            await asyncio.sleep(0)  # started: a Ray actor starts calls in submission order
            await asyncio.sleep(delay_s)
            prefill.submit("router-1", [Abort(rid)])
            done, _ = await asyncio.wait([task], timeout=5.0)
            assert done, f"the prefill call of {rid} did not end after its abort"
            if delay_s == 0.0:
                assert task.cancelled()
            assert rid not in prefill._prefills
        assert await until_all_free(prefill)
        assert prefill.engine.kv.ledger.num_held == 0

    run(go())


def test_held_blocks_are_kept_on_finish_and_freed_on_abort_without_a_model():
    sched = create_scheduler(num_blocks=8, block_size=4)
    kv: KVCacheManager = sched.kv
    held = create_request("held", [1, 2, 3, 4, 5, 6], max_tokens=1)
    held.hold_kv = True
    aborted = create_request("aborted", [1, 2, 3, 9, 9], max_tokens=1)
    aborted.hold_kv = True
    sched.add(held)
    fake_step(sched)
    assert held.is_finished and kv.ledger.held_block_ids("held") and kv.pool.num_free_blocks == 6
    sched.add(aborted)
    sched.finish("aborted", FinishReason.ABORT)
    assert kv.ledger.held_block_ids("aborted") == [] and kv.pool.num_free_blocks == 6
    assert kv.ledger.free_held("held") and not kv.ledger.free_held("held")
    assert kv.pool.num_free_blocks == 8
