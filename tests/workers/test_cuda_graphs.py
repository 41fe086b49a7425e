"""The CUDA-graph decode path's CPU-checkable half: the batch-size ladder, padding into the
persistent buffers, the sink block, and which steps replay. On CPU the static path runs the
forward eagerly (`capture=False`), so the tokens it produces must equal the plain engine's;
graph capture itself needs a GPU (`tests/gpu/test_gpu_path.py` checks it there). Every engine
here is pinned to the CPU, so that the file means the same on a machine with a GPU."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    # the Triton kernels run in the interpreter here; it is read when they are first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workers import LLM as _LLM
from workers import SamplingParams
from workers.engine import cuda_graphs, memory_profile
from workers.engine.memory_profile import profile_step, run_profile_step
from workers.engine.runner import KVCacheSpec, allocate_kv_caches
from workers.engine.scheduler import PROMPT_LOGPROB_TOKENS_PER_STEP


def LLM(model, **kwargs):  # noqa: N802 - the engine as these tests use it: on the CPU
    return _LLM(model, device="cpu", **kwargs)

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
    llm = LLM(tiny_model, num_blocks=64, attention_backend="torch")
    model = llm.engine.runner.executor.model
    backend = model.attn_backend
    assert not cuda_graphs.graphs_supported(model, backend, torch.device("cpu"))
    # the torch backend loops over host lists per step: never captured, even on a GPU
    assert not cuda_graphs.graphs_supported(model, backend, torch.device("cuda"))
    assert type(llm.engine.runner.executor).__name__ == "LocalExecutor"
    triton = type("Backend", (), {"cuda_graph_safe": True})()
    assert cuda_graphs.graphs_supported(model, triton, torch.device("cuda"))
    model.cuda_graph_safe = False  # an MoE model's host-side dispatch
    assert not cuda_graphs.graphs_supported(model, triton, torch.device("cuda"))


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
    _interpreted_triton()
    prompts = PROMPTS[:3]
    eager = _greedy(LLM(tiny_model, num_blocks=64, enforce_eager=True), prompts, 6)
    llm = LLM(tiny_model, num_blocks=64, max_cuda_graph_batch_size=4,
              attention_backend="triton", max_model_len=256)
    assert _greedy(llm, prompts, 6) == eager
    assert llm.engine.runner.executor.replayed_steps == 5


def _interpreted_triton():
    """Skips unless the Triton kernels run in the interpreter (as they do on CPU tensors)."""
    pytest.importorskip("triton", reason="the Triton kernels need the triton package")
    from workers.attention import triton_tiles

    if not triton_tiles.interpreted():
        pytest.skip("the kernels were compiled for the GPU (TRITON_INTERPRET unset): CPU "
                    "tensors cannot run them; tests/gpu/test_gpu_path.py covers the GPU")


def test_profile_step_samples_and_takes_prompt_logprobs_at_their_most_expensive(
        tiny_model, monkeypatch):
    sampled, prompt = [], []

    def sampler_call(self, logits, reqs):
        sampled.append((logits.shape[0], [r.params for r in reqs]))

    def top(logprobs, chosen, k):
        assert torch.allclose(logprobs.exp().sum(-1), torch.ones(len(logprobs)))
        prompt.append((logprobs.shape[0], len(chosen), k))

    monkeypatch.setattr(memory_profile.Sampler, "__call__", sampler_call)
    monkeypatch.setattr(memory_profile, "top_logprobs", top)
    llm = LLM(tiny_model, num_blocks=16)
    spec = llm.engine.runner.spec

    def caches_for(n):
        return allocate_kv_caches(KVCacheSpec(spec.num_layers, n, spec.block_size,
                                              spec.num_kv_heads, spec.head_dim, spec.dtype),
                                  torch.device("cpu"))

    num_tokens = 8 + PROMPT_LOGPROB_TOKENS_PER_STEP + 30  # every logit row is requested
    logits = run_profile_step(llm.engine.runner.executor.model, caches_for,
                              torch.device("cpu"), num_tokens, 256, 16, 8)
    assert logits.shape[0] == 8 + PROMPT_LOGPROB_TOKENS_PER_STEP
    (rows, params), = sampled
    assert rows == 8 and len(params) == 8 and all(p == params[0] for p in params)
    p = params[0]
    assert p.top_p < 1 and p.min_p > 0 and p.logprobs == 20 and not p.greedy
    assert prompt == [(PROMPT_LOGPROB_TOKENS_PER_STEP, PROMPT_LOGPROB_TOKENS_PER_STEP, 20)]


def test_warm_up_runs_the_split_and_the_unsplit_decode(tiny_model, forced_static_path,
                                                      monkeypatch):
    _interpreted_triton()
    from workers.attention import triton_backend

    launched = []
    real = triton_backend.paged_decode_attention

    def spy(q, *args, **kwargs):
        launched.append(args[4])  # num_splits
        return real(q, *args, **kwargs)

    llm = LLM(tiny_model, num_blocks=64, max_cuda_graph_batch_size=4,
              attention_backend="triton", max_model_len=1024)
    executor = llm.engine.runner.executor
    monkeypatch.setattr(triton_backend, "device_num_sms", lambda device: 132)  # an H100's
    monkeypatch.setattr(triton_backend, "paged_decode_attention", spy)
    sink = [c[:, executor.sink_block].clone() for c in executor.caches]
    others = [c[:, :executor.sink_block].clone() for c in executor.caches]
    executor.warm_up()
    layers = len(executor.caches)
    # per layer: one row over the 1024-token bound (4 splits of 256), then a one-token context
    assert launched == [4] * layers + [1] * layers
    assert all(torch.equal(c[:, :executor.sink_block], o)
               for c, o in zip(executor.caches, others))
    assert any(not torch.equal(c[:, executor.sink_block], s)
               for c, s in zip(executor.caches, sink))


def test_capture_refuses_sizes_off_the_ladder(tiny_model, forced_static_path):
    executor = LLM(tiny_model, num_blocks=16, max_cuda_graph_batch_size=8).engine.runner.executor
    assert executor.sizes == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="sizes \\[3\\] are not all on the ladder"):
        executor.capture([3])
