"""The CPU norm/rope kernel (`workers/kernels/norm_rope.py`): torch's results (bf16 bit for bit, fp32 to
rounding), from views into the fused qkv output, refusing what it does not take (the model then
uses torch), and out-of-range positions refused before anything is written."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.kernels import norm_rope
from workers.models.norm import RMSNorm
from workers.models.rotary import RotaryEmbedding, _rotate_half

pytestmark = pytest.mark.skipif(not norm_rope.available(),
                                reason="no C compiler here to build the norm/rope kernel")


def torch_norm(x, w, eps):
    if x.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w, eps)
    return w * F.rms_norm(x.float(), w.shape, None, eps).to(x.dtype)


def torch_rope(rot, positions, x):
    cos, sin = rot.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


@pytest.mark.parametrize("rows", [1, 3, 130])  # 130: split over threads
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_torchs(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 520, generator=gen) * 4).to(dtype)
    w = torch.randn(520, generator=gen).to(dtype)
    got = norm_rope.rms_norm(x, w, 1e-5)
    want = torch_norm(x, w, 1e-5)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-6)


def test_rms_norm_reads_strided_rows_and_heads():
    """Rows of a wider buffer (a view), and per-head [T, H, D] input (Qwen3's q/k norms)."""
    wide = torch.randn(4, 96)
    w = torch.randn(64)
    torch.testing.assert_close(norm_rope.rms_norm(wide[:, :64], w, 1e-6),
                               torch_norm(wide[:, :64], w, 1e-6), atol=2e-6, rtol=1e-6)
    heads = torch.randn(3, 5, 64)
    got = norm_rope.rms_norm(heads, w, 1e-6)
    assert got.shape == heads.shape
    torch.testing.assert_close(got, torch_norm(heads, w, 1e-6), atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_of_qkv_views_is_torchs(dtype):
    rot = RotaryEmbedding(64, 2048, 10000.0, None, dtype=dtype)  # the cache in the model's dtype
    assert rot.cos_sin_cache.dtype == dtype
    tokens = 70  # over the threading threshold
    qkv = torch.randn(tokens, 16 * 64, dtype=dtype)
    q = qkv[:, :8 * 64].reshape(tokens, 8, 64)
    k = qkv[:, 8 * 64:12 * 64].reshape(tokens, 4, 64)
    positions = torch.randint(0, 2048, (tokens,))
    got_q, got_k = rot(positions, q, k)
    for got, x in ((got_q, q), (got_k, k)):
        want = torch_rope(rot, positions, x)
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_a_position_past_the_cache_is_refused_before_any_write():
    rot = RotaryEmbedding(16, 32, 10000.0, None)
    x = torch.randn(2, 1, 16)
    with pytest.raises(IndexError, match="outside the rotary cache's 32"):
        norm_rope.rope(torch.tensor([3, 32]), x, rot.cos_sin_cache)


def test_what_the_kernel_does_not_take_is_left_to_torch():
    w16 = torch.randn(64, dtype=torch.float16)
    assert norm_rope.rms_norm(torch.randn(2, 64, dtype=torch.float16), w16, 1e-6) is None
    assert norm_rope.rms_norm(torch.randn(2, 64), w16, 1e-6) is None  # dtypes differ
    rot = RotaryEmbedding(16, 32, 10000.0, None)
    assert norm_rope.rope(torch.tensor([1]), torch.randn(1, 2, 16).half(),
                          rot.cos_sin_cache) is None
    assert norm_rope.rope(torch.tensor([1], dtype=torch.int32), torch.randn(1, 2, 16),
                          rot.cos_sin_cache) is None
    # a cache in another dtype than x's
    assert norm_rope.rope(torch.tensor([1]), torch.randn(1, 2, 16).bfloat16(),
                          rot.cos_sin_cache) is None
    # and the modules still compute them, through torch
    norm = RMSNorm(64)
    norm.weight.data = w16
    x = torch.randn(2, 64, dtype=torch.float16)
    assert torch.equal(norm(x), w16 * F.rms_norm(x.float(), (64,), None, 1e-6).half())


def test_the_modules_use_torch_when_the_kernel_is_unavailable(monkeypatch):
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    rot = RotaryEmbedding(64, 128, 10000.0, None)
    x, q, k = torch.randn(3, 64), torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    positions = torch.tensor([0, 9, 127])
    with_kernel = norm(x), *rot(positions, q, k)
    monkeypatch.setattr(norm_rope, "available", lambda: False)
    without = norm(x), *rot(positions, q, k)
    for a, b in zip(with_kernel, without, strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-6)
