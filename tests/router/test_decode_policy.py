"""The named decisions beside the routing policy: "which decode worker" (`router.decode_policy`)
and "hand off or run here" (`router.split_policy`), alone and through the orchestrator on
fake workers. The burst test is the herd a Ray app showed: 16 requests choosing their decode
worker while every prefill is still running must spread over the decode pool."""

from __future__ import annotations

import asyncio

import pytest

from router.decode_policy import get_decode_policy
from router.loads import WorkerLoad
from router.prefix_index import PrefixIndex
from router.split_policy import get_split_policy, registered_split_policies
from tests.router.fakes import FakeWorker, Script, expected_tokens, orchestrator
from tests.router.test_orchestrator import GONE, collect, request, run
from workers.contract.protocol import SamplingParams, WorkerRequest, WorkerRole

PREFILL, DECODE = WorkerRole.PREFILL, WorkerRole.DECODE


def idle(*ids: str) -> list[WorkerLoad]:
    return [WorkerLoad(wid, 0, 0, 0.0) for wid in ids]


def test_a_decode_pick_counts_against_its_worker_until_released():
    policy = get_decode_policy("least_loaded")
    picks = [policy.pick((), idle("d0", "d1"), PrefixIndex()) for _ in range(4)]
    assert [p.worker_id for p in picks] == ["d0", "d1", "d0", "d1"]
    assert policy.pending("d0") == policy.pending("d1") == 2
    for p in picks[:3]:
        p.release()
        p.release()  # idempotent
    assert (policy.pending("d0"), policy.pending("d1")) == (0, 1)
    assert policy.pick((), idle("d0", "d1"), PrefixIndex()).worker_id == "d0"


def test_an_unknown_decode_or_split_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown routing policy 'nearest'"):
        get_decode_policy("nearest")
    with pytest.raises(ValueError, match="unknown disagg policy 'sometimes'; registered: "
                                         "always, never, uncached_threshold"):
        get_split_policy("sometimes")
    assert registered_split_policies() == ["always", "never", "uncached_threshold"]


def test_split_policies_hand_off_by_uncached_prompt_always_or_never():
    req = WorkerRequest("r", tuple(range(40)), SamplingParams(max_tokens=4))
    threshold = get_split_policy("uncached_threshold", threshold_tokens=32)
    assert threshold.run_here(req, 0) is None  # 40 uncached tokens: hand off
    assert threshold.run_here(req, 16) == "short_prompt"  # 24 uncached: run here
    assert get_split_policy("always", threshold_tokens=10**6).run_here(req, 0) is None
    assert get_split_policy("never").run_here(req, 0) == "policy"


def test_a_burst_of_16_disaggregated_requests_spreads_over_both_decode_workers():
    async def go():
        p = FakeWorker("p0", PREFILL, Script(prefill_s=0.05))
        d0, d1 = FakeWorker("d0", DECODE), FakeWorker("d1", DECODE)
        o = await orchestrator(p, d0, d1)
        reqs = [request() for _ in range(16)]
        gens = await asyncio.gather(*(o.generate(r) for r in reqs))
        assert [await collect(g) for g in gens] == [expected_tokens(r) for r in reqs]
        per_worker = [len(d.calls.handoffs) for d in (d0, d1)]
        assert sum(per_worker) == 16 and all(6 <= n <= 10 for n in per_worker), per_worker
        assert o.counters.decodes_by_worker == {"d0": per_worker[0], "d1": per_worker[1]}
        assert o.decode.pending("d0") == o.decode.pending("d1") == 0  # all sent: released

    run(go())


def test_a_decode_pick_is_released_when_the_prefill_fails_or_the_request_runs_elsewhere():
    async def go():
        bad = FakeWorker("p0", PREFILL, Script(prefill_error=GONE))
        d0 = FakeWorker("d0", DECODE)
        o = await orchestrator(bad, d0, prefill_retries=0)
        gen = await o.generate(request())  # prefill failed: runs whole on d0
        assert gen.worker_id == "d0" and o.counters.aggregated == {"prefill_failed": 1}
        await collect(gen)
        assert o.decode.pending("d0") == 0
        refusing = FakeWorker("p1", PREFILL, Script(refuse=True))
        o = await orchestrator(refusing, FakeWorker("d1", DECODE))
        with pytest.raises(Exception, match="refuses"):
            await o.generate(request())
        assert o.decode.pending("d1") == 0

    run(go())


def test_the_configured_policies_choose_the_decode_worker_and_whether_to_hand_off():
    async def go():
        p, d0, d1 = FakeWorker("p0", PREFILL), FakeWorker("d0", DECODE), FakeWorker("d1", DECODE)
        o = await orchestrator(p, d0, d1, decode_policy="round_robin", disagg_policy="always",
                               disagg_threshold_tokens=10**6)
        gens = [await o.generate(request(num_tokens=4)) for _ in range(4)]
        assert [g.decode_worker_id for g in gens] == ["d0", "d1", "d0", "d1"]
        for g in gens:
            await collect(g)
        o = await orchestrator(p, d0, disagg_policy="never")
        gen = await o.generate(request())
        assert gen.worker_id == "d0" and o.counters.aggregated == {"policy": 1}
        await collect(gen)

    run(go())


def test_the_configs_policy_choices_are_the_registered_policies() -> None:
    from router.config import POLICIES, SPLIT_POLICIES
    from router.policy import registered_policies
    from router.split_policy import registered_split_policies

    assert sorted(POLICIES) == registered_policies()
    assert sorted(SPLIT_POLICIES) == registered_split_policies()
