"""The GPU path end to end: Triton kernels, CUDA graphs and the profiled KV budget give the CPU
reference path's greedy tokens. Needs a CUDA device; the CPU halves of these parts are tested in
test_triton_attention.py (interpreter) and test_cuda_graphs.py (the static path, uncaptured).

The profiled budget is checked through `assembly.num_kv_blocks`, not by building an engine of
it: at gpu_memory_utilization=0.3 of an 80-140 GB GPU the tiny model's few-KiB blocks number in
the millions, one Python object each in the block pool (about 0.7 s and 180 MB of host memory
per million on a slow shared CPU), so serving runs on a few hundred blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workers import LLM, SamplingParams
from workers.engine import assembly, cuda_graphs, memory_profile
from workers.engine.runner import allocate_kv_caches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (CUDA graphs, compiled Triton)")

PROMPTS = ["The quick brown fox", "Paged attention keeps the cache in blocks", "A"]


def _greedy(llm, **params):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, **params)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_gpu_greedy_equals_cpu_with_and_without_graphs(tiny_model):
    reference = _greedy(LLM(tiny_model, device="cpu", num_blocks=256))
    graphed = LLM(tiny_model, device="cuda", num_blocks=256)
    assert graphed.engine.config.resolved_attention_backend == "triton"
    executor = graphed.engine.runner.executor
    assert isinstance(executor, cuda_graphs.CudaGraphExecutor)
    assert _greedy(graphed) == reference
    assert executor.replayed_steps > 0
    # every graph writes into one logits buffer sized for the largest
    assert executor._logits.shape[0] == executor.sizes[-1]
    assert len(executor._graphs) == len(executor.sizes)
    eager = LLM(tiny_model, device="cuda", num_blocks=256, enforce_eager=True)
    assert _greedy(eager) == reference


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_an_8_bit_cache_on_the_gpu_decodes_as_the_torch_backend(tiny_model, kv_cache_dtype):
    """The Triton kernels compiled (the CPU tests run them in the interpreter): quantized in the
    RoPE-and-store kernel, scaled per quarter row in the attention tiles, under CUDA graphs, against the
    torch backend on the same device and cache dtype."""
    graphed = LLM(tiny_model, device="cuda", num_blocks=256, kv_cache_dtype=kv_cache_dtype)
    assert graphed.engine.config.resolved_attention_backend == "triton"
    plain = LLM(tiny_model, device="cuda", num_blocks=256, kv_cache_dtype=kv_cache_dtype,
                attention_backend="torch", max_cuda_graph_batch_size=0)
    got, want = _greedy(graphed), _greedy(plain)
    same = sum(a == b for a, b in zip(got, want))
    assert same >= len(PROMPTS) - 1, (got, want)  # a near tie may flip one continuation


def test_prompt_logprobs_on_the_gpu_equal_the_cpu(tiny_model):
    want = LLM(tiny_model, device="cpu", num_blocks=256).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=5))
    got = LLM(tiny_model, device="cuda", num_blocks=256).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=5))
    for w, g in zip(want, got):
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs)
        for a, b in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 0.1


def test_profiled_kv_budget_leaves_the_rest_of_memory(tiny_model):
    engine = LLM(tiny_model, device="cuda", num_blocks=256).engine
    config = dataclasses.replace(engine.config, num_blocks=None, gpu_memory_utilization=0.3)
    model, spec = engine.runner.executor.model, engine.runner.spec
    blocks = assembly.num_kv_blocks(config, spec, model, torch.device("cuda"),
                                    engine.max_model_len)
    _, total = torch.cuda.mem_get_info()
    assert 0 < blocks * spec.bytes_per_block <= 0.3 * total


def test_the_graph_profile_counts_the_shared_logits_buffer(tiny_model):
    engine = LLM(tiny_model, device="cuda", num_blocks=256).engine
    model, spec = engine.runner.executor.model, engine.runner.spec
    device = torch.device("cuda")

    def caches_for(n):
        return allocate_kv_caches(dataclasses.replace(spec, num_blocks=n), device)

    held = memory_profile.graph_profile(model, caches_for, device,
                                        max_seq_len=engine.max_model_len, graph_batch_size=64)
    vocab = engine.model_config.vocab_size
    assert held >= 64 * vocab * 4  # at least the fp32 logits buffer of the largest graph
    assert memory_profile.graph_profile(model, caches_for, device,
                                        max_seq_len=engine.max_model_len,
                                        graph_batch_size=0) == 0
