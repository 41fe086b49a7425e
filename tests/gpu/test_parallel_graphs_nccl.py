"""CUDA graphs on NCCL ranks: a TP=2 group whose ranks capture their decode steps (the
all-reduces and the logits' all-gather inside the graphs) gives the greedy tokens of the same
group run eagerly and of one GPU. Needs 2 CUDA devices; the driver's padding decision and the
padded static path on gloo ranks: tests/workers/test_parallel_graphs.py."""

from __future__ import annotations

import pytest
import torch

from workers import LLM, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7], list(range(20, 45))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
COMMON = {"device": "cuda", "dtype": "float32", "num_blocks": 64, "block_size": 16,
          "max_num_seqs": 8}


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp2_nccl_graphs_give_the_eager_groups_and_one_gpus_greedy_tokens(tiny_model):
    want = tokens(LLM(tiny_model, enforce_eager=True, **COMMON))
    results = {}
    for eager in (True, False):
        group = LLM(tiny_model, tensor_parallel_size=2, enforce_eager=eager, **COMMON)
        try:
            executor = group.engine.runner.executor
            # eager: nothing captured; else the ladder up to max_num_seqs on both ranks
            assert executor.graph_sizes == (() if eager else (1, 2, 4, 8))
            assert executor.graphs_captured is not eager
            results[eager] = tokens(group)
        finally:
            group.engine.close()
    assert results[False] == results[True] == want
