"""Real NCCL ranks: a GPU worker group gives one GPU's greedy tokens and keeps its KV cache
to itself. Needs 2 CUDA devices; the CPU half (planning, refusals) is in
tests/workers/test_parallel_gpu.py."""

from __future__ import annotations

import pytest
import torch

from workers import LLM, SamplingParams
from workers.engine.parallel.executor import KVCacheNotShared
from workers.serving.transfer import kv_layouts


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_nccl_group_greedy_tokens_equal_one_gpu(tiny_model, tp, pp):
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7], list(range(20, 45))]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    common = {"device": "cuda", "dtype": "float32", "num_blocks": 64, "block_size": 16,
              "enforce_eager": True}
    want = [o.outputs[0].token_ids for o in LLM(tiny_model, **common).generate(prompts, params)]
    group = LLM(tiny_model, tensor_parallel_size=tp, pipeline_parallel_size=pp, **common)
    try:
        got = [o.outputs[0].token_ids for o in group.generate(prompts, params)]
        with pytest.raises(KVCacheNotShared):
            kv_layouts(group.engine)
    finally:
        group.engine.close()
    assert got == want
