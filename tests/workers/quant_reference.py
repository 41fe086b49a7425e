"""An independent reading of the quantized formats, for tests: each weight dequantized straight
from the format's description (bit by bit for GPTQ and AWQ, with compressed-tensors' own
unpacking for its format), sharing no code with `workers.quant`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

_PARTS = {"qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale",
          "weight_shape", "weight_zero_point", "weight_scale_inv"}
_AWQ_NIBBLE_OF_COLUMN = [0, 4, 1, 5, 2, 6, 3, 7]  # column j of eight sits in this nibble


def _bits_of(words: torch.Tensor, bits: int, index: int) -> torch.Tensor:
    return (words.to(torch.int64) >> (bits * index)) & ((1 << bits) - 1)


def _gptq(t: dict[str, torch.Tensor], bits: int, v1: bool) -> torch.Tensor:
    per = 32 // bits
    qweight, qzeros, scales, g_idx = t["qweight"], t["qzeros"], t["scales"], t["g_idx"]
    k, n = qweight.shape[0] * per, qweight.shape[1]
    q = torch.empty(k, n, dtype=torch.int64)
    for j in range(per):  # input row i*per + j is field j of word row i
        q[j::per] = _bits_of(qweight, bits, j)
    z = torch.empty(qzeros.shape[0], n, dtype=torch.int64)
    for j in range(per):  # output column c*per + j is field j of word column c
        z[:, j::per] = _bits_of(qzeros, bits, j)
    if v1:
        z = z + 1
    g = g_idx.long()
    w = (q - z[g]).double() * scales.double()[g]  # [K, N]
    return w.t().float()


def _awq(t: dict[str, torch.Tensor]) -> torch.Tensor:
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    k, n = qweight.shape[0], qweight.shape[1] * 8
    q = torch.empty(k, n, dtype=torch.int64)
    z = torch.empty(qzeros.shape[0], n, dtype=torch.int64)
    for j in range(8):
        q[:, j::8] = _bits_of(qweight, 4, _AWQ_NIBBLE_OF_COLUMN[j])
        z[:, j::8] = _bits_of(qzeros, 4, _AWQ_NIBBLE_OF_COLUMN[j])
    g = torch.arange(k) // (k // scales.shape[0])
    return ((q - z[g]).double() * scales.double()[g]).t().float()


def _ct_packed(t: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    shape = torch.Size(t["weight_shape"].tolist())
    q = unpack_from_int32(t["weight_packed"], bits, shape).double()
    scale = t["weight_scale"].double()
    zero = t.get("weight_zero_point")
    if zero is not None:
        zero = unpack_from_int32(zero, bits, scale.shape, packed_dim=0).double()
    else:
        zero = torch.zeros_like(scale)
    g = torch.arange(shape[1]) // (shape[1] // scale.shape[1])
    return ((q - zero[:, g]) * scale[:, g]).float()


def _fp8(t: dict[str, torch.Tensor], scale_name: str) -> torch.Tensor:
    w, s = t["weight"].double(), t[scale_name].double()
    if s.numel() == 1 or s.shape[1] == 1 and s.shape[0] == w.shape[0]:
        return (w * s.reshape(-1, 1) if s.numel() > 1 else w * s).float()
    bn, bk = -(-w.shape[0] // s.shape[0]), -(-w.shape[1] // s.shape[1])
    full = s.repeat_interleave(bn, 0)[: w.shape[0]].repeat_interleave(bk, 1)[:, : w.shape[1]]
    return (w * full).float()


def _ct_group_of(config: dict, prefix: str) -> dict:
    """The compressed-tensors config group of module `prefix`: one naming it, else the first."""
    groups = list(config["config_groups"].values())
    named = [g for g in groups if prefix in g["targets"]]
    return named[0] if named else groups[0]


def dequantized_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in `folder`, its quantized weights dequantized to fp32."""
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    modules: dict[str, dict[str, torch.Tensor]] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        prefix, _, suffix = name.rpartition(".")
        quantized = suffix in _PARTS or (
            suffix == "weight" and tensor.dtype in (torch.int8, torch.float8_e4m3fn))
        if not quantized:
            plain[name] = tensor
        else:
            modules.setdefault(prefix, {})[suffix] = tensor
    method = config["quant_method"]
    for prefix, t in modules.items():
        if method == "gptq":
            w = _gptq(t, config["bits"], config.get("checkpoint_format", "gptq") == "gptq")
        elif method == "awq":
            w = _awq(t)
        elif method == "fp8":
            w = _fp8(t, "weight_scale_inv" if "weight_scale_inv" in t else "weight_scale")
        elif "weight_packed" in t:
            w = _ct_packed(t, _ct_group_of(config, prefix)["weights"]["num_bits"])
        else:
            w = _fp8(t, "weight_scale")
        plain[f"{prefix}.weight"] = w
    return plain


def dequantized_model(folder: Path, out: Path) -> torch.nn.Module:
    """transformers' model of the checkpoint in `folder` dequantized (written to `out` as a
    full-precision checkpoint, so transformers maps its tensor names itself)."""
    import transformers as tf
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    tensors = {k: v.contiguous() for k, v in dequantized_state_dict(folder).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
