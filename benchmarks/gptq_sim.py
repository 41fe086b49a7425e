"""Int8 weights by GPTQ against round-to-nearest, simulated on the quality harness's text.

SmolLM2-135M-Instruct (the fp32 folder `quality.py` dequantizes from the GGUF file) in
transformers fp32: every linear weight of the decoder layers (the tied embedding / lm_head stays
fp32) is quantized to int8, symmetric, one scale per output channel, the scale rounded to the
dtype the checkpoint stores it in, then dequantized in place; top-1 agreement and perplexity of
the teacher-forced passages of `quality.py` (the same tokens, scored from `--chunk` on) against
the unquantized run. Two ways of choosing the integers:

- `rtn`: round-to-nearest (`workers.quant.weights.quantize_int`, what `cleave quantize` writes);
- `gptq`: each input column in turn (optionally in act-order: largest Hessian diagonal first),
  its rounding error folded into the columns not yet quantized through the Cholesky factor of
  the inverse of H = X^T X (X: the layer's inputs on calibration text, damped by `--damp` of
  H's mean diagonal) (`workers.quant.gptq`).

Calibration text is NOT the harness's passages: the `pydoc_data.topics` entries that
`quality_corpus.TOPICS` does not use (sorted by key, the first `--calib-seqs` with at least
`--calib-tokens` tokens). Hessians come from the unquantized model in one pass (not layer by
layer through already-quantized layers).

    nice -n 19 .venv/bin/python benchmarks/gptq_sim.py
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import quality_metrics as qm
from quality import _tokenize, checkpoints
from quality_corpus import TOPICS
from quality_corpus import load as load_corpus
from results_io import RESULTS, command_line, emit
from workers.models.trained_default import smollm2_gguf
from workers.quant.gptq import collect_hessians, gptq_quantize
from workers.quant.weights import quantize_int

SCALE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def calibration(gguf: Path, seqs: int, tokens: int) -> tuple[list[list[int]], list[str]]:
    """Token ids of pydoc topics the harness's corpus does not use, and their keys."""
    import pydoc_data.topics as topics

    from workers.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(str(gguf))
    ids, keys = [], []
    for key in sorted(set(topics.topics) - set(TOPICS)):
        encoded = tokenizer.encode(topics.topics[key])
        if len(encoded) >= tokens:
            ids.append(encoded[:tokens])
            keys.append(key)
        if len(ids) == seqs:
            break
    return ids, keys


@torch.no_grad()
def evaluate(model: torch.nn.Module, passages: list[list[int]], k: int,
             ref: list[qm.Rows] | None, first: int) -> tuple[list[qm.Rows], list[float]]:
    rows, logprobs = [], []
    for i, ids in enumerate(passages):
        logits = model(torch.tensor([ids])).logits[0].float()
        rows.append(qm.rows_of(logits, k, ref[i] if ref else None))
        lp = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        logprobs.extend(lp[first:].tolist())
    return rows, logprobs


def quantized_state(originals: dict[str, torch.Tensor], hessians: dict[str, torch.Tensor],
                    method: str, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    scale_dtype = SCALE_DTYPES[args.scale_dtype]
    out = {}
    for name, w in originals.items():
        if method == "rtn":
            q = quantize_int(w, 8, None, True)
            q.scales = q.scales.to(scale_dtype).float()
            q.q = torch.round(w.float() / q.scales).clamp(-128, 127).to(torch.int8)
        else:
            q = gptq_quantize(w, hessians[name], 8, damp=args.damp,
                              act_order=method == "gptq_act", scale_dtype=scale_dtype)
        out[name] = q.dequantize()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="rtn,gptq,gptq_act")
    parser.add_argument("--passages", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=1024)
    parser.add_argument("--near-tie", type=float, default=0.05)
    parser.add_argument("--calib-seqs", type=int, default=16)
    parser.add_argument("--calib-tokens", type=int, default=256)
    parser.add_argument("--damp", type=float, default=0.01)
    parser.add_argument("--scale-dtype", default="fp16", choices=list(SCALE_DTYPES))
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "gptq_sim.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf()
    folder = checkpoints(gguf, {"fp32"})["fp32"]
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    passages = _tokenize(gguf, load_corpus()[:args.passages], args.tokens)
    started = time.perf_counter()
    ref_rows, ref_lp = evaluate(model, passages, args.top_k, None, args.chunk)
    ppl_ref = qm.perplexity(ref_lp)
    print(f"reference: perplexity {ppl_ref:.4f} ({time.perf_counter() - started:.0f} s)",
          flush=True)
    linears = {name: mod for name, mod in model.named_modules()
               if isinstance(mod, torch.nn.Linear) and ".layers." in name}
    originals = {name: mod.weight.detach().clone() for name, mod in linears.items()}
    calib, keys = calibration(gguf, args.calib_seqs, args.calib_tokens)
    started = time.perf_counter()
    hessians = collect_hessians(model, linears, calib)
    print(f"hessians: {len(calib)} x {args.calib_tokens} tokens "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
    result: dict = {"model": gguf.name, "passages": len(passages),
                    "calibration": {"source": "pydoc_data.topics, keys not in quality_corpus",
                                    "keys": keys, "tokens_each": args.calib_tokens},
                    "reference_perplexity": round(ppl_ref, 5), "methods": {},
                    "command": command_line(argv)}
    for method in [m for m in args.methods.split(",") if m]:
        started = time.perf_counter()
        state = quantized_state(originals, hessians, method, args)
        for name, mod in linears.items():
            mod.weight.data.copy_(state[name])
        rows, lp = evaluate(model, passages, args.top_k, ref_rows, args.chunk)
        tf = qm.teacher_forced(ref_rows, rows, args.chunk, args.near_tie)
        ppl = qm.perplexity(lp)
        result["methods"][method] = {"perplexity_ratio": round(ppl / ppl_ref, 6),
                                     "teacher_forced": tf,
                                     "seconds": round(time.perf_counter() - started, 1)}
        result[f"{method}_perplexity_ratio"] = round(ppl / ppl_ref, 6)
        print(f"{method}: top-1 {tf['top1_agreement']:.4f} ({tf['top1_differences']} of "
              f"{tf['positions']}), perplexity ratio {ppl / ppl_ref:.5f}", flush=True)
    for name, mod in linears.items():
        mod.weight.data.copy_(originals[name])
    return emit(result, args.out)


if __name__ == "__main__":
    main()
