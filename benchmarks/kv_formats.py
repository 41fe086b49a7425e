"""8-bit KV cache formats simulated on the real model: what costs an fp8 cache its agreement.

SmolLM2-135M-Instruct (fp32) over the first `--passages` of the quality corpus, prefilled in
chunks of 32 as `quality.py` does, with a full-precision cache into which every key and value is
written quantized and dequantized as a format would store it (`workers.attention.torch_backend
.write_kv` wrapped; a prompt's first chunk attends its own fresh k/v, as with a real 8-bit
cache). Per format: next-token top-1 agreement with the unquantized run at the positions from 32
on, and the mean KL divergence. A format is `keys/values`, each `int8`, `e4m3` or `e5m2`
(`-rot`: the row Hadamard-rotated first, `kv_quant.rotate`; `@n`: n scales a row, default 4;
`raw`: e4m3 with no scale) or `fp32` (stored as is). `engine:<dtype>` runs the engine's own
`--kv-cache-dtype` instead, to check the simulation against it.

Last line: one JSON object (`<format>_differences_ratio`: its top-1 differences over the first
format's); also written to benchmarks/results/kv_formats.json.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable

import torch

import quality_metrics as qm
from quality_corpus import load as load_corpus
from results_io import RESULTS, command_line, emit
from workers import LLM, SamplingParams
from workers.attention import torch_backend
from workers.kernels import kv_quant
from workers.models.trained_default import smollm2_gguf

DEFAULT_FORMATS = ("e4m3/e4m3,e4m3/fp32,fp32/e4m3,e4m3-rot/e4m3-rot,e4m3@1/e4m3@1,"
                   "e4m3@16/e4m3@16,raw/raw,e5m2/e5m2,int8-rot/fp32,int8-rot/e4m3,"
                   "int8-rot/e4m3-rot,engine:fp8,int8-rot/int8-rot")
QMAX = {"int8": 127.0, "e4m3": 448.0, "e5m2": 57344.0}
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fake_quant(spec: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [..., D] -> x as the format `spec` (see the module doc) stores and reads it back."""
    kind, _, groups_text = spec.partition("@")
    rotated = kind.endswith("-rot")
    kind = kind.removesuffix("-rot")
    groups = int(groups_text or 4)
    if kind not in (*QMAX, "raw", "fp32"):
        raise SystemExit(f"unknown format {spec!r}: expected int8, e4m3, e5m2, raw or fp32")

    def apply(x: torch.Tensor) -> torch.Tensor:
        if kind == "fp32":
            return x
        rows = kv_quant.rotate(x.float(), torch.int8) if rotated else x.float()
        g = rows.reshape(*rows.shape[:-1], groups, -1)
        if kind == "raw":
            back = g.to(torch.float8_e4m3fn).float()
        else:
            scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / QMAX[kind]
            scaled = g / scale
            stored = (scaled.round().clamp(-127, 127) if kind == "int8"
                      else scaled.to(FP8[kind]).float())
            back = stored * scale
        back = back.reshape(rows.shape)
        return (kv_quant.rotate(back, torch.int8) if rotated else back).to(x.dtype)

    return apply


def run(model: str, passages: list[list[int]], reference: list[qm.Rows] | None,
        options: dict) -> list[qm.Rows]:
    """The passages teacher-forced in chunks of 32; their rows."""
    llm = LLM(model, dtype="float32", block_size=16, num_blocks=512, enable_prefix_caching=False,
              max_num_batched_tokens=32, max_num_seqs=32, **options)
    rows = qm.capture_prompt_rows(llm, passages, 64, reference)
    llm.generate(passages, SamplingParams(max_tokens=1, prompt_logprobs=0))
    del llm
    gc.collect()
    return rows


def measure(model: str, passages: list[list[int]], ref: list[qm.Rows], fmt: str) -> dict:
    if fmt.startswith("engine:"):
        return qm.teacher_forced(ref, run(model, passages, ref,
                                          {"kv_cache_dtype": fmt.split(":")[1]}), 32, 0.05)
    keys, _, values = fmt.partition("/")
    quant_k, quant_v = fake_quant(keys), fake_quant(values or keys)
    write = torch_backend.write_kv
    torch_backend.write_kv = lambda cache, k, v, slots: write(cache, quant_k(k), quant_v(v),
                                                               slots)
    try:
        return qm.teacher_forced(ref, run(model, passages, ref, {}), 32, 0.05)
    finally:
        torch_backend.write_kv = write


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default=DEFAULT_FORMATS, help="comma-separated")
    parser.add_argument("--passages", type=int, default=10, help="the corpus's first N")
    parser.add_argument("--tokens", type=int, default=160, help="a passage's first N tokens")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "kv_formats.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    from workers.tokenizer import Tokenizer

    model = str(smollm2_gguf())
    tokenizer = Tokenizer.from_pretrained(model)
    passages = [tokenizer.encode(p["text"])[:args.tokens]
                for p in load_corpus()[:args.passages]]
    ref = run(model, passages, None, {})
    result: dict = {"model": "SmolLM2-135M-Instruct (fp32)", "passages": len(passages),
                    "formats": {}, "command": command_line(argv)}
    for fmt in args.formats.split(","):
        tf = measure(model, passages, ref, fmt)
        result["formats"][fmt] = {key: tf[key] for key in
                                  ("positions", "top1_agreement", "top1_differences",
                                   "near_tie_differences", "mean_kl")}
        print(fmt, result["formats"][fmt], flush=True)
    first = next(iter(result["formats"].values()))["top1_differences"]
    for fmt, row in result["formats"].items():
        result[f"{fmt}_differences_ratio"] = round(row["top1_differences"] / max(first, 1), 4)
    return emit(result, args.out)


if __name__ == "__main__":
    main()
