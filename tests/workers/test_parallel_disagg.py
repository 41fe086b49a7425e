"""A TP=2 prefill engine hands its KV to a TP=1 decode engine (and the reverse) through the
transfer layer, one agent per TP rank, and the greedy output equals the aggregated TP=1 run
(Llama; Qwen3-MoE with its experts split over the TP=2 group; DeepSeek-V3, whose latent cache
every rank holds whole). A LoRA request crosses it too: a PEFT adapter's request and a base
model's, handed off together between TP sizes, give PEFT's and transformers' greedy tokens.

The TP=2 engine's cache lives in its rank processes, and each rank's own transfer agent serves
and pulls its shard (`Engine.kv_agent_hosts()`), driven from the engine's process through
`WorkerTransfer` exactly as on GPUs: the driver never sees the cache.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.workers.hf_oracle import peft_family, save_hf_model
from workers import LLM, SamplingParams
from workers.contract.messages import DecodeFromHandoff
from workers.contract.protocol import WorkerRequest
from workers.engine.request import Request
from workers.serving.connector import Connector
from workers.serving.transfer import WorkerTransfer

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


def transfer(engine, name: str) -> WorkerTransfer:
    """The worker's side of the handoff over TCP; a lease's end frees the held request."""
    return WorkerTransfer(name, engine, Connector(engine).free_held, transport="tcp",
                          host="127.0.0.1",
                          lease_s=30.0, pull_timeout_s=30.0)


async def handoff(prefill, decode, request_id: str, moved: list | None = None) -> list[int]:
    """The request prefilled on `prefill`, its KV pulled by `decode`'s ranks, decoded there.
    `moved` collects the handoff records offered (their bytes)."""
    req = WorkerRequest(request_id, tuple(PROMPT), PARAMS)
    return (await handoff_all(prefill, decode, [req], moved))[request_id]


async def handoff_all(prefill, decode, reqs: list[WorkerRequest],
                      moved: list | None = None) -> dict[str, list[int]]:
    """`reqs` prefilled together on `prefill`, each one's KV pulled by `decode`'s ranks, then
    decoded there in one batch: each request's tokens by id."""
    source, sink = transfer(prefill, "p"), transfer(decode, "d")
    await source.agents()
    await sink.agents()
    prefilling, decoding = Connector(prefill), Connector(decode)
    for req in reqs:
        prefilling.prefill(req)
    tokens: dict[str, list[int]] = {req.request_id: [] for req in reqs}
    while prefill.has_unfinished():
        for event in prefill.step():
            tokens[event.request_id] += event.token_ids
    decode_tp = len(await sink.agents())
    for req in reqs:
        rid = req.request_id
        offered = source.offer(rid, prefilling.held_block_ids(rid), decode_tp)
        if moved is not None:
            moved += offered.ranks
        dst_blocks = decoding.decode_from_handoff(req, tokens[rid][0])
        await (await sink.puller(rid, offered))(dst_blocks)
        decoding.kv_landed(rid)
    for _ in range(200):  # every rank's lease ended (each pulled by its readers): freed
        if prefill.kv.ledger.num_held == 0:
            break
        await asyncio.sleep(0.01)
    assert prefill.kv.ledger.num_held == 0 and source.num_leases == 0
    while decode.has_unfinished():
        for event in decode.step():
            tokens[event.request_id] += event.token_ids
    await source.close()
    await sink.close()
    return tokens


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_prefill_and_decode_pools_of_different_tp_sizes_agree(engines, prefill_tp, decode_tp):
    by_tp, want = engines
    tokens = asyncio.run(handoff(by_tp[prefill_tp], by_tp[decode_tp], f"r{prefill_tp}"))
    assert tokens == want


# A PEFT adapter across the TP handoff: the same prompt under the adapter and the base model in
# one batch, 32 greedy tokens against transformers + PEFT
LORA_PARAMS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_engines(tmp_path_factory):
    """A single-rank and a TP=2 engine with LoRA on a Llama checkpoint, the PEFT adapter `full`
    (attention + MLP, rsLoRA) given to the single rank at start and loaded on the TP=2 group at
    run time (every rank reads its shard), and the PEFT references of PROMPT."""
    pytest.importorskip("peft", reason="PEFT is the oracle (the test extras install it)")
    path, folders, refs = peft_family("llama", tmp_path_factory.mktemp("lora"), [PROMPT], 32)
    options = dict(block_size=4, num_blocks=64, enable_lora=True, max_lora_rank=8, max_loras=2)
    single = LLM(path, lora_modules=(f"full={folders['full']}",), **options)
    tp2 = LLM(path, tensor_parallel_size=2, **options)
    try:
        tp2.engine.adapters.load("full", str(folders["full"]))
        yield {1: single.engine, 2: tp2.engine}, refs
    finally:
        tp2.engine.close()


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_an_adapter_request_hands_off_between_tp_sizes_beside_the_base_model(
        lora_engines, prefill_tp, decode_tp):
    """A request under `full` and one for the base model on the same prompt, prefilled in one
    step on one TP size and decoded in one batch on the other, each rank pulling its heads: each
    gives PEFT's (or transformers') 32 greedy tokens, and every block and lease is back."""
    by_tp, refs = lora_engines
    key = f"{prefill_tp}{decode_tp}"
    reqs = [WorkerRequest(f"lora{key}", tuple(PROMPT), LORA_PARAMS, lora_name="full"),
            WorkerRequest(f"base{key}", tuple(PROMPT), LORA_PARAMS)]
    tokens = asyncio.run(handoff_all(by_tp[prefill_tp], by_tp[decode_tp], reqs))
    want = refs["full", tuple(PROMPT)].tokens
    assert want != refs[None, tuple(PROMPT)].tokens  # the adapter changes the output
    assert tokens == {f"lora{key}": want, f"base{key}": refs[None, tuple(PROMPT)].tokens}
    for engine in by_tp.values():
        assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


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


