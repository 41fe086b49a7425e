"""Many rows over int8/int4 weights packed for the VNNI kernels: `QuantizedMatmul` unpacks the
weight to bf16 (`workers/kernels/csrc/int_dequant.c`) and runs a bf16 matmul from `UNPACK_ROWS` rows on.
The unpacked rows are the weight's values (int8 exactly, int4 rounded once to bf16), the matmul
equals a dequantize-then-fp32 reference within what bf16 rounding allows, and an engine's greedy
tokens are those of the VNNI kernels alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers import LLM, SamplingParams
from workers.kernels import int_gemm as int_kernels
from workers.quant.linear import UNPACK_ROWS, QuantizedMatmul

pytestmark = pytest.mark.skipif(not int_kernels.dequant_available(),
                                reason="unpacking to bf16 needs AVX-512 BF16 and AMX")
N, K = 202, 256  # N not a multiple of the 4-row tiles: a padded last tile


def weight(bits: int, group: int | None, zeros: bool, seed: int = 0):
    """(q, scales, zeros) as a checkpoint holds them, and the fp32 weight they stand for."""
    g = torch.Generator().manual_seed(seed)
    groups = K // (group or K)
    top = 8 if bits == 4 else 128
    q = torch.randint(-top + (bits == 8), top, (N, K), dtype=torch.int8, generator=g)
    s = torch.rand(N, groups, generator=g) * 0.01 + 1e-3
    z = torch.randint(-2, 3, (N, groups), generator=g).float() if zeros \
        else torch.zeros(N, groups)
    w = (q.float() - z.repeat_interleave(K // groups, 1)) * s.repeat_interleave(K // groups, 1)
    return (q, s, z), w


def layer(bits: int, group: int | None, zeros: bool) -> tuple[nn.Module, torch.Tensor]:
    (q, s, z), w = weight(bits, group, zeros)
    module = nn.Module()
    for name, t in (("qweight", q), ("scales", s), ("zeros", z)):
        module.register_parameter(name, nn.Parameter(t, requires_grad=False))
    module.matmul = QuantizedMatmul("int8" if bits == 8 else "int4")
    module.matmul.pack(module)
    return module, w


def test_unpacked_rows_are_the_weights_values():
    (q, _, _), _ = weight(8, None, False)
    blocked = int_kernels.block_int8(q)
    assert torch.equal(int_kernels.unpack_int8(blocked, N, K).float(), q.float())
    assert torch.equal(int_kernels.unpack_int8(blocked, N, K, 8, N - 1).float(), q[8:-1].float())
    for group in (32, 128):
        for zeros in (False, True):
            (q, s, z), w = weight(4, group, zeros)
            got = int_kernels.unpack_int4(int_kernels.block_int4(q, s, z), N, K, group, 4, N)
            # u s - (8 + z) s by one fused multiply-add, then rounded: the symmetric weights
            # round to w's bf16 exactly, with zeros at most one bf16 step off (where q = z,
            # fp32's rounding of the offset leaves a few 1e-10 rather than 0)
            step = 2.0 ** -8 * w[4:].abs() + 1e-8
            assert ((got.float() - w[4:].to(torch.bfloat16).float()).abs() <= step).all()
            if not zeros:
                assert torch.equal(got, w[4:].to(torch.bfloat16))


CASES = [(8, None, False), (8, None, True), (4, 32, False), (4, 32, True), (4, 128, False),
         (4, 128, True)]


@pytest.mark.parametrize("bits, group, zeros", CASES)
@pytest.mark.parametrize("more", [0, 77])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_match_the_dequantized_fp32_matmul(bits, group, zeros, more, dtype,
                                                     monkeypatch):
    """At the threshold and past it."""
    module, w = layer(bits, group, zeros)
    rows = UNPACK_ROWS[module.matmul.kernel] + more
    for name in ("int8_gemm", "int4_gemm"):  # from UNPACK_ROWS rows the VNNI kernels stay idle
        monkeypatch.setattr(int_kernels, name, None)
    x = torch.randn(rows, K).to(dtype)
    got = module.matmul(module, x, torch.float32)
    want = x.double() @ w.double().t()
    # x and (int4) the weight rounded to bf16, each off by at most 2^-9 of itself, so each
    # product by at most 2^-8 of |x_k w_k|; the result rounded to bf16: 2^-9 of |y| (fp32
    # accumulation over 256 columns adds orders of magnitude less)
    bound = 2.0 ** -8 * (x.double().abs() @ w.double().abs().t()) + 2.0 ** -8 * want.abs()
    assert ((got.double() - want).abs() <= bound).all()
    assert module.matmul(module, x).dtype == dtype


@pytest.mark.parametrize("bits, group, zeros", CASES[1:4])
def test_unpacking_in_chunks_of_rows_gives_the_whole_weights_result(bits, group, zeros,
                                                                    monkeypatch):
    module, _ = layer(bits, group, zeros)
    x = torch.randn(2 * UNPACK_ROWS[module.matmul.kernel], K)
    whole = module.matmul(module, x)
    monkeypatch.setattr(int_kernels, "UNPACK_CHUNK_BYTES", 64 * 2 * K)  # 64 rows a chunk
    torch.testing.assert_close(module.matmul(module, x), whole, rtol=0, atol=0)


def test_fewer_rows_stay_on_the_vnni_kernels():
    module, _ = layer(4, 32, True)
    x = torch.randn(UNPACK_ROWS["int4"] - 1, K)
    blocked = (module.qweight, module.scales, module.offsets)
    assert torch.equal(module.matmul(module, x), int_kernels.int4_gemm(x, blocked, N, 32))
    module, _ = layer(8, None, False)
    x = torch.randn(UNPACK_ROWS["int8"] - 1, K)
    assert torch.equal(module.matmul(module, x),
                       int_kernels.int8_gemm(x, module.qweight, module.scales_f32))


def _greedy(path: str, unpack: bool | None) -> list[list[int]]:
    """36 prompts of 40 tokens (prefills past UNPACK_ROWS; int4: 36-stream decode steps) with the
    weights packed (`unpack`: whether from UNPACK_ROWS rows on) or dequantized (None)."""
    llm = LLM(path, num_blocks=512, block_size=16, dtype="float32",
              fp32_int_kernels=unpack is not None)
    matmuls = [m.matmul for m in llm.engine.runner.executor.model.modules()
               if isinstance(getattr(m, "matmul", None), QuantizedMatmul)]
    assert bool(matmuls) == (unpack is not None)
    for m in matmuls:
        assert m.unpack_rows == UNPACK_ROWS[m.kernel]
        m.unpack_rows = UNPACK_ROWS[m.kernel] if unpack else None
    prompts = [[(7 * i + 3 * j) % 200 + 3 for j in range(40)] for i in range(36)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _agreeing(got: list[list[int]], want: list[list[int]]) -> int:
    """Tokens before each sequence's first difference, summed."""
    count = 0
    for a, b in zip(got, want):
        count += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return count


@pytest.mark.parametrize("bits, group", [(8, None), (4, 32)])
def test_engine_greedy_tokens_stay_as_close_to_the_dequantized_fp32_models(bits, group,
                                                                            tiny_model, tmp_path):
    """bf16 activations are finer than the VNNI kernels' int8 blocks, so the tiny model's greedy
    tokens follow the dequantized fp32 model's at least as far (measured: int8 489 of 576
    tokens against 487, int4 502 against 499); near-ties make some differ either way."""
    from workers.quant.writer import quantize_checkpoint

    path = str(quantize_checkpoint(tiny_model, tmp_path / "q", "compressed-tensors", bits=bits,
                                   group_size=group, lm_head=True))
    want = _greedy(path, None)
    unpacked, vnni = _greedy(path, True), _greedy(path, False)
    assert _agreeing(unpacked, want) >= _agreeing(vnni, want) >= 0.8 * 36 * 16
