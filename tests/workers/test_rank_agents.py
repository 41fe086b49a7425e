"""Each rank of a tensor-parallel worker group serves and pulls its own shard of the KV cache
through its own transfer agent (the GPU design, run on CPU ranks over gloo): a TP=2 prefill
group hands off to a TP=4 decode group (heads resharded, 6 rank processes) with the aggregated
single-rank output (also with an 8-bit KV cache and with AWQ weights), and a rank killed
during a pull fails that pull with a typed error while both sides free what they held.
"""

from __future__ import annotations

import asyncio

import pytest

from kvtransfer import faults
from tests.workers.hf_oracle import save_hf_model
from workers import LLM, SamplingParams
from workers.engine.config import EngineConfig
from workers.contract.messages import DecodeFromHandoff
from workers.contract.protocol import KVPullFailed, WorkerRequest
from workers.serving.worker import Worker

PROMPT = list(range(5, 40))
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[str, list[int]]:
    """A Llama with 4 KV heads (one per rank at TP=4) and its single-rank greedy output."""
    path = str(tmp_path_factory.mktemp("llama-kv4"))
    save_hf_model("llama", path, num_key_value_heads=4)
    want = LLM(path, block_size=4, num_blocks=64).generate([PROMPT], PARAMS)[0].outputs[0]
    return path, list(want.token_ids)


def worker(path: str, name: str, role: str, tp: int) -> Worker:
    return Worker.from_config(name, EngineConfig(model=path, block_size=4, num_blocks=64,
                                                 tensor_parallel_size=tp), role)


async def until(condition, timeout_s: float = 10.0) -> bool:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return True
        await asyncio.sleep(0.02)
    return condition()


def all_free(w: Worker) -> bool:
    pool = w.engine.kv.pool
    return pool.num_free_blocks == pool.num_blocks and w.engine.kv.ledger.num_held == 0


def test_a_tp2_prefill_group_hands_off_to_a_tp4_decode_group(model):
    path, want = model

    async def run():
        prefill, decode = worker(path, "p", "prefill", 2), worker(path, "d", "decode", 4)
        try:
            req = WorkerRequest("r", tuple(PROMPT), PARAMS)
            result = await prefill.prefill(req, decode_tp_size=4)
            # one lease per prefill rank, each read by the two decode ranks of its heads
            assert [h.layout.tp_rank for h in result.handoff.ranks] == [0, 1]
            tokens = list(result.first.token_ids)
            async for event in decode.stream(DecodeFromHandoff(req, tokens[0], result.handoff)):
                tokens += event.token_ids
            assert await until(lambda: all_free(prefill))
            assert prefill.resources()["leases"] == 0
            return tokens
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    assert asyncio.run(run()) == want


def test_a_rank_killed_during_a_pull_fails_it_typed_and_both_sides_free_their_blocks(
        model, monkeypatch):
    """The source (one rank, in this process) stalls mid-transfer; decode rank 1 is killed
    meanwhile. The decode worker's pull fails with `KVPullFailed` (PeerGone) once its other
    rank's pull ends, its blocks are free, and the source's lease ends when both readers are
    done (one finished, one lost), freeing the held request."""
    path, _ = model
    monkeypatch.setattr(faults, "ENABLED", True)

    async def run():
        prefill, decode = worker(path, "p", "prefill", 1), worker(path, "d", "decode", 2)
        try:
            await prefill.agents()  # the self-check's read passes before the fault is armed
            await decode.agents()
            req = WorkerRequest("k", tuple(PROMPT), PARAMS)
            result = await prefill.prefill(req, decode_tp_size=2)
            faults.arm("kv.serve", "stall", seconds=3.0, times=2)  # both ranks' reads
            stream = decode.stream(DecodeFromHandoff(req, result.first.token_ids[0],
                                                     result.handoff))
            consume = asyncio.ensure_future(anext(stream))
            assert await until(lambda: decode.resources()["pulls"] > 0)
            await asyncio.sleep(0.5)  # the ranks' reads are under way, stalled at layer 0
            rank = decode.engine.runner.executor.group.handles[1]
            rank.process.kill()  # type: ignore[attr-defined]
            with pytest.raises(KVPullFailed, match="PeerGone"):
                await asyncio.wait_for(consume, 30)
            assert await until(lambda: all_free(prefill))
            assert await until(lambda: decode.engine.kv.pool.num_free_blocks
                               == decode.engine.kv.pool.num_blocks)
            assert prefill.resources()["leases"] == 0
        finally:
            faults.disarm()
            await prefill.shutdown()
            await decode.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize("case", ["int8-kv", "awq-weights"])
def test_a_quantized_tp2_group_hands_off_as_one_rank_serves(case, model, tmp_path):
    """An 8-bit KV cache (each rank's blocks with its heads' scales) or AWQ weights (each rank
    its shard of the packed weights and scales): TP=2 prefill ranks hand off to one decode
    rank, and the tokens are the aggregated single rank's with the same quantization."""
    path, _ = model
    options: dict = {"kv_cache_dtype": "int8"}
    if case == "awq-weights":
        from workers.quant.writer import quantize_checkpoint

        path = str(quantize_checkpoint(path, tmp_path / "awq", "awq", group_size=32))
        options = {"dtype": "bfloat16"}
    want = LLM(path, block_size=4, num_blocks=64, **options).generate([PROMPT], PARAMS)
    want = list(want[0].outputs[0].token_ids)

    def quantized(name: str, role: str, tp: int) -> Worker:
        return Worker.from_config(name, EngineConfig(
            model=path, block_size=4, num_blocks=64, tensor_parallel_size=tp, **options), role)

    async def run() -> list[int]:
        prefill, decode = quantized("p", "prefill", 2), quantized("d", "decode", 1)
        try:
            req = WorkerRequest("q", tuple(PROMPT), PARAMS)
            result = await prefill.prefill(req, decode_tp_size=1)
            assert [h.layout.dtype for h in result.handoff.ranks] == (
                ["int8"] * 2 if case == "int8-kv" else ["bfloat16"] * 2)
            tokens = list(result.first.token_ids)
            async for event in decode.stream(DecodeFromHandoff(req, tokens[0], result.handoff)):
                tokens += event.token_ids
            assert await until(lambda: all_free(prefill))
            return tokens
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    assert asyncio.run(run()) == want
