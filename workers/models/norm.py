"""RMS normalization as HF's LlamaRMSNorm computes it, with vLLM's fused residual add: Triton on
CUDA, one C call on the CPU (`workers.kernels.norm_rope`), torch's ops otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels import norm_rope, use_triton
from workers.models.layers import _make_param, default_weight_loader


class RMSNorm(nn.Module):
    """RMS normalization computed in fp32 then cast back, exactly as HF's LlamaRMSNorm.
    `norm(x)`: the normed x; `norm(x, residual)`: vLLM's fused add, (norm(x + residual), x +
    residual), the sum written into x's buffer (the caller's fresh sublayer output). On CUDA
    one Triton kernel does either (`workers.kernels.fused_norm`); the CPU's is C (norm_rope)."""

    gemma = False  # scale by 1 + weight (GemmaRMSNorm)

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _make_param((hidden_size,), default_weight_loader)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x: [num_tokens, hidden] (or [T, heads, head_dim] without a residual)
        if use_triton(x):
            from workers.kernels.fused_norm import rms_norm

            out = rms_norm(x, self.weight, self.eps, residual, self.gemma)
            return out if residual is None else (out, x)
        if residual is None:
            return self.torch_norm(x)
        x = x.add_(residual)  # in place, in the sublayer's fresh output
        return self.torch_norm(x), x

    def torch_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The normed x off CUDA: the C kernel on the CPU, else torch's ops."""
        out = norm_rope.rms_norm(x, self.weight, self.eps)  # one C call on the CPU
        if out is not None:
            return out
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one pass
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # normalized in fp32 (one fused op), rounded to x's dtype, then scaled, as HF does
        normed = F.rms_norm(x.to(torch.float32), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)
