"""A GGUF file's Q4_0 / Q4_1 weights on the VNNI int4 kernel (`EngineConfig.fp32_int_kernels`
with a packed GGUF file): the file's values exactly, activations quantized to int8 in blocks of
32 columns (as llama.cpp multiplies Q4 blocks), the fused decoder stack's int4 path, and
speculative decoding still exact over it.

Tolerance of the layer test: the reference is the file's dequantized values times x quantized
as the kernel quantizes it (each block's absolute maximum / 127, rounded to nearest), in float64;
the kernel's int32 dot products are exact, and its fp32 scaling and sums stay within the fp32
summation bound, asserted with a factor of 2 to spare (as test_gguf_packed's).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.workers.gguf_files import WindowedPromptBackend, prompt_logits, write_gguf
from tests.workers.smollm2 import smollm2_gguf
from workers import LLM, SamplingParams
from workers.kernels import gguf_gemm
from workers.kernels import int_gemm as int_kernels
from workers.models.loader import load_model
from workers.models.fused_abi import INT4, Layer
from workers.models.make_model import make_model
from workers.models.model_config import ModelConfig
from workers.quant.gguf_packed import GGUFMatmul, int4_parts
from workers.quant.linear import QuantizedMatmul

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not (gguf_gemm.available() and int_kernels.available()),
                                reason="the int4 kernel needs AVX-512 VNNI and a C compiler")


def blocks_of(ggml_type: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    import numpy as np

    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32)
    qtype = gguf.GGMLQuantizationType[ggml_type]
    blocks = np.ascontiguousarray(gguf.quants.quantize(w, qtype))
    return torch.from_numpy(blocks), gguf_gemm.dequantize_rows(torch.from_numpy(blocks),
                                                               ggml_type, k)


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1"])
def test_the_int4_parts_are_the_files_values(ggml_type):
    blocks, values = blocks_of(ggml_type, 37, 576, seed=3)
    q, scales, offsets = int4_parts(blocks, ggml_type, 576)
    u = (q.to(torch.int32) + 8).float()
    assert int(u.min()) >= 0 and int(u.max()) <= 15
    w = u * scales.repeat_interleave(32, 1)
    if offsets is not None:  # Q4_1: w = d u + m, with offset -m
        w = w - offsets.repeat_interleave(32, 1)
    else:  # Q4_0: w = d (u - 8), which the kernel takes as 8 d per block
        w = w - 8 * scales.repeat_interleave(32, 1)
    assert torch.equal(w, values)


def x_as_the_kernel_quantizes_it(x: torch.Tensor) -> torch.Tensor:
    blocks = x.double().view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(blocks / scale) * scale).view_as(x)


@pytest.fixture(scope="module")
def tiny_q4_1(tmp_path_factory):
    """A tiny llama as a Q4_1 GGUF file (its tied embedding Q4_1 too)."""
    folder = tmp_path_factory.mktemp("tiny-hf")
    hf_dir = make_model(folder, arch="llama", preset="tiny",
                        overrides={"tie_word_embeddings": True})
    return write_gguf(hf_dir, tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf", "Q4_1")


def test_a_q4_1_file_s_layers_take_the_int4_kernel_with_int8_activations(tiny_q4_1):
    config = ModelConfig.from_pretrained(tiny_q4_1)
    models = {flag: load_model(tiny_q4_1, config, dtype=torch.float32, device="cpu",
                               attn_backend=WindowedPromptBackend(), fp32_int_kernels=flag)
              for flag in (True, False)}
    model, reference = models[True], models[False]
    layer, packed = model.model.layers[0].mlp.down_proj, reference.model.layers[0].mlp.down_proj
    assert isinstance(layer.matmul, QuantizedMatmul) and layer.matmul.kernel == "int4"
    assert not hasattr(layer, "weight")
    # the tied output projection shares the embedding's table: it stays on the block kernel
    assert isinstance(model.lm_head.matmul, GGUFMatmul)
    k = packed.matmul.in_features
    values = gguf_gemm.dequantize_rows(packed.weight, "Q4_1", k).double()
    for rows in (1, 5, 40):  # the decode step's rows, a verification's, a prefill's
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        got = layer.matmul(layer, x).double()
        want = x_as_the_kernel_quantizes_it(x) @ values.t()
        u = 2.0 ** -24
        bound = 2 * (k * u / (1 - k * u) + 4 * u) * (x.double().abs() @ values.abs().t())
        assert ((got - want).abs() - bound).max().item() <= 0
    # the model's answer stays the file's: logits near the fp32 path's (int8 activations
    # move them by a few hundredths of their spread here)
    prompt = [11, 5, 300, 8, 61, 7, 12, 200, 33]
    got, want = (prompt_logits(m, prompt) for m in (model, reference))
    assert (got - want).abs().max().item() <= 0.05 * want.std().item()
    assert not torch.equal(got, want)  # the activations were quantized


def test_smollm2_on_int_kernels_speculates_exactly():
    """The real Q4_1 file on the int4 kernel: 48 greedy tokens of real prompts with n-gram
    speculation equal those without (the same engine; the request turns it off), and the
    answers are the fp32 path's in most tokens."""
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
    stats = llm.engine.stats()
    assert stats.num_accepted_tokens > 0
    model = llm.engine.runner.executor.model.model
    assert isinstance(model.layers[0].self_attn.qkv_proj.matmul, QuantizedMatmul)
    kinds = {getattr(s, p).kind for s in model.fused_stack.structs for p in Layer.PROJECTIONS}
    assert kinds == {INT4}  # the decode and verification rows' fused C stack, on int4
