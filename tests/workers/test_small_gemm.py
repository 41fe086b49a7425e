"""The CPU small-batch matmul kernel against torch, and the layers that carry it."""

from __future__ import annotations

import pytest
import torch

from workers import LLM
from workers.kernels import small_gemm as small_gemm_module
from workers.kernels.small_gemm import SmallBatchMatmul, small_gemm, small_gemm_bf16_dot


@pytest.mark.parametrize("n, k", [(64, 128), (37, 100), (5, 17), (130, 48), (1001, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_matches_torch_for_every_row_count(n, k, dtype):
    """(1001 rows: threads take chunks of rows as they ask, chunks of shrinking size and a
    short last one.)"""
    torch.manual_seed(n * k)
    w = torch.randn(n, k).to(dtype)
    for m in (1, 2, 3, 4, 5, 8, 9, 17):
        x = torch.randn(m, k)
        want = x @ w.float().t()
        one = small_gemm(x, w, num_threads=1)
        torch.testing.assert_close(one, want, rtol=1e-5, atol=1e-5)
        for threads in (2, 3):  # each output is one thread's: the same bits on any count
            assert torch.equal(small_gemm(x, w, num_threads=threads), one)


@pytest.mark.skipif(not small_gemm_module.has_bf16_dot(), reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize("n, k", [(64, 128), (37, 100), (5, 17), (130, 48)])
def test_bf16_activations_times_bf16_weights_by_dot_products(n, k):
    """Each product of two bf16 is exact in fp32: the result is the exact dot product up to fp32
    sums; any thread count gives the same bits; a bf16 layer of a few rows goes this way."""
    torch.manual_seed(n + k)
    w = torch.randn(n, k).bfloat16()
    for m in (1, 2, 3, 4, 5, 9):
        x = torch.randn(m, k).bfloat16()
        want = (x.double() @ w.double().t()).float()
        one = small_gemm_bf16_dot(x, w, num_threads=1)
        torch.testing.assert_close(one, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(small_gemm_bf16_dot(x, w, num_threads=2), one)
    layer = torch.nn.Linear(k, n, bias=False).bfloat16()
    layer.weight.data = w
    x = torch.randn(1, k).bfloat16()
    assert torch.equal(SmallBatchMatmul(torch.bfloat16)(layer, x),
                       small_gemm_bf16_dot(x, w).bfloat16())


def test_bad_operands_are_named():
    with pytest.raises(ValueError, match="fp32 x \\[M, K\\] and fp32/bf16 w \\[N, K\\]"):
        small_gemm(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="bf16 x \\[M, K\\] and bf16 w \\[N, K\\]"):
        small_gemm_bf16_dot(torch.randn(2, 8), torch.randn(4, 8).bfloat16())


def test_layers_on_the_cpu_carry_it_and_hand_many_rows_to_torch(tiny_model):
    model = LLM(tiny_model, num_blocks=16).engine.runner.executor.model
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer.matmul, SmallBatchMatmul)
    assert isinstance(model.lm_head.matmul, SmallBatchMatmul)
    for rows in (1, 16, 17, 40):  # the kernel up to 16 fp32 rows, torch's linear beyond
        x = torch.randn(rows, layer.weight.shape[1])
        torch.testing.assert_close(layer(x), x @ layer.weight.t(), rtol=1e-5, atol=1e-5)
    bf16 = LLM(tiny_model, dtype="bfloat16", num_blocks=16).engine.runner.executor.model
    bf16_rows = 8 if small_gemm_module.has_bf16_dot() else 2  # dot products, or widening
    assert bf16.model.layers[0].mlp.down_proj.matmul.max_rows == bf16_rows


def _reference_mlp(x, w_gate_up, w_down, gelu):
    gate, up = (x.double() @ w_gate_up.double().t()).chunk(2, dim=-1)
    act = torch.nn.functional.gelu(gate, approximate="tanh") if gelu else torch.nn.functional.silu(
        gate)
    return ((act * up) @ w_down.double().t()).float()


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("hidden, inter", [(64, 128), (48, 37), (130, 260)])
def test_the_fused_mlp_matches_its_two_matmuls_and_any_thread_count(hidden, inter, gelu):
    torch.manual_seed(hidden + inter)
    w_gate_up, w_down = torch.randn(2 * inter, hidden) / 8, torch.randn(hidden, inter) / 8
    for m in (1, 2, 3, 5, 8):
        x = torch.randn(m, hidden)
        one = small_gemm_module.small_mlp(x, w_gate_up, w_down, gelu, num_threads=1)
        torch.testing.assert_close(one, _reference_mlp(x, w_gate_up, w_down, gelu),
                                   rtol=1e-4, atol=1e-4)
        for threads in (2, 3):
            assert torch.equal(
                small_gemm_module.small_mlp(x, w_gate_up, w_down, gelu, num_threads=threads),
                one)
    with pytest.raises(ValueError, match="w_gate_up \\[2I, H\\] and w_down \\[H, I\\]"):
        small_gemm_module.small_mlp(x, w_down, w_down, gelu)
    with pytest.raises(ValueError, match="contiguous w_gate_up and w_down"):
        small_gemm_module.small_mlp(x, w_gate_up, w_down.t().contiguous().t(), gelu)


@pytest.mark.parametrize("gelu", [False, True])
def test_act_and_mul_is_the_fused_mlps_middle_on_any_thread_count(gelu):
    """The packed MLP's activation product (`act_and_mul`): the fused MLP's own arithmetic."""
    torch.manual_seed(7)
    hidden, inter = 64, 200
    w_gate_up, w_down = torch.randn(2 * inter, hidden) / 8, torch.randn(hidden, inter) / 8
    for m in (1, 3, 8):
        x = torch.randn(m, hidden)
        gate_up = small_gemm(x, w_gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        torch_act = (torch.nn.functional.gelu(gate, approximate="tanh") if gelu
                     else torch.nn.functional.silu(gate)) * up
        before = torch.get_num_threads()
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got = small_gemm_module.act_and_mul(gate_up, gelu)
            torch.set_num_threads(before)
            torch.testing.assert_close(got, torch_act, rtol=1e-5, atol=1e-6)
            assert torch.equal(small_gemm(got, w_down),
                               small_gemm_module.small_mlp(x, w_gate_up, w_down, gelu))


def test_fp32_mlps_on_the_cpu_take_the_fused_kernel_for_a_few_rows(tiny_model):
    model = LLM(tiny_model, num_blocks=16).engine.runner.executor.model
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.small_batch, small_gemm_module.SmallBatchMLP)
    limit = small_gemm_module.MAX_ROWS[torch.float32]
    for rows in (1, 8, limit, limit + 1, 40):  # fused up to the limit, one by one beyond
        x = torch.randn(rows, mlp.down_proj.weight.shape[0])
        torch.testing.assert_close(
            mlp(x), _reference_mlp(x, mlp.gate_up_proj.weight, mlp.down_proj.weight, mlp.gelu),
            rtol=1e-4, atol=1e-4)
    bf16 = LLM(tiny_model, dtype="bfloat16", num_blocks=16).engine.runner.executor.model
    assert bf16.model.layers[0].mlp.small_batch is None  # bf16: the projections' own kernels
