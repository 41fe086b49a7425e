"""Routing by LoRA adapter residency: a worker that would have to load a request's adapter into
a device slot pays `RouterConfig.lora_load_cost_blocks` in the prefix-aware score; the decode
pick prefers a decode worker holding it; the residency comes with the workers' load reports
and follows a request routed under an adapter until the next report."""

from __future__ import annotations

import numpy as np

from router.decode_policy import get_decode_policy
from router.loads import LoadTable
from router.policy import WorkerLoad, get_policy
from router.prefix_index import PrefixIndex
from tests.router.fakes import FakeWorker, orchestrator
from tests.router.test_orchestrator import request, run
from workers.contract.protocol import EngineStats, WorkerRequest, WorkerRole

PROMPT = list(range(1, 5))  # four full blocks
PREFILL, DECODE, BOTH = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.BOTH


def loads(depths: dict[str, int], held: dict[str, tuple[str, ...]]) -> list[WorkerLoad]:
    return [WorkerLoad(w, 0, d, 0.0, lora_adapters=held.get(w, ())) for w, d in depths.items()]


def choose(policy, depths: dict[str, int], held: dict[str, tuple[str, ...]],
           lora: str | None) -> str:
    return policy.choose(PROMPT, loads(depths, held), PrefixIndex(), lora).worker_id


def test_equal_loads_send_an_adapters_requests_where_it_is_held():
    policy = get_policy("prefix_aware")
    idle = {"w0": 0, "w1": 0, "w2": 0, "w3": 0}
    held = {"w0": ("a",), "w2": ("b", "c")}
    assert choose(policy, idle, held, "c") == "w2"
    assert choose(policy, idle, held, "a") == "w0"
    assert choose(policy, idle, held, None) == "w0"  # the base model: no adapter to load
    assert choose(policy, idle, held, "z") == "w0"  # held nowhere: every worker pays alike
    # a little busier does not outweigh a load (16 blocks of a 4-block prompt)
    assert choose(policy, {**idle, "w2": 3}, held, "c") == "w2"


def test_a_far_lighter_worker_wins_when_the_load_costs_less_than_its_queue():
    long = list(range(1, 33))  # 32 blocks: the default load (16 blocks) is half its recompute
    held = {"w1": ("a",)}

    def pick(policy, holder_depth: int) -> str:
        depths = {"w0": 0, "w1": holder_depth, "w2": 0, "w3": 0}
        return policy.choose(long, loads(depths, held), PrefixIndex(), "a").worker_id

    default = get_policy("prefix_aware")
    assert pick(default, 4) == "w1"  # 4 ahead: 0.5 * 4 / 8 = 0.25 < 0.5
    assert pick(default, 12) == "w0"  # 12 ahead: 0.75 > 0.5
    dear = get_policy("prefix_aware", lora_load_blocks=64.0)  # capped at the prompt: 1.0
    assert pick(dear, 12) == "w1"
    assert pick(dear, 200) == "w0"  # however dear, a far lighter worker wins (2.0 > 1.0)
    # priced at 0, adapters do not steer: one request ahead loses
    assert choose(get_policy("prefix_aware", lora_load_blocks=0.0),
                  {"w0": 1, "w1": 0}, {"w0": ("a",)}, "a") == "w1"


def test_least_loaded_and_the_decode_pick_prefer_a_holder_among_the_least_loaded():
    held = {"d1": ("a",)}
    least = get_policy("least_loaded")
    assert choose(least, {"d0": 0, "d1": 0}, held, "a") == "d1"
    assert choose(least, {"d0": 0, "d1": 1}, held, "a") == "d0"  # only a tie-break
    decode = get_decode_policy("least_loaded")
    assert decode.pick(PROMPT, loads({"d0": 0, "d1": 0}, held), PrefixIndex(),
                       "a").worker_id == "d1"
    assert choose(get_policy("round_robin"), {"d0": 0, "d1": 0}, held, "a") == "d0"  # blind


