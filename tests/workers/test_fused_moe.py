"""The fused MoE kernels (`workers.kernels.fused_moe`) against the expert loop they replace on
GPUs, in Triton's interpreter on CPU: SwiGLU and gpt-oss's clamped SwiGLU with biases, fp32 and
bf16, weighted and unweighted, steps of 1, 7 and 100 tokens, an expert that gets no token."""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
pytest.importorskip("triton", reason="the fused MoE kernels need the triton package")

from tests.workers.interpreter_rounding import rounding_bf16_as_gpus_do  # noqa: E402,F401
from workers import kernels
from workers.kernels import host_transfer  # noqa: E402
from workers.kernels.fused_moe import align_by_expert, fused_moe  # noqa: E402
from workers.models.layers import Shard  # noqa: E402
from workers.models.moe import FusedExperts, route  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


pytestmark = pytest.mark.usefixtures("rounding_bf16_as_gpus_do")


def _experts(bias: bool, dtype: torch.dtype, seed: int) -> FusedExperts:
    torch.manual_seed(seed)
    experts = FusedExperts(4, 64, 32, Shard(), None, bias=bias,
                           clamped_swiglu=(1.702, 7.0) if bias else None)
    for param in experts.parameters():
        param.data.normal_(std=0.1)  # outputs of order 1
    return experts.to(device=DEVICE, dtype=dtype)


def _loop(experts: FusedExperts, x: torch.Tensor, ids: torch.Tensor,
          weights: torch.Tensor | None) -> torch.Tensor:
    """The reference: the expert loop, on CPU copies (on a GPU, run_local is the kernel)."""
    cpu = copy.deepcopy(experts).cpu()
    return cpu.run_local(x.cpu(), ids.cpu(), None if weights is None else weights.cpu()).to(
        x.device)


def _routing(tokens: int, top_k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, 4)
    logits[:, 3] = -1e4  # expert 3 gets no token
    ids, weights = route(logits, top_k, normalize=True)
    return ids.to(DEVICE), weights.to(DEVICE)


def test_alignment_pads_each_experts_group_to_whole_blocks():
    ids = torch.tensor([[2, 0], [0, 2], [2, 1]])  # pairs 0..5: experts 2 0 0 2 2 1
    sorted_ids, block_expert, total = align_by_expert(ids, 4, 4)
    assert total.tolist() == [12]  # experts 0, 1, 2: one block of 4 each; expert 3: none
    assert sorted_ids[:12].tolist() == [1, 2, 6, 6, 5, 6, 6, 6, 0, 3, 4, 6]
    assert (sorted_ids[12:] == 6).all()
    assert sorted_ids.numel() == 20  # worst case 6 + 4 * 3, rounded up to whole blocks
    assert block_expert[:3].tolist() == [0, 1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True], ids=["swiglu", "gpt_oss"])
@pytest.mark.parametrize("tokens", [1, 7, 100])
def test_fused_moe_is_the_expert_loop(tokens, bias, dtype):
    experts = _experts(bias, dtype, tokens)
    x = torch.randn(tokens, 64).to(device=DEVICE, dtype=dtype)
    ids, weights = _routing(tokens)
    want = _loop(experts, x, ids, weights)
    got = fused_moe(x, experts.w13_weight, experts.w2_weight, ids, weights, experts.w13_bias,
                    experts.w2_bias, experts.clamped_swiglu)
    tol = TOLERANCE[dtype]
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # unweighted, one expert per row (the expert-parallel form)
    torch.testing.assert_close(fused_moe(x, experts.w13_weight, experts.w2_weight, ids[:, :1],
                                         None, experts.w13_bias, experts.w2_bias,
                                         experts.clamped_swiglu),
                               _loop(experts, x, ids[:, :1], None), atol=tol, rtol=tol)


def test_run_local_takes_the_fused_kernel_on_gpu_paths(monkeypatch):
    """On a GPU (simulated) with Triton, a step of any size runs the fused kernel; without the
    simulation the CPU loop runs."""
    experts = _experts(False, torch.float32, 0)
    x = torch.randn(100, 64, device=DEVICE)
    ids, weights = _routing(100)
    want = _loop(experts, x, ids, weights)
    calls = []
    from workers.kernels import fused_moe as module

    real = module.fused_moe
    monkeypatch.setattr(module, "fused_moe", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(kernels, "interpret_on_cpu", True)
    experts.run_local(x, ids, weights)
    assert calls == ([1] if DEVICE == "cuda" else [])
    with host_transfer.simulate_gpu_paths():
        got = experts.run_local(x, ids, weights)
    assert len(calls) == 1 + (DEVICE == "cuda")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
