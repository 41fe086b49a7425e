"""Rotary position embeddings (RoPE), as transformers' `modeling_rope_utils` computes them:
default, linear, Llama 3 and YaRN frequency scaling, and per-frequency divisors (GGUF files'
Llama 3 scaling)."""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from workers.kernels import norm_rope
from workers.models.model_config import RopeScaling


def compute_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim // 2] fp32, as transformers' `modeling_rope_utils`."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, inv_freq)
    if scaling.rope_type == "freq_factors" and scaling.freq_factors is not None:
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    if scaling.rope_type != "llama3":
        raise ValueError(f"unsupported rope type {scaling.rope_type!r}")
    factor = scaling.factor
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    old_context_len = scaling.original_max_position_embeddings
    if low is None or high is None or old_context_len is None:
        raise ValueError(f"llama3 RoPE scaling {scaling}; expected low_freq_factor, "
                         "high_freq_factor and original_max_position_embeddings")
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: RopeScaling,
                   inv_freq: torch.Tensor) -> torch.Tensor:
    """Extrapolated (unscaled) frequencies for the fast dimensions, interpolated (divided by
    the factor) for the slow ones, with a linear ramp between the correction range's bounds."""
    original = scaling.original_max_position_embeddings or 0

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast or 32), correction_dim(scaling.beta_slow or 1)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    interpolated = 1.0 / (scaling.factor * pos_freqs)
    return interpolated * (1 - extrapolation) + inv_freq * extrapolation


_SHARED_CACHES: weakref.WeakValueDictionary[tuple, torch.Tensor] = weakref.WeakValueDictionary()


def cos_sin_cache(head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[max_position, head_dim]: cos of each position's angles in the first head_dim / 2
    columns, sin in the rest, computed in fp32 like transformers (YaRN's attention factor
    applied), then rounded to `dtype` as transformers rounds them before use. One tensor per
    distinct (shape, RoPE settings, dtype, device), shared by every layer that asks while any
    holds it."""
    key = (head_dim, max_position, theta, scaling, dtype, str(device))
    cache = _SHARED_CACHES.get(key)
    if cache is None:
        # computed on CPU in fp32 like HF, then moved
        inv_freq = compute_inv_freq(head_dim, theta, scaling)  # [head_dim // 2]
        positions = torch.arange(max_position, dtype=torch.int64, device="cpu").float()
        freqs = positions[:, None] * inv_freq  # [max_position, head_dim // 2]
        # YaRN multiplies cos and sin by its attention factor (1 for the other kinds)
        factor = scaling.attention_factor if scaling is not None else 1.0
        both = torch.cat((freqs.cos() * factor, freqs.sin() * factor), dim=-1)
        cache = _SHARED_CACHES[key] = both.to(dtype=dtype, device=device)
    return cache


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate_half) RoPE from a cos/sin cache for every position, in the model's
    dtype (the default dtype at construction) and shared with the layers of the same settings
    (`cos_sin_cache`)."""

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """`dtype`: the cache's (the model's); None: the default dtype, which the loader sets
        to the model's while building it."""
        super().__init__()
        self.head_dim, self.max_position = head_dim, max_position
        # a plain attribute, not a buffer: one tensor for every layer, never copied per module
        self.cos_sin_cache = cos_sin_cache(head_dim, max_position, theta, scaling,
                                           dtype or torch.get_default_dtype(),
                                           torch.get_default_device())

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D] -> same shapes, rotated
        q_out = norm_rope.rope(positions, q, self.cos_sin_cache)  # C, on the CPU
        if q_out is not None:
            k_out = norm_rope.rope(positions, k, self.cos_sin_cache)
            if k_out is not None:
                return q_out, k_out
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, D / 2]
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def rotate_qk(self, positions: torch.Tensor, qk: torch.Tensor,
                  num_q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, k) rotated, from one [T, Hq + Hkv, D] view of both (adjacent in the fused
        projection's output): one kernel call on the CPU, where `forward` makes two."""
        out = norm_rope.rope(positions, qk, self.cos_sin_cache)
        if out is None:
            return self(positions, qk[:, :num_q_heads], qk[:, num_q_heads:])
        return out[:, :num_q_heads], out[:, num_q_heads:]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