def test_residency_is_replaced_by_each_report_and_grows_with_the_table():
    table = LoadTable.empty()
    for i in range(40):  # past the columns' first capacity
        table.add(f"w{i}")
    table.rows = np.arange(40)
    table.report("w33", 0, 0, 0.0, 0, True, lora_adapters=("a", "b"))
    table.note_routed("w7", "a")
    assert np.flatnonzero(~table.lacks(table.rows, "a")).tolist() == [7, 33]
    assert table.load(33).lora_adapters == ("a", "b") and table.waiting[7] == 1
    table.report("w7", 0, 0, 0.0, 0, True)  # the routed request's worker says what it holds
    table.report("w33", 0, 0, 0.0, 0, True, lora_adapters=("b",))
    assert table.lacks(table.rows, "a").all() and not table.lacks(table.rows, None).any()
    table.remove("w33")
    assert table.lacks(table.rows, "b").all()


def report(worker: FakeWorker, *adapters: str) -> None:
    """The worker's next load report: idle, `adapters` in its slots."""
    assert worker.listener is not None
    worker.listener.on_outputs(worker.worker_id, (),
                               EngineStats(0, 0, 0.0, 256, 0, 256, lora_adapters=adapters))


def under(lora: str) -> WorkerRequest:
    req = request()
    return WorkerRequest(req.request_id, req.prompt_token_ids, req.params, lora_name=lora)


def test_the_orchestrator_routes_by_the_adapters_the_workers_report():
    async def go():
        workers = [FakeWorker(f"w{i}") for i in range(3)]
        o = await orchestrator(*workers)
        report(workers[2], "a")
        assert (await o.generate(under("a"))).worker_id == "w2"
        # a burst for an adapter held nowhere follows its first request until the reports
        firsts = [(await o.generate(under("b"))).worker_id for _ in range(3)]
        assert firsts == ["w0", "w0", "w0"]
        report(workers[0])  # w0 did not load it after all: b is held nowhere again
        report(workers[1], "b")
        assert (await o.generate(under("b"))).worker_id == "w1"
        # RouterConfig.lora_load_cost_blocks reaches the policy: priced at 0, w0 (first id)
        o = await orchestrator(*[FakeWorker(f"v{i}") for i in range(2)], lora_load_cost_blocks=0)
        report(o.workers.clients["v1"], "a")  # type: ignore[arg-type]
        assert (await o.generate(under("a"))).worker_id == "v0"

    run(go())


def test_a_disaggregated_request_goes_to_the_prefill_and_decode_workers_holding_its_adapter():
    async def go():
        p0, p1 = FakeWorker("p0", PREFILL), FakeWorker("p1", PREFILL)
        d0, d1 = FakeWorker("d0", DECODE), FakeWorker("d1", DECODE)
        o = await orchestrator(p0, p1, d0, d1)
        report(p1, "a")
        report(d1, "x", "a")
        gen = await o.generate(under("a"))
        assert (gen.worker_id, gen.decode_worker_id) == ("p1", "d1")
        gen = await o.generate(request())  # the base model: the lighter workers
        assert (gen.worker_id, gen.decode_worker_id) == ("p0", "d0")

    run(go())


def test_requests_and_tokens_are_counted_per_adapter():
    async def go():
        o = await orchestrator(FakeWorker("w0"))
        for req in (under("a"), under("a"), under("b"), request()):
            gen = await o.generate(req)
            async for _ in gen.events():
                pass
        m = o.generations.metrics
        assert m.lora_requests.labels("a", "success")._value.get() == 2
        assert m.lora_requests.labels("b", "success")._value.get() == 1
        assert m.lora_generation_tokens.labels("a")._value.get() == 12  # 6 tokens each
        assert b'adapter="a"' in m.exposition() and b'adapter="None"' not in m.exposition()

    run(go())
