"""A TP=2 prefill engine hands its KV to a TP=1 decode engine (and the reverse) through the
transfer layer, one agent per TP rank, and the greedy output equals the aggregated TP=1 run
(Llama, and Qwen3-MoE with its experts split over the TP=2 group).

The TP=2 engine's cache lives in its rank processes; the driver holds shared-memory views of
each rank's shard (`Engine.kv_caches_by_rank()`, described by `Engine.kv_layouts()`), so each
rank gets its own agent, exactly as rank processes on GPUs would.
"""

from __future__ import annotations

import asyncio

import pytest

from kvtransfer import LocalHub, TransferAgent, TransportConfig
from tests.workers.hf_oracle import save_hf_model
from workers import LLM, SamplingParams
from workers.messages import DecodeFromHandoff
from workers.protocol import WorkerRequest

PROMPT = list(range(5, 40))
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def engines_of(tmp_path_factory, arch: str, **parallel: int):
    """A single-rank engine and a TP=2 one (with `parallel`'s other sizes) of a transformers
    checkpoint of `arch`, and the single rank's greedy output; closes the TP=2 group after."""
    path = str(tmp_path_factory.mktemp(arch))
    save_hf_model(arch, path)
    single = LLM(path, block_size=4, num_blocks=64)
    want = single.generate([PROMPT], PARAMS)[0].outputs[0].token_ids
    tp2 = LLM(path, block_size=4, num_blocks=64, tensor_parallel_size=2, **parallel)
    # a fresh single-rank engine: nothing of the prompt cached from computing `want`
    yield {1: LLM(path, block_size=4, num_blocks=64).engine, 2: tp2.engine}, want
    tp2.engine.close()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    yield from engines_of(tmp_path_factory, "llama")


def agents(engine, hub):
    return [TransferAgent(layout, caches, TransportConfig("local"), hub=hub)
            for layout, caches in zip(engine.kv_layouts(), engine.kv_caches_by_rank())]


async def handoff(prefill, decode, request_id: str) -> list[int]:
    hub = LocalHub()
    sources, sinks = agents(prefill, hub), agents(decode, hub)
    for agent in sources + sinks:
        await agent.start()
    req = WorkerRequest(request_id, tuple(PROMPT), PARAMS)
    prefill.prefill(req)
    events = []
    while prefill.has_unfinished():
        events += prefill.step()
    first = events[-1].token_ids[0]
    src_blocks = prefill.held_block_ids(request_id)
    readers = max(1, len(sinks) // len(sources))
    handoffs = [a.offer(request_id, src_blocks, readers=readers) for a in sources]
    dst_blocks = decode.decode_from_handoff(req, first)
    await asyncio.gather(*(a.pull(handoffs, dst_blocks) for a in sinks))
    prefill.free_held(request_id)
    decode.kv_landed(request_id)
    tokens = [first]
    while decode.has_unfinished():
        for event in decode.step():
            tokens += event.token_ids
    for agent in sources + sinks:
        await agent.close()
    return tokens


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_prefill_and_decode_pools_of_different_tp_sizes_agree(engines, prefill_tp, decode_tp):
    by_tp, want = engines
    tokens = asyncio.run(handoff(by_tp[prefill_tp], by_tp[decode_tp], f"r{prefill_tp}"))
    assert tokens == want


@pytest.fixture(scope="module")
def moe_engines(tmp_path_factory):
    """Qwen3-MoE (q/k norm, experts): a TP=2, EP=2 engine and a single-rank one."""
    yield from engines_of(tmp_path_factory, "qwen3_moe", expert_parallel_size=2)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_a_moe_model_hands_off_between_an_expert_parallel_group_and_one_rank(
        moe_engines, prefill_tp, decode_tp):
    by_tp, want = moe_engines
    tokens = asyncio.run(handoff(by_tp[prefill_tp], by_tp[decode_tp], f"m{prefill_tp}"))
    assert tokens == want


def test_layouts_name_each_ranks_heads(engines):
    by_tp, _ = engines
    layouts = by_tp[2].kv_layouts()
    assert [(lay.tp_rank, lay.head_start, lay.num_kv_heads) for lay in layouts] == [(0, 0, 1),
                                                                                   (1, 1, 1)]
    with pytest.raises(RuntimeError, match="split over 2 tensor-parallel ranks"):
        _ = by_tp[2].kv_caches


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_workers_of_different_tp_sizes_hand_off_over_tcp(engines, tmp_path, prefill_tp,
                                                         decode_tp):
    """The same through `Worker` (what the router calls): one agent and lease per prefill
    rank, the decode ranks pulling their heads over real sockets, leases all released."""
    from workers.config import EngineConfig
    from workers.worker import Worker

    _, want = engines
    path = str(tmp_path)
    save_hf_model("llama", path)

    def worker(name, role, tp):
        return Worker.from_config(name, EngineConfig(model=path, block_size=4, num_blocks=64,
                                                     tensor_parallel_size=tp), role)

    async def run():
        prefill, decode = worker("p", "prefill", prefill_tp), worker("d", "decode", decode_tp)
        try:
            req = WorkerRequest("r", tuple(PROMPT), PARAMS)
            result = await prefill.prefill(req, kv_readers=max(1, decode_tp // prefill_tp))
            tokens = list(result.first.token_ids)
            async for event in decode.stream(DecodeFromHandoff(req, tokens[0], result.handoff)):
                tokens += event.token_ids
            for _ in range(100):  # the leases end once every reader pulled
                if prefill.engine.kv.num_held_requests == 0:
                    break
                await asyncio.sleep(0.05)
            assert prefill.engine.kv.num_held_requests == 0
            return tokens
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    assert asyncio.run(run()) == want