@pytest.fixture(scope="module")
def mla_engines(tmp_path_factory):
    """DeepSeek-V3 (latent attention, grouped routing): a TP=2, EP=2 engine and one rank."""
    yield from engines_of(tmp_path_factory, "deepseek_v3", expert_parallel_size=2)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_latent_attention_hands_off_the_latent_between_tp_sizes(mla_engines, prefill_tp,
                                                                decode_tp):
    by_tp, want = mla_engines
    moved: list = []
    tokens = asyncio.run(handoff(by_tp[prefill_tp], by_tp[decode_tp], f"d{prefill_tp}", moved))
    assert tokens == want
    # one latent of kv_lora_rank + rope dims per token and layer crossed, from one rank, and
    # every lease ended (the blocks went back): nothing per head, nothing twice
    assert len(moved) == 1 and moved[0].layout.kind == "latent"
    config = by_tp[1].model_config
    num_blocks = -(-len(PROMPT) // 4)
    latent_bytes = config.num_hidden_layers * config.mla.latent_dim * 4  # fp32, per token
    assert moved[0].num_bytes == num_blocks * 4 * latent_bytes
    mla = config.mla
    per_head_kv = (config.num_hidden_layers * config.num_attention_heads * 4
                   * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim))
    assert per_head_kv / latent_bytes == 3.5  # 4 heads x (32 + 24) against 48 + 16 per token
    for engine in (by_tp[prefill_tp], by_tp[decode_tp]):
        assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def layouts(engine) -> list:
    async def read():
        agents = await (wt := transfer(engine, "l")).agents()
        await wt.close()
        return [agent.layout for agent in agents]

    return asyncio.run(read())


def test_latent_layouts_are_whole_on_every_rank(mla_engines):
    by_tp, _ = mla_engines
    layouts_ = layouts(by_tp[2])
    assert [(lay.kind, lay.head_start, lay.num_kv_heads, lay.total_kv_heads) for lay in layouts_
            ] == [("latent", 0, 1, 1)] * 2


def test_layouts_name_each_ranks_heads(engines):
    by_tp, _ = engines
    assert [(lay.tp_rank, lay.head_start, lay.num_kv_heads) for lay in layouts(by_tp[2])
            ] == [(0, 0, 1), (1, 1, 1)]
    with pytest.raises(RuntimeError, match="lives in its ranks"):  # the driver holds none
        _ = by_tp[2].kv_caches


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
@pytest.mark.parametrize("arch, reference", [("llama", "engines"),
                                             ("deepseek_v3", "mla_engines")])
def test_workers_of_different_tp_sizes_hand_off_over_tcp(request, tmp_path, prefill_tp,
                                                         decode_tp, arch, reference):
    """The same through `Worker` (what the router calls): one agent and lease per prefill
    rank (a latent: one lease, on rank 0), the decode ranks pulling their heads over real
    sockets, leases all released."""
    from workers.engine.config import EngineConfig
    from workers.serving.worker import Worker

    _, want = request.getfixturevalue(reference)
    path = str(tmp_path)
    save_hf_model(arch, path)
    parallel = {"expert_parallel_size": 2} if arch == "deepseek_v3" else {}

    def worker(name, role, tp):
        return Worker.from_config(name, EngineConfig(
            model=path, block_size=4, num_blocks=64, tensor_parallel_size=tp,
            **(parallel if tp == 2 else {})), role)

    async def run():
        prefill, decode = worker("p", "prefill", prefill_tp), worker("d", "decode", decode_tp)
        try:
            req = WorkerRequest("r", tuple(PROMPT), PARAMS)
            result = await prefill.prefill(req, decode_tp_size=decode_tp)
            assert len(result.handoff.ranks) == (1 if arch == "deepseek_v3" else prefill_tp)
            tokens = list(result.first.token_ids)
            async for event in decode.stream(DecodeFromHandoff(req, tokens[0], result.handoff)):
                tokens += event.token_ids
            for _ in range(100):  # the leases end once every reader pulled
                if prefill.engine.kv.ledger.num_held == 0:
                    break
                await asyncio.sleep(0.05)
            assert prefill.engine.kv.ledger.num_held == 0
            return tokens
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    assert asyncio.run(run()) == want


def test_a_windowed_model_hands_off_every_block_and_decodes_in_its_window(tmp_path):
    """Mistral (a 12-token window on every layer): the prefill side keeps and sends all the
    prompt's blocks; the decode side caches what it pulled, then returns the blocks that fall
    out of the window as it decodes, and its output is the aggregated run's."""
    path = str(tmp_path)
    save_hf_model("mistral", path)
    want = LLM(path, block_size=4, num_blocks=64).generate([PROMPT], PARAMS)[0].outputs[0]
    prefill, decode = (LLM(path, block_size=4, num_blocks=64).engine for _ in range(2))
    moved: list = []
    assert asyncio.run(handoff(prefill, decode, "w", moved)) == want.token_ids
    assert moved[0].num_blocks == -(-len(PROMPT) // 4)  # every block of the prompt
    for engine in (prefill, decode):
        assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    # the decode side cached the pulled prompt blocks before returning them: all 8 full
    # blocks of the prompt are hits there
    probe = Request("probe", list(PROMPT) + [1], PARAMS, frozenset())
    assert len(decode.kv.get_computed_blocks(probe)) == len(PROMPT) // 4
