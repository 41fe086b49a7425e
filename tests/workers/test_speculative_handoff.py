"""Speculative decoding across a KV handoff over TCP: a decode worker drafting with a truncated
copy of the target (whose layers' KV is the target's: the pulled blocks cover the draft too)
decodes a handed-off request as an aggregated worker with the same speculation does."""

from __future__ import annotations

import json

import pytest

from workers.contract.messages import DecodeFromHandoff, Generate
from workers.contract.protocol import SamplingParams, WorkerRequest
from workers.engine.config import EngineConfig
from workers.serving.worker import Worker

DRAFT_MODEL = json.dumps({"method": "draft_model", "num_speculative_tokens": 3,
                          "draft_num_layers": 1, "draft_length": "fixed"})
PROMPT = [5, 6, 7, 8, 9] * 8  # 40 tokens: 2 full blocks of 16 and a partial one


def make_worker(model: str, worker_id: str, role: str, speculative: str | None,
                **options: object) -> Worker:
    config = EngineConfig(model=model, num_blocks=48, max_num_batched_tokens=256,
                          speculative_config=speculative)
    return Worker.from_config(worker_id, config, role, **options)


async def collect(stream) -> list[int]:
    return [t async for event in stream for t in event.token_ids]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.95, seed=9, max_tokens=24, ignore_eos=True)],
    ids=["greedy", "seeded"])
def test_a_draft_model_decodes_a_handoff_over_tcp_as_it_decodes_aggregated(tiny_model, run,
                                                                           params):
    prefill = make_worker(tiny_model, "p", "prefill", None, lease_s=5.0)
    decode = make_worker(tiny_model, "d", "decode", DRAFT_MODEL, pull_timeout_s=5.0)
    both = make_worker(tiny_model, "b", "both", DRAFT_MODEL if params.seed else None)

    async def go() -> tuple[list[int], list[int]]:
        # greedy: the text without speculation; seeded: the aggregated speculative one
        want = await collect(both.stream(Generate(WorkerRequest("agg", tuple(PROMPT), params))))
        req = WorkerRequest("r", tuple(PROMPT), params)
        result = await prefill.prefill(req)
        assert result.handoff is not None
        first = result.first.token_ids[0]
        rest = await collect(decode.stream(DecodeFromHandoff(req, first, result.handoff)))
        return want, [first, *rest]

    try:
        want, got = run(go())
        assert got == want and len(got) == params.max_tokens
        stats = decode.stats()
        assert stats.speculative_method == "draft_model" and stats.num_accepted_tokens > 0
    finally:
        for worker in (prefill, decode, both):
            run(worker.shutdown())
