"""A GGUF file's Q8_0 / Q4_0 / Q4_1 weights on the VNNI kernel (`EngineConfig.fp32_int_kernels`
with a packed GGUF file, `workers/kernels/csrc/gguf_vnni.c`): the file's values exactly, times
activations quantized to int8 in blocks of 32 columns (as llama.cpp multiplies them), a row's
result independent of the rows beside it, the fused decoder stack and the output projection on
it, and speculative decoding still exact over it.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.workers.gguf_files import WindowedPromptBackend, prompt_logits
from tests.workers.smollm2 import smollm2_gguf
from workers import LLM, SamplingParams
from workers.kernels import gguf_gemm, gguf_vnni
from workers.models.fused_abi import GGUF_VNNI, Layer
from workers.models.loader import load_model
from workers.models.model_config import ModelConfig
from workers.quant.gguf_packed import GGUFLookup, GGUFVnniMatmul

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not gguf_vnni.available(),
                                reason="the GGUF VNNI kernel needs AVX-512 VNNI and a C compiler")


def blocks_of(ggml_type: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    import numpy as np

    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32)
    qtype = gguf.GGMLQuantizationType[ggml_type]
    blocks = np.ascontiguousarray(gguf.quants.quantize(w, qtype))
    return torch.from_numpy(blocks), gguf_gemm.dequantize_rows(torch.from_numpy(blocks),
                                                               ggml_type, k)


def x_as_the_kernel_quantizes_it(x: torch.Tensor) -> torch.Tensor:
    """x's int8 blocks times their scales, computed in fp32 as int_gemm.c does (amax / 127, then
    x times its reciprocal rounded to nearest even), returned in float64."""
    blocks = x.float().view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks * (1 / scale))
    return (q.double() * scale.double()).view(x.shape)


def assert_within_fp32_bound(got: torch.Tensor, xq: torch.Tensor, w: torch.Tensor) -> None:
    """The kernel's int32 dot products are exact; its per-block scaling and sums are fp32: within
    the fp32 summation bound over the blocks (and one rounding per block's scale), x2 to spare."""
    blocks, u = w.shape[1] // 32, 2.0 ** -24
    want = xq @ w.t()
    bound = 2 * ((blocks + 4) * u) * (xq.abs() @ w.abs().t())
    assert ((got.double() - want).abs() - bound).max().item() <= 0


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_0", "Q4_1"])
def test_the_vnni_kernel_multiplies_the_files_values_by_int8_activations(ggml_type):
    # 301 rows: tiles of 16 and a padded tail; 1-40 rows of x: passes of 8 and remainders
    n, k = 301, 576
    blocks, values = blocks_of(ggml_type, n, k, seed=3)
    blocked = gguf_vnni.block_gguf(blocks, ggml_type, k)
    gen = torch.Generator().manual_seed(4)
    for rows in (1, 3, 8, 9, 40):
        x = torch.randn(rows, k, generator=gen)
        got = gguf_vnni.gguf_vnni_gemm(x, blocked, ggml_type, n)
        assert_within_fp32_bound(got, x_as_the_kernel_quantizes_it(x), values.double())
        # a row's result does not depend on the rows beside it nor on the threads
        assert torch.equal(gguf_vnni.gguf_vnni_gemm(x[-1:], blocked, ggml_type, n), got[-1:])
        assert torch.equal(gguf_vnni.gguf_vnni_gemm(x, blocked, ggml_type, n, 1), got)


def test_activations_tied_between_two_integers_round_to_the_even_one():
    """Each block holds 127 (its scale exactly 1) and values halfway between integers: they
    round to the even neighbour (2.5 -> 2, -2.5 -> -2, 3.5 -> 4); rounding half away from zero
    would move each product by a whole weight, far outside the fp32 bound."""
    n, k = 301, 576
    blocks, values = blocks_of("Q8_0", n, k, seed=6)
    blocked = gguf_vnni.block_gguf(blocks, "Q8_0", k)
    ties = torch.arange(31, dtype=torch.float32) - 15.5  # -15.5 ... 14.5
    x = torch.cat([torch.tensor([127.0]), ties]).repeat(k // 32).view(1, k)
    quantized = x_as_the_kernel_quantizes_it(x)
    assert quantized[0, 1:32].tolist() == [2 * round(v / 2) for v in ties.tolist()]
    got = gguf_vnni.gguf_vnni_gemm(x, blocked, "Q8_0", n)
    assert_within_fp32_bound(got, quantized, values.double())


def test_the_vnni_kernel_refuses_a_row_of_partial_blocks():
    blocks, _ = blocks_of("Q4_1", 16, 64, seed=5)
    with pytest.raises(ValueError, match="unsupported"):
        gguf_vnni.gguf_vnni_gemm(torch.randn(1, 48), gguf_vnni.block_gguf(blocks, "Q4_1", 64),
                                 "Q4_1", 16)


def test_a_q4_1_file_s_layers_and_head_take_the_vnni_kernel(tiny_q4_1):
    config = ModelConfig.from_pretrained(tiny_q4_1)
    models = {flag: load_model(tiny_q4_1, config, dtype=torch.float32, device="cpu",
                               attn_backend=WindowedPromptBackend(), fp32_int_kernels=flag)
              for flag in (True, False)}
    model, reference = models[True], models[False]
    layer, packed = model.model.layers[0].mlp.down_proj, reference.model.layers[0].mlp.down_proj
    assert isinstance(layer.matmul, GGUFVnniMatmul) and not hasattr(layer, "weight")
    k = packed.matmul.in_features
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(6))
    assert_within_fp32_bound(layer.matmul(layer, x), x_as_the_kernel_quantizes_it(x),
                             gguf_gemm.dequantize_rows(packed.weight, "Q4_1", k).double())
    # the tied output projection too, from its own copy; the embedding still looks rows up
    head, embed = model.lm_head, model.model.embed_tokens
    assert isinstance(head.matmul, GGUFVnniMatmul) and head.weight is embed.weight
    assert isinstance(embed.lookup, GGUFLookup)
    # the answer stays the file's: logits near the fp32 path's (int8 activations in every
    # matmul, the head's included, moved them by 0.05 of their spread here), not equal to them
    prompt = [11, 5, 300, 8, 61, 7, 12, 200, 33]
    got, want = (prompt_logits(m, prompt) for m in (model, reference))
    assert (got - want).abs().max().item() <= 0.1 * want.std().item()
    assert not torch.equal(got, want)


def test_smollm2_on_the_vnni_kernel_speculates_exactly():
    """The real Q4_1 file on the VNNI kernel: 48 greedy tokens of real prompts with n-gram
    speculation equal those without (the same engine; the request turns it off), every
    projection of the fused stack (decode and verification rows) on the kernel."""
    path = smollm2_gguf()
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                       "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    llm = LLM(str(path), fp32_int_kernels=True, speculative_config=spec,
              enable_prefix_caching=False)
    prompts = [llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        for text in (("Repeat this paragraph word for word:\n\nThe river runs through the old "
                      "town, past the market and the stone bridge."),
                     "Why is the sky blue?")]
    tokens = {}
    for speculative in (True, False):
        params = SamplingParams(temperature=0.0, max_tokens=48, speculative=speculative)
        tokens[speculative] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens[True] == tokens[False]
    assert llm.engine.stats().num_accepted_tokens > 0
    model = llm.engine.runner.executor.model
    kinds = {getattr(s, p).kind for s in model.model.fused_stack.structs
             for p in Layer.PROJECTIONS}
    assert kinds == {GGUF_VNNI} and isinstance(model.lm_head.matmul, GGUFVnniMatmul)
