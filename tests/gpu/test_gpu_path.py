"""The GPU path end to end: Triton kernels, CUDA graphs and the profiled KV budget give the CPU
reference path's greedy tokens. Needs a CUDA device; the CPU halves of these parts are tested in
test_triton_attention.py (interpreter) and test_cuda_graphs.py (the static path, uncaptured)."""

from __future__ import annotations

import pytest
import torch

from workers import LLM, SamplingParams, cuda_graphs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (CUDA graphs, compiled Triton)")

PROMPTS = ["The quick brown fox", "Paged attention keeps the cache in blocks", "A"]


def _greedy(llm):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_gpu_greedy_equals_cpu_with_and_without_graphs(tiny_model):
    reference = _greedy(LLM(tiny_model, device="cpu", num_blocks=256))
    graphed = LLM(tiny_model, device="cuda", num_blocks=256)
    assert graphed.engine.config.resolved_attention_backend == "triton"
    assert isinstance(graphed.engine.runner.executor, cuda_graphs.CudaGraphExecutor)
    assert _greedy(graphed) == reference
    assert graphed.engine.runner.executor.replayed_steps > 0
    eager = LLM(tiny_model, device="cuda", num_blocks=256, enforce_eager=True)
    assert _greedy(eager) == reference


def test_profiled_kv_budget_leaves_the_rest_of_memory(tiny_model):
    llm = LLM(tiny_model, device="cuda", gpu_memory_utilization=0.3)
    _, total = torch.cuda.mem_get_info()
    kv_bytes = llm.engine.runner.spec.num_blocks * llm.engine.runner.spec.bytes_per_block
    assert 0 < kv_bytes <= 0.3 * total
    assert _greedy(llm)  # runs
