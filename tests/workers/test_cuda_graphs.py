"""The CUDA-graph decode path's CPU-checkable half: the batch-size ladder, padding into the
persistent buffers, the sink block, and which steps replay. On CPU the static path runs the
forward eagerly (`capture=False`), so the tokens it produces must equal the plain engine's;
graph capture itself needs a GPU (`benchmarks/gpu_roofline.py` checks it there)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    # the Triton kernels run in the interpreter here; it is read when they are first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workers import LLM, SamplingParams, cuda_graphs
from workers.scheduler import PROMPT_LOGPROB_TOKENS_PER_STEP
from workers.memory_profile import profile_step, run_profile_step
from workers.runner import KVCacheSpec, allocate_kv_caches

PROMPTS = ["The quick brown fox", "jumps over the lazy dog and keeps running far away",
           "A", "Paged attention keeps the KV cache in fixed-size blocks", "Hello hello hello"]


def test_capture_sizes_ladder():
    assert cuda_graphs.capture_sizes(1) == [1]
    assert cuda_graphs.capture_sizes(5) == [1, 2, 4, 5]
    assert cuda_graphs.capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    ladder = cuda_graphs.capture_sizes(256)
    assert ladder[:5] == [1, 2, 4, 8, 16] and ladder[-1] == 256
    assert all(b - a <= 8 for a, b in itertools.pairwise(ladder))
    with pytest.raises(ValueError, match="max_batch_size must be at least 1, got 0"):
        cuda_graphs.capture_sizes(0)


def test_graphs_need_a_gpu_a_graph_safe_backend_and_model(tiny_model):
    llm = LLM(tiny_model, num_blocks=64)
    model = llm.engine.runner.executor.model
    backend = model.attn_backend
    assert not cuda_graphs.graphs_supported(model, backend, torch.device("cpu"))
    # the torch backend loops over host lists per step: never captured, even on a GPU
    assert not cuda_graphs.graphs_supported(model, backend, torch.device("cuda"))
    assert type(llm.engine.runner.executor).__name__ == "LocalExecutor"


@pytest.fixture
def forced_static_path(monkeypatch):
    """Makes the engine take the graph executor on CPU, where it runs without capture."""
    monkeypatch.setattr(cuda_graphs, "graphs_supported", lambda *a: True)


def _greedy(llm, prompts, max_tokens=12):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("num_prompts", [1, 3, 5])
def test_static_decode_path_gives_the_eager_tokens(tiny_model, forced_static_path, num_prompts):
    # 3 and 5 sequences pad to the captured sizes 4 and 8 (max batch 8)
    prompts = PROMPTS[:num_prompts]
    eager = _greedy(LLM(tiny_model, num_blocks=64, enforce_eager=True), prompts)
    llm = LLM(tiny_model, num_blocks=64, max_cuda_graph_batch_size=8)
    executor = llm.engine.runner.executor
    assert isinstance(executor, cuda_graphs.CudaGraphExecutor)
    assert _greedy(llm, prompts) == eager
    assert executor.replayed_steps >= 11  # every decode step after the prompts' prefill


def test_padding_writes_only_the_sink_block(tiny_model, forced_static_path):
    llm = LLM(tiny_model, num_blocks=64, max_cuda_graph_batch_size=8, enable_prefix_caching=False)
    executor = llm.engine.runner.executor
    # the manager hands out 64 blocks; the cache has one more, the sink
    assert llm.engine.kv.pool.num_blocks == 64 and executor.sink_block == 64
    assert all(c.shape[1] == 65 for c in executor.caches)
    for cache in executor.caches:
        cache.zero_()
    _greedy(llm, PROMPTS[:3], max_tokens=4)  # decode batches of 3 pad to 4
    sink = executor.caches[0][:, 64]
    assert sink.abs().sum() > 0  # the padded row's K/V went there
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks  # nothing leaked by the padded path


def test_prefill_and_oversized_batches_run_eagerly(tiny_model, forced_static_path):
    llm = LLM(tiny_model, num_blocks=128, max_cuda_graph_batch_size=2)
    executor = llm.engine.runner.executor
    eager = _greedy(LLM(tiny_model, num_blocks=128, enforce_eager=True), PROMPTS[:4], 6)
    assert _greedy(llm, PROMPTS[:4], 6) == eager  # batch 4 > 2: no static step
    assert executor.replayed_steps == 0
    _greedy(llm, PROMPTS[:2], 6)
    assert executor.replayed_steps == 5  # 5 decode steps; the prefill step ran eagerly


def test_engine_config_rejects_a_negative_graph_batch(tiny_model):
    with pytest.raises(ValueError, match="max_cuda_graph_batch_size must be at least 0"):
        LLM(tiny_model, max_cuda_graph_batch_size=-1)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        LLM(tiny_model, attention_backend="flash")


def test_profile_step_covers_the_largest_batch(tiny_model):
    msg, num_blocks = profile_step(num_tokens=100, max_model_len=40, block_size=16,
                                   max_num_seqs=8)
    assert msg.seq_lens == (40, 40, 20) and msg.num_tokens == 100
    assert num_blocks == 3 + 3 + 2
    assert len(set(msg.slot_mapping)) == 100 and max(msg.slot_mapping) < num_blocks * 16
    # every row of its last max_num_seqs, plus the step's prompt-logprob rows (all 100 here)
    assert msg.logit_rows == tuple(range(max(0, 100 - 8 - PROMPT_LOGPROB_TOKENS_PER_STEP),
                                         100))
    llm = LLM(tiny_model, num_blocks=16)
    model = llm.engine.runner.executor.model
    spec = llm.engine.runner.spec

    def caches_for(n):
        return allocate_kv_caches(KVCacheSpec(spec.num_layers, n, spec.block_size,
                                              spec.num_kv_heads, spec.head_dim, spec.dtype),
                                  torch.device("cpu"))

    logits = run_profile_step(model, caches_for, torch.device("cpu"), 100, 40, 16, 8)
    assert logits.shape == (len(msg.logit_rows), llm.engine.model_config.vocab_size)
    assert torch.isfinite(logits).all()


def test_static_path_with_the_triton_kernels(tiny_model, forced_static_path):
    """The Triton backend (CPU interpreter) on the static buffers with the metadata a capture
    bakes in (lengths bounded by the model's context, padded rows in the sink block)."""
    pytest.importorskip("triton", reason="the Triton kernels need the triton package")
    prompts = PROMPTS[:3]
    eager = _greedy(LLM(tiny_model, num_blocks=64, enforce_eager=True), prompts, 6)
    llm = LLM(tiny_model, num_blocks=64, max_cuda_graph_batch_size=4,
              attention_backend="triton", max_model_len=256)
    assert _greedy(llm, prompts, 6) == eager
    assert llm.engine.runner.executor.replayed_steps == 5
