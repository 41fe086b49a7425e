"""GPU worker groups hand KV off from every rank: a TP=2 NCCL prefill group's ranks serve their
heads from device memory through their own agents (TCP, staged through host memory), a TP=1
decode worker pulls them, and the greedy tokens equal one GPU's. Needs 2 CUDA devices; the same
code runs on CPU ranks in tests/workers/test_rank_agents.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from workers import LLM, SamplingParams
from workers.engine.config import EngineConfig
from workers.contract.messages import DecodeFromHandoff
from workers.contract.protocol import WorkerRequest
from workers.serving.worker import Worker

PROMPT = list(range(5, 60))
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
COMMON = {"device": "cuda", "dtype": "float32", "num_blocks": 64, "block_size": 16}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_a_gpu_tp_group_hands_off_from_every_rank(tiny_model, prefill_tp, decode_tp):
    one = LLM(tiny_model, **COMMON)
    want = list(one.generate([PROMPT], PARAMS)[0].outputs[0].token_ids)
    one.engine.close()

    def worker(name: str, role: str, tp: int) -> Worker:
        return Worker.from_config(name, EngineConfig(model=tiny_model, tensor_parallel_size=tp,
                                                     **COMMON), role)

    async def run() -> list[int]:
        prefill = worker("p", "prefill", prefill_tp)
        decode = worker("d", "decode", decode_tp)
        try:
            req = WorkerRequest("r", tuple(PROMPT), PARAMS)
            result = await prefill.prefill(req, decode_tp_size=decode_tp)
            assert len(result.handoff.ranks) == prefill_tp
            tokens = list(result.first.token_ids)
            async for event in decode.stream(DecodeFromHandoff(req, tokens[0], result.handoff)):
                tokens += event.token_ids
            for _ in range(200):
                if prefill.engine.kv.ledger.num_held == 0:
                    break
                await asyncio.sleep(0.02)
            assert prefill.resources()["leases"] == 0
            return tokens
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    assert asyncio.run(run()) == want
