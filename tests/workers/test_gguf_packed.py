"""GGUF Q8_0 / Q4_0 / Q4_1 weights served packed on the CPU (`EngineConfig.gguf_packed`):
the block kernels against dequantize-then-matmul, the weights bit-exact to the file's, and the
real model's logits and greedy tokens against the same file dequantized at load.

Tolerances: the kernels multiply the file's exact values (d * q, plus m rounded once as the
file's dequantization does) by fp32 activations and sum in fp32 in an order of their own, so
they differ from a float64 reference by at most the fp32 summation bound
gamma_K * sum_j |w_j x_j| (gamma_K = K u / (1 - K u), u = 2^-24, one rounding per step of the
sum and per product); asserted with a factor of 2 to spare.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.workers.gguf_files import WindowedPromptBackend, prompt_logits
from tests.workers.smollm2 import smollm2_gguf
from workers import LLM, SamplingParams
from workers.kernels import gguf_gemm
from workers.models.loader import load_model
from workers.models.model_config import ModelConfig
from workers.quant.gguf_packed import DECODE_ROWS, GGUFLookup, GGUFMatmul

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not gguf_gemm.available(), reason="no C compiler for the kernels")

TYPES = ("Q8_0", "Q4_0", "Q4_1")


def quantized(ggml_type: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [n, row bytes], the file's values fp32 [n, k] by gguf's dequantize)."""
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32)
    qtype = gguf.GGMLQuantizationType[ggml_type]
    blocks = gguf.quants.quantize(w, qtype)
    values = np.asarray(gguf.quants.dequantize(blocks, qtype), dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(values.copy())


def assert_within_summation_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    k = x.shape[1]
    exact = x.double() @ w.double().t()
    u = 2.0 ** -24
    bound = 2 * (k * u / (1 - k * u)) * (x.double().abs() @ w.double().abs().t())
    excess = ((got.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"beyond the fp32 summation bound by {excess:.3e}"


@pytest.mark.parametrize("ggml_type", TYPES)
def test_the_kernels_equal_dequantize_then_matmul(ggml_type):
    # 301 rows: tiles of 4 and a tail; up to DECODE_ROWS rows of x: passes of 4, wide passes
    # of 8 and a remainder
    n, k = 301, 576
    blocks, values = quantized(ggml_type, n, k, seed=1)
    assert torch.equal(gguf_gemm.dequantize_rows(blocks, ggml_type, k), values)
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 2, 3, 4, 5, 9, 19, DECODE_ROWS):
        x = torch.randn(rows, k, generator=gen)
        assert_within_summation_bound(gguf_gemm.gguf_gemm(x, blocks, ggml_type, n), x, values)
    x = torch.randn(40, k, generator=gen)  # a prefill's rows: dequantized tiles, torch's matmul
    assert_within_summation_bound(gguf_gemm.tiled_mm(x, blocks, ggml_type, n), x, values)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(ggml_type):
    """A speculative verification's k + 1 rows (more than 4: the wide passes over weight pairs)
    must come out as decoding them one at a time does, bit for bit, on any thread count, or a
    greedy output could change with speculation."""
    n, k = 303, 256  # quads of weight rows and a tail of 3
    blocks, _ = quantized(ggml_type, n, k, seed=5)
    x = torch.randn(DECODE_ROWS, k, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([gguf_gemm.gguf_gemm(x[i:i + 1], blocks, ggml_type, n, num_threads=1)
                       for i in range(DECODE_ROWS)])
    for rows in range(2, DECODE_ROWS + 1):
        for threads in (1, 3):
            got = gguf_gemm.gguf_gemm(x[:rows], blocks, ggml_type, n, num_threads=threads)
            assert torch.equal(got, alone[:rows]), (rows, threads)


def test_a_tiled_prefill_spans_several_tiles(monkeypatch):
    monkeypatch.setattr(gguf_gemm, "TILE_BYTES", 64 * 128 * 4)  # 64-row tiles of 100 rows
    blocks, values = quantized("Q4_1", 100, 128, seed=3)
    x = torch.randn(12, 128, generator=torch.Generator().manual_seed(4))
    assert_within_summation_bound(gguf_gemm.tiled_mm(x, blocks, "Q4_1", 100), x, values)


def test_a_lookup_gives_the_files_rows_and_refuses_ids_outside_the_table():
    blocks, values = quantized("Q8_0", 50, 64, seed=5)
    ids = torch.tensor([7, 0, 49, 7])
    assert torch.equal(gguf_gemm.dequantize_rows(blocks, "Q8_0", 64, ids=ids), values[ids])
    with pytest.raises(IndexError, match=r"\[0, 50\)"):
        gguf_gemm.dequantize_rows(blocks, "Q8_0", 64, ids=torch.tensor([3, 50]))
    with pytest.raises(ValueError, match="multiple of 32"):
        gguf_gemm.row_bytes("Q4_0", 48)


def _models(path):
    config = ModelConfig.from_pretrained(path)
    return [load_model(path, config, dtype=torch.float32, device="cpu",
                       attn_backend=WindowedPromptBackend(), gguf_packed=packed)
            for packed in (True, False)]


def test_packed_weights_are_the_files_values_and_the_output_projection_stays_packed(
        tiny_q4_1):
    packed, dequantized = _models(tiny_q4_1)
    layer = packed.model.layers[0]
    qkv, reference = layer.self_attn.qkv_proj, dequantized.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.matmul, GGUFMatmul) and qkv.weight.dtype == torch.uint8
    k = reference.weight.shape[1]
    assert torch.equal(gguf_gemm.dequantize_rows(qkv.weight, "Q4_1", k), reference.weight)
    embed, lm_head = packed.model.embed_tokens, packed.lm_head
    assert isinstance(embed.lookup, GGUFLookup) and isinstance(lm_head.matmul, GGUFMatmul)
    assert lm_head.weight is embed.weight and embed.weight.dtype == torch.uint8
    assert torch.equal(gguf_gemm.dequantize_rows(embed.weight, "Q4_1", k),
                       dequantized.model.embed_tokens.weight)


def test_packed_logits_follow_the_dequantized_model_in_prefill_and_decode_rows(tiny_q4_1):
    packed, dequantized = _models(tiny_q4_1)
    prompts = ([[(37 * i) % 250 + 3 for i in range(DECODE_ROWS + 8)]]  # tiles
               + [[11, 5, 300, 8, 61, 7, 12, 200, 33]])  # rows the block kernel takes
    for prompt in prompts:
        got, want = (prompt_logits(m, prompt) for m in (packed, dequantized))
        assert want.std() > 0.1
        assert (got - want).abs().max().item() <= 1e-4


def test_smollm2_served_packed_answers_as_the_dequantized_file_does():
    """The real Q4_1 file: prompt logits against the dequantized model's, then 32 greedy tokens
    of real prompts through the engine (the fused decode stack over the packed blocks)."""
    path = smollm2_gguf()
    config = ModelConfig.from_pretrained(path)
    models = [load_model(path, config, dtype=torch.float32, device="cpu",
                         attn_backend=WindowedPromptBackend(), gguf_packed=packed)
              for packed in (True, False)]
    # 60 tokens: the prefill's tiles; 8: the block kernel, the output projection's Q8_0 too
    for prompt in (list(range(1000, 1060)), list(range(2000, 2000 + DECODE_ROWS))):
        got, want = (prompt_logits(m, prompt) for m in models)
        diff = (got - want).abs().max().item()
        print(f"SmolLM2 Q4_1 packed vs dequantized, {len(prompt)} rows: max |logit diff| "
              f"{diff:.2e} (std {want.std():.2f})")
        assert want.std() > 1.0 and diff <= 1e-4
    del models
    texts = ["The capital of France is", "def fibonacci(n):", "Water boils at",
             "The three primary colors are"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    tokens = {}
    for packed in (True, False):
        llm = LLM(str(path), dtype="float32", block_size=16, num_blocks=64, gguf_packed=packed)
        tokens[packed] = [o.outputs[0].token_ids for o in llm.generate(texts, params)]
        del llm
    assert tokens[True] == tokens[False]
