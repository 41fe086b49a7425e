"""benchmarks/gpu_roofline.py's arithmetic (the bounds every figure is divided by) and one
whole run on CPU at a tiny scale, so the script a GPU run depends on is known to work."""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    # at collection, before `workers` imports a Triton kernel: run alone with this file,
    # test_gpu_quant_gemm found its kernels built for a GPU ("Cannot call @triton.jit'd")
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.benchmarks.conftest import import_benchmark
from workers import LLM
from workers.models.model_config import ModelConfig


@pytest.fixture(scope="module")
def roofline():
    yield from import_benchmark("gpu_roofline")


def test_weight_bytes_leave_out_the_untied_embedding(roofline, tiny_model):
    model = LLM(tiny_model, num_blocks=16).engine.runner.executor.model
    total = sum(p.numel() * 4 for p in model.parameters())
    mc = ModelConfig.from_pretrained(tiny_model)
    assert not mc.tie_word_embeddings
    assert roofline.weight_bytes_read(model) == total - mc.vocab_size * mc.hidden_size * 4


def test_prefill_flops_of_the_8b_shape(roofline):
    class Shape:  # Llama-3-8B
        hidden_size, num_hidden_layers, intermediate_size, vocab_size = 4096, 32, 14336, 128256
        num_attention_heads, num_key_value_heads, head_dim = 32, 8, 128
    flops = roofline.prefill_flops(Shape, 4096)
    # ~7.0e9 non-embedding weights x 2 x 4096 tokens (5.7e13), plus causal attention (4.4e12)
    assert 6.0e13 < flops < 6.3e13


def test_a_tiny_run_on_cpu_writes_every_figure(roofline, tmp_path, capsys):
    out = tmp_path / "r.json"
    result = roofline.main(["--preset", "tiny", "--device", "cpu", "--dtype", "float32",
                            "--batches", "1,2", "--context", "32", "--steps", "2",
                            "--kernel-batches", "2", "--kernel-contexts", "64",
                            "--prefill-tokens", "64", "--hf-requests", "2",
                            "--hf-prompt-len", "8,16", "--hf-output-len", "2,4",
                            "--tp-sizes", "2", "--disagg", "2:1", "--disagg-prompt", "24",
                            "--disagg-tokens", "4", "--disagg-repeats", "1",
                            "--tp-kv-bytes", str(8 << 20), "--out", str(out)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert json.loads(out.read_text()) == result
    for key in ("decode_b1_bound_ratio", "decode_b2_bound_ratio", "prefill_matmul_bound_ratio",
                "throughput_vs_transformers_ratio", "attention_b2_c64_copy_bw_ratio",
                "tp2_decode_b2_vs_tp1_ratio", "tp2_decode_b1_bound_ratio",
                "disagg_tp2_tp1_pull_copy_bw_ratio"):
        assert result[key] > 0, key
    # a TP=2 prefill group's ranks handed their heads to one decode rank: the same tokens
    assert result["disagg_tp2_tp1_greedy_equal"] is True
    # on the CPU: the C decode kernel when it builds here, never the GPU paths
    assert result["attention_backend"] in ("cpu", "torch") and result["cuda_graphs"] is False
