"""The fused Triton kernels (`workers.kernels`) against the torch ops they replace, in Triton's
interpreter on CPU, compiled on a GPU where there is one (inputs made on the CPU, moved to
`DEVICE`): RMSNorm with and without the residual add (Llama's and Gemma's), RoPE of q and k fused
with the paged KV write, and whole models' greedy tokens through them."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # before the kernels are imported: triton reads it when @triton.jit decorates
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the fused kernels need the triton package")

from tests.workers.interpreter_rounding import rounding_bf16_as_gpus_do  # noqa: E402,F401
from workers import kernels
from workers.kernels import norm_rope  # noqa: E402
from workers.kernels import kv_quant  # noqa: E402
from workers.kernels.kv_quant import dequantize_kv, qmax, rotates  # noqa: E402
from workers.attention.torch_backend import write_kv  # noqa: E402
from workers.kernels.act_mul import act_and_mul  # noqa: E402
from workers.kernels.fused_norm import rms_norm  # noqa: E402
from workers.kernels.rope_kv import rope_and_store  # noqa: E402
from workers.models.model_config import RopeScaling  # noqa: E402
from workers.models.gemma3 import GemmaRMSNorm  # noqa: E402
from workers.models.norm import RMSNorm  # noqa: E402
from workers.models.rotary import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


pytestmark = pytest.mark.usefixtures("rounding_bf16_as_gpus_do")


@pytest.fixture
def torch_only(monkeypatch):
    """The modules' reference path: torch's ops (no C kernel, no Triton)."""
    monkeypatch.setattr(norm_rope, "_functions", lambda: {})
    monkeypatch.setattr(kernels, "interpret_on_cpu", False)


def _norm(cls, n, dtype, seed):
    norm = cls(n, 1e-5)
    norm.weight.data = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return norm.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("n", [64, 96])  # 96: a row that is not a power of two
def test_fused_add_rms_norm_is_the_torch_path(torch_only, cls, dtype, n):
    gen = torch.Generator().manual_seed(n)
    norm = _norm(cls, n, dtype, n)
    x = (torch.randn(5, n, generator=gen) * 3).to(DEVICE, dtype)
    residual = torch.randn(5, n, generator=gen).to(DEVICE, dtype)
    want_sum = x + residual
    want = norm.torch_norm(want_sum)
    tol = TOLERANCE[dtype]
    # without a residual: the norm alone
    torch.testing.assert_close(rms_norm(x, norm.weight, 1e-5, gemma=cls.gemma),
                               norm.torch_norm(x), atol=tol, rtol=tol)
    got_x = x.clone()
    got, got_residual = rms_norm(got_x, norm.weight, 1e-5, residual, gemma=cls.gemma), got_x
    assert torch.equal(got_residual, want_sum)  # the sum, kept in x's buffer
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # the module dispatches to the kernel when told to, with the same contract as torch's
    torch_out, torch_residual = norm(x.clone(), residual)
    kernels.interpret_on_cpu = True
    kernel_out, kernel_residual = norm(x.clone(), residual)
    assert torch.equal(kernel_residual, torch_residual)
    torch.testing.assert_close(kernel_out, torch_out, atol=tol, rtol=tol)


def test_rms_norm_of_per_head_views(torch_only):
    """q/k norms take [T, H, D] views into the fused qkv output (rows not contiguous)."""
    norm = _norm(RMSNorm, 16, torch.float32, 0)
    qkv = torch.randn(3, 80).to(DEVICE)
    heads = qkv[:, 16:64].view(3, 3, 16)
    torch.testing.assert_close(rms_norm(heads, norm.weight, 1e-5), norm.torch_norm(heads),
                               atol=1e-5, rtol=1e-5)


def test_rms_norm_refuses_a_mismatched_residual():
    with pytest.raises(ValueError, match=r"residual \(3, 64\)"):
        rms_norm(torch.randn(2, 64), torch.ones(64), 1e-6, torch.randn(3, 64))
    with pytest.raises(ValueError, match=r"weight \(32,\)"):
        rms_norm(torch.randn(2, 64), torch.ones(32), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("inter", [96, 1100])  # 1100: a row over two programs, a partial one
def test_act_and_mul_is_the_torch_path(dtype, gelu, inter):
    gate_up = (torch.randn(3, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 3
               ).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(act_and_mul(gate_up, gelu), act * up, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match=r"shape \(3, 5\)"):
        act_and_mul(torch.randn(3, 5, device=DEVICE))


LLAMA3 = RopeScaling("llama3", 8.0, 1.0, 4.0, 256)


def _on_device(rot: RotaryEmbedding) -> RotaryEmbedding:
    rot.cos_sin_cache = rot.cos_sin_cache.to(DEVICE)
    return rot


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,scaling", [(32, None), (48, LLAMA3)])  # 48: half not 2^k
def test_rope_and_store_is_rotary_then_write_kv(torch_only, dtype, head_dim, scaling):
    gen = torch.Generator().manual_seed(head_dim)
    tokens, hq, hkv, block_size, blocks = 6, 4, 2, 4, 5
    rot = _on_device(RotaryEmbedding(head_dim, 512, 10000.0, scaling, dtype=dtype))
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim, generator=gen).to(DEVICE, dtype)
    q = qkv[:, :hq * head_dim].view(tokens, hq, head_dim)  # views, as the model passes them
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(tokens, hkv, head_dim)
    v = qkv[:, (hq + hkv) * head_dim:].view(tokens, hkv, head_dim)
    positions = torch.tensor([0, 1, 7, 300, 511, 42], device=DEVICE)
    slots = torch.tensor([3, 17, 0, 9, -1, 12], device=DEVICE)  # -1: not stored
    cache = torch.randn(2, blocks, block_size, hkv, head_dim, generator=gen).to(DEVICE, dtype)
    want_q, want_k = rot(positions, q, k)
    want_cache = cache.clone()
    keep = slots >= 0
    write_kv(want_cache, want_k[keep], v[keep], slots[keep])
    rope_and_store(positions, q, k, v, rot.cos_sin_cache, cache, slots)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(q, want_q, atol=tol, rtol=tol)  # rotated in place
    torch.testing.assert_close(k, want_k, atol=tol, rtol=tol)
    torch.testing.assert_close(cache, want_cache, atol=tol, rtol=tol)
    if dtype == torch.bfloat16 and DEVICE == "cpu":  # products rounded as torch's: bit for bit
        # (compiled on a GPU, a product may differ from torch's in a last bit: seen on an H200)
        assert torch.equal(q, want_q) and torch.equal(cache, want_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype,head_dim,rotated", [
    (torch.int8, 32, True), (torch.int8, 40, True),  # 40: rotated by 8s
    (torch.float8_e4m3fn, 32, True),  # int8 keys, e4m3 values
    (torch.int8, 32, False), (torch.float8_e4m3fn, 32, False)])  # the earlier formats
def test_rope_and_store_quantizes_into_an_8_bit_cache_as_write_kv_does(
        torch_only, monkeypatch, dtype, cache_dtype, head_dim, rotated):
    """Each head's values by its absolute maximum and the fp32 scale after them
    (`workers.kernels.kv_quant`: rows Hadamard-rotated first, an fp8 cache's keys in int8), what
    the torch path stores: byte for byte, or a rounding apart where sums may run in another
    order. Unrotated (all-e4m3 for fp8): the formats `benchmarks/quality.py` compares against."""
    if not rotated:
        monkeypatch.setattr(kv_quant, "ROTATED_DTYPES", frozenset())
        monkeypatch.setattr(kv_quant, "KEY_DTYPES", {})
    gen = torch.Generator().manual_seed(3)
    tokens, hq, hkv, block_size = 5, 4, 2, 4
    rot = _on_device(RotaryEmbedding(head_dim, 64, 10000.0, None, dtype=dtype))
    q = torch.randn(tokens, hq, head_dim, generator=gen).to(dtype)
    k = (torch.randn(tokens, hkv, head_dim, generator=gen) * 3).to(dtype)
    v = torch.randn(tokens, hkv, head_dim, generator=gen).to(dtype)
    v[1, 0] = 0.0  # an all-zero head: the smallest scale, zeros stored
    v[2, 1, :4] = torch.tensor([2.5, -2.5, 0.5, 127.0]) / 127.0 * 2.0  # values on a .5 tie
    q, k, v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    positions = torch.tensor([0, 5, 9, 33, 60], device=DEVICE)
    slots = torch.tensor([2, 7, -1, 0, 13], device=DEVICE)
    cache = torch.zeros(2, 4, block_size, hkv, head_dim + 16, dtype=cache_dtype, device=DEVICE)
    want_cache = cache.clone()
    want_q, want_k = rot(positions, q.clone(), k.clone())
    keep = slots >= 0
    write_kv(want_cache, want_k[keep], v[keep], slots[keep])
    rope_and_store(positions, q, k, v, rot.cos_sin_cache, cache, slots)
    assert kv_quant.plane_views(cache)[0].dtype == kv_quant.key_dtype(cache_dtype)
    if dtype == torch.bfloat16 and DEVICE == "cpu" and not rotates(cache_dtype):
        # RoPE rounds as torch's: bit for bit (a row's Hadamard rotation sums in another order
        # than torch's matmul: a rounding apart, below)
        assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
    else:  # rotations may differ in a last bit (fp32; bf16 compiled), and so may a scale and a
        # quantized value: at most a rounding apart
        for got_plane, want_plane in zip(kv_quant.plane_views(cache),
                                         kv_quant.plane_views(want_cache)):
            got, want = (dequantize_kv(c, torch.float32) for c in (got_plane, want_plane))
            scale = want.abs().amax(-1, keepdim=True) / qmax(want_plane.dtype)
            # one step of the format: int8's is the scale; e4m3's an eighth of the value (2^-9
            # scales below 2^-6)
            step = scale if want_plane.dtype == torch.int8 else want.abs() / 8 + scale * 2 ** -9
            assert ((got - want).abs() <= step * 1.01).all()
    with pytest.raises(ValueError, match=r"D \+ 16 when 8-bit"):  # the scale's room is missing
        rope_and_store(positions, q, k, v, rot.cos_sin_cache, cache[..., :head_dim], slots)


def test_rope_and_store_refuses_a_cache_of_another_dtype():
    rot = RotaryEmbedding(16, 8, 10000.0, None, dtype=torch.float32)
    q, k = torch.randn(1, 2, 16).bfloat16(), torch.randn(1, 1, 16).bfloat16()
    cache = torch.zeros(2, 1, 4, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="share a dtype"):
        rope_and_store(torch.tensor([0]), q, k, k.clone(), rot.cos_sin_cache, cache,
                       torch.tensor([0]))


def test_the_layers_share_one_rope_cache():
    a = RotaryEmbedding(16, 64, 10000.0, LLAMA3, dtype=torch.bfloat16)
    b = RotaryEmbedding(16, 64, 10000.0, LLAMA3, dtype=torch.bfloat16)
    other = RotaryEmbedding(16, 64, 20000.0, LLAMA3, dtype=torch.bfloat16)
    assert a.cos_sin_cache is b.cos_sin_cache
    assert other.cos_sin_cache is not a.cos_sin_cache
    assert a.cos_sin_cache.dtype == torch.bfloat16 and a.cos_sin_cache.shape == (64, 16)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])  # qwen3, gemma3: q/k norms
def test_greedy_tokens_through_the_fused_kernels_are_the_torch_backends(
        tmp_path, monkeypatch, arch):
    from workers.engine.llm import LLM
    from workers.models.make_model import make_model
    from workers.contract.protocol import SamplingParams

    path = str(make_model(tmp_path, arch=arch, preset="tiny"))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [list(range(1, 21)), [7, 3, 9]]

    def generate(backend: str) -> list[list[int]]:
        llm = LLM(path, attention_backend=backend, num_blocks=32, max_num_batched_tokens=16)
        return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]

    want = generate("torch")
    monkeypatch.setattr(kernels, "interpret_on_cpu", True)  # the norms' Triton kernel too
    assert generate("triton") == want
