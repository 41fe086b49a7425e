"""GPTQ (`workers.quant.gptq`, `cleave quantize --calibrate`): integers chosen with error
compensation give a smaller layer output error on the calibration inputs than round-to-nearest
(per output channel or per group of input columns, with or without zero points), and the
checkpoint it writes is the ordinary int8 GPTQ / compressed-tensors layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from workers.quant.formats import decode
from workers.quant.gptq import builtin_calibration, checkpoint_hessians, gptq_quantize
from workers.quant.scheme import parse_quantization
from workers.quant.weights import quantize_int


def _output_error(w: torch.Tensor, wq: torch.Tensor, h: torch.Tensor) -> float:
    d = (w - wq).double()
    return float(torch.einsum("nk,kl,nl->", d, h.double(), d))


def _rtn(w: torch.Tensor, scale_dtype: torch.dtype, group_size: int | None = None,
         symmetric: bool = True) -> torch.Tensor:
    """Round-to-nearest with the scales rounded as stored: GPTQ's baseline on equal scales."""
    weight = quantize_int(w, 8, group_size, symmetric)
    scales = weight.scales.to(scale_dtype).float()[:, weight.groups()]
    zeros = weight.zeros[:, weight.groups()]
    return (torch.round(w / scales + zeros).clamp(-128, 127) - zeros) * scales


@pytest.mark.parametrize("act_order,group_size,symmetric", [
    (False, None, True), (True, None, True), (False, 32, True), (False, 32, False)])
def test_gptq_halves_the_output_error_of_round_to_nearest(act_order: bool,
                                                          group_size: int | None,
                                                          symmetric: bool) -> None:
    # correlated inputs (as a layer's activations are): compensation has something to use
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 48, generator=gen) @ torch.randn(48, 96, generator=gen)
    w = torch.randn(40, 96, generator=gen)
    h = x.double().T @ x.double()
    got = gptq_quantize(w, h, 8, act_order=act_order, scale_dtype=torch.float16, block=32,
                        group_size=group_size, symmetric=symmetric)
    assert got.q.dtype == torch.int8 and got.scales.shape == (40, 96 // (group_size or 96))
    assert torch.equal(got.scales, got.scales.half().float())  # exactly what fp16 stores
    assert bool((got.zeros == 0).all()) == symmetric
    # without the error folded forward, GPTQ is round-to-nearest: the ratio would be 1
    ratio = _output_error(w, got.dequantize(), h) / _output_error(
        w, _rtn(w, torch.float16, group_size, symmetric), h)
    assert ratio < 0.6, ratio


def test_gptq_rejects_a_hessian_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="expected \\[8, 8\\]"):
        gptq_quantize(torch.randn(4, 8), torch.eye(6))


@pytest.mark.parametrize("fmt,group_size", [("gptq", None), ("compressed-tensors", None),
                                             ("compressed-tensors", 32)])
def test_calibrated_checkpoint_beats_round_to_nearest(tiny_model: str, tmp_path: Path,
                                                      fmt: str, group_size: int | None) -> None:
    from workers.quant.writer import quantize_checkpoint

    text = builtin_calibration()[:4]
    out = quantize_checkpoint(tiny_model, tmp_path / fmt, fmt, calibration=text, bits=8,
                              group_size=group_size, symmetric=True)
    scheme = parse_quantization(json.loads((out / "config.json").read_text()))
    assert scheme is not None and scheme.bits == 8 and scheme.group_size == group_size
    written = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    source = {k: v for f in Path(tiny_model).glob("*.safetensors")
              for k, v in load_file(str(f)).items()}
    hessians = checkpoint_hessians(tiny_model, text)
    scale_dtype = torch.float16 if fmt == "gptq" else torch.bfloat16
    ratios = []
    for prefix, h in hessians.items():
        if prefix == "lm_head":
            continue
        parts = {k.rpartition(".")[2]: v for k, v in written.items()
                 if k.rpartition(".")[0] == prefix}
        w = source[f"{prefix}.weight"].float()
        got = decode(scheme, parts).dequantize()
        ratios.append(_output_error(w, got, h) / _output_error(
            w, _rtn(w, scale_dtype, group_size), h))
    assert len(ratios) == 7 * 2  # q k v o gate up down, two layers
    assert max(ratios) < 1.0 and sum(ratios) / len(ratios) < 0.8, ratios


def test_calibration_refuses_act_order_groups(tiny_model: str, tmp_path: Path) -> None:
    from workers.quant.writer import quantize_checkpoint

    with pytest.raises(ValueError, match="act-order only for one scale per output channel"):
        quantize_checkpoint(tiny_model, tmp_path / "g", "gptq", calibration=["some text"],
                            bits=4, group_size=32, act_order=True)
    with pytest.raises(ValueError, match="group_size 5 for input size 8"):
        gptq_quantize(torch.randn(4, 8), torch.eye(8), group_size=5)
