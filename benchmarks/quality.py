"""Quality on real text with the real model: SmolLM2-135M-Instruct (its Q4_1 GGUF as shipped,
dequantized to fp32 by Cleave) on a fixed corpus of English prose and Python code
(`quality_corpus.py`), Cleave's lossy settings against Cleave fp32, and Cleave fp32 against
transformers on the same weights, all in one run.

Per variant, against the reference (Cleave fp32):

- teacher-forced, every passage as a prompt with prompt logprobs, prefilled in chunks of
  `--chunk` tokens so that positions from `--chunk` on read every key and value back from the KV
  cache as decode does (a prompt's first chunk attends to its own fresh keys: an 8-bit cache
  changes nothing there); over those positions: perplexity and its ratio to the reference's,
  next-token top-1 agreement given the same prefix, the reference's top-1 minus top-2
  log-probability margin where the argmax differs (below `--near-tie`: a near-tie, not an
  error), and the mean KL divergence of the next-token distributions;
- greedy: `--steps` tokens after each passage's first `--prompt-tokens`; identical
  continuations, the first differing step and the reference's margin there.

Variants: `bf16` (weights and activations), `kv_int8` / `kv_fp8` (`--kv-cache-dtype`: 8 bits, a
scale per quarter of a token's head, rows Hadamard-rotated first; fp8's values in e4m3 and its
keys in int8; `kv_int8_unrotated`: the int8 format before that rotation, `kv_fp8_e4m3`: the fp8
format before, e4m3 keys and values unrotated, for comparison in the same run; figures in
`benchmarks/results/quality_kv_int8.json` and `quality_kv_fp8.json`), `w_int8` / `w_int4` (`cleave
quantize` of the dequantized fp32 checkpoint, compressed-tensors: int8 a scale per output
channel, int4 groups of 32 with zero points; run dequantized in fp32, so the figure is the
weights' rounding alone), `w_int8_gptq` (`cleave quantize --calibrate`: the same int8 layout,
integers chosen by GPTQ on the built-in calibration text, which none of the corpus's passages
is), `w_int8_g32` (int8, a scale per 32 input columns, symmetric: GGUF's Q8_0 layout, in
compressed-tensors), `w_int8_g32_gptq` / `w_int8_g16_gptq` (int8 in groups of 32 / 16 with
zero points, by GPTQ: every decoder projection int8, the tied embedding in full precision as
in every `w_` variant; Cleave's int kernels take int8 per channel only, so grouped int8 runs
dequantized in any dtype), and
`w_int8_kernels` (the int8 copy in Cleave's int kernels, activations quantized to int8 too).

    .venv/bin/python benchmarks/quality.py
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch

import quality_metrics as qm
from quality_corpus import load as load_corpus
from results_io import RESULTS, command_line, emit
from workers import LLM, SamplingParams
from workers.kernels import kv_quant
from workers.models.trained_default import gguf_cache_dir, smollm2_gguf

# name -> (checkpoint: gguf / fp32 / int8 / int4, engine options)
VARIANTS: dict[str, tuple[str, dict]] = {
    "fp32": ("gguf", {"dtype": "float32"}),  # the reference
    "bf16": ("gguf", {"dtype": "bfloat16"}),
    "kv_int8": ("gguf", {"dtype": "float32", "kv_cache_dtype": "int8"}),
    "kv_int8_unrotated": ("gguf", {"dtype": "float32", "kv_cache_dtype": "int8"}),
    "kv_fp8": ("gguf", {"dtype": "float32", "kv_cache_dtype": "fp8"}),
    "kv_fp8_e4m3": ("gguf", {"dtype": "float32", "kv_cache_dtype": "fp8"}),
    "w_int8": ("int8", {"dtype": "float32"}),
    "w_int8_gptq": ("int8_gptq", {"dtype": "float32"}),
    "w_int8_g32": ("int8_g32", {"dtype": "float32"}),
    "w_int8_g32_gptq": ("int8_g32_gptq", {"dtype": "float32"}),
    "w_int8_g16_gptq": ("int8_g16_gptq", {"dtype": "float32"}),
    "w_int4": ("int4", {"dtype": "float32"}),
    "w_int8_kernels": ("int8", {"dtype": "float32", "fp32_int_kernels": True}),
    "hf_fp32": ("fp32", {"dtype": "float32"}),  # the dequantized folder: equal to fp32
}
DEFAULT_VARIANTS = "bf16,kv_int8,kv_fp8,w_int8,w_int4"
# earlier cache formats, run with `kv_quant`'s switches (read at call time) set as they were:
# no dtype rotated, an fp8 cache's keys in e4m3
EARLIER_FORMATS: dict[str, dict] = {
    "kv_int8_unrotated": {"ROTATED_DTYPES": frozenset()},
    "kv_fp8_e4m3": {"ROTATED_DTYPES": frozenset(), "KEY_DTYPES": {}}}
QUANTIZE = {"int8": {"bits": 8, "group_size": None, "symmetric": True},
            "int8_gptq": {"bits": 8, "group_size": None, "symmetric": True, "calibrate": True},
            "int8_g32": {"bits": 8, "group_size": 32, "symmetric": True},
            "int8_g32_gptq": {"bits": 8, "group_size": 32, "symmetric": False, "calibrate": True},
            "int8_g16_gptq": {"bits": 8, "group_size": 16, "symmetric": False, "calibrate": True},
            "int4": {"bits": 4, "group_size": 32, "symmetric": False}}


def checkpoints(gguf: Path, needed: set[str]) -> dict[str, Path]:
    """The GGUF file, and (when a variant needs them, made once under Cleave's cache folder)
    its weights dequantized by transformers into a Hugging Face folder and `cleave quantize`
    copies of that folder."""
    paths = {"gguf": gguf}
    if not needed - {"gguf"}:
        return paths
    root = gguf_cache_dir() / "smollm2-quality"
    paths["fp32"] = root / "fp32"
    if not (paths["fp32"] / "config.json").is_file():
        _dequantized_folder(gguf, paths["fp32"])
    from workers.quant.writer import quantize_checkpoint

    from workers.quant.gptq import builtin_calibration

    for kind, options in QUANTIZE.items():
        paths[kind] = root / kind
        if kind in needed and not (paths[kind] / "config.json").is_file():
            options = dict(options)
            calibration = builtin_calibration() if options.pop("calibrate", False) else None
            quantize_checkpoint(paths["fp32"], paths[kind], "compressed-tensors",
                                calibration=calibration, **options)
    return paths


def _dequantized_folder(gguf: Path, out: Path) -> None:
    """transformers' GGUF reading saved as an ordinary fp32 folder (it refuses to save a model
    read from GGUF; a fresh model of the same config holding its state dict saves), written
    aside and renamed into place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    read = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                dtype=torch.float32)
    fresh = AutoModelForCausalLM.from_config(read.config, dtype=torch.float32)
    fresh.load_state_dict(read.state_dict())
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    fresh.save_pretrained(str(partial))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(
        str(partial))
    config = json.loads((partial / "config.json").read_text())
    config.pop("quantization_config", None)  # the GGUF file's: these weights are plain fp32
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    partial.rename(out)


def run_cleave(model: Path, options: dict, passages: list[list[int]], args: argparse.Namespace,
               reference: list[qm.Rows] | None) -> dict:
    """One engine: the passages teacher-forced (prompt logprobs and their full distributions),
    then greedy continuations of their first `prompt_tokens`."""
    started = time.perf_counter()
    llm = LLM(str(model), block_size=16, num_blocks=args.num_blocks, enable_prefix_caching=False,
              max_num_batched_tokens=args.chunk, max_num_seqs=args.chunk, **options)
    rows = qm.capture_prompt_rows(llm, passages, args.top_k, reference)
    outs = llm.generate(passages, SamplingParams(max_tokens=1, prompt_logprobs=0))
    logprobs = [[lp.logprob for lp in out.prompt_logprobs[args.chunk + 1:]] for out in outs]
    prompts = [ids[:args.prompt_tokens] for ids in passages]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.steps,
                                                ignore_eos=True, logprobs=2))
    greedy = [qm.Greedy(o.outputs[0].token_ids, [_margin(lp.top) for lp in o.outputs[0].logprobs])
              for o in outs]
    del llm
    gc.collect()
    return {"rows": rows, "logprobs": logprobs, "greedy": greedy,
            "seconds": time.perf_counter() - started}


def _margin(top: dict[int, float]) -> float:
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1]


@torch.no_grad()
def run_transformers(gguf: Path, passages: list[list[int]], args: argparse.Namespace,
                     reference: list[qm.Rows]) -> dict:
    """The oracle: transformers' reading of the same GGUF file (dequantized to fp32, saved once
    as a folder: reading the file again takes ~15 s), the same measures."""
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(checkpoints(gguf, {"fp32"})["fp32"]),
                                                 dtype=torch.float32).eval()
    rows, logprobs, greedy = [], [], []
    for ids, ref in zip(passages, reference):
        logits = model(torch.tensor([ids])).logits[0].float()
        rows.append(qm.rows_of(logits, args.top_k, ref))
        lp = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        logprobs.append(lp[args.chunk:].tolist())
        greedy.append(_hf_greedy(model, ids[:args.prompt_tokens], args.steps))
    return {"rows": rows, "logprobs": logprobs, "greedy": greedy,
            "seconds": time.perf_counter() - started}


def _hf_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> qm.Greedy:
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, margins = [], []
    for _ in range(steps):
        top2 = out.logits[0, -1].float().log_softmax(-1).topk(2)
        tokens.append(int(top2.indices[0]))
        margins.append(float(top2.values[0] - top2.values[1]))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                    use_cache=True)
    return qm.Greedy(tokens, margins)


def compare(ref: dict, var: dict, args: argparse.Namespace) -> dict:
    ppl_ref = qm.perplexity([x for lps in ref["logprobs"] for x in lps])
    ppl = qm.perplexity([x for lps in var["logprobs"] for x in lps])
    return {"perplexity": round(ppl, 5), "perplexity_ratio": round(ppl / ppl_ref, 7),
            "teacher_forced": qm.teacher_forced(ref["rows"], var["rows"], args.chunk,
                                                args.near_tie),
            "greedy": qm.greedy(ref["greedy"], var["greedy"], args.near_tie),
            "seconds": round(var["seconds"], 1)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma-separated, of {', '.join(v for v in VARIANTS if v != 'fp32')}")
    parser.add_argument("--passages", type=int, default=30, help="the corpus's first N (of 56)")
    parser.add_argument("--tokens", type=int, default=160, help="a passage's first N tokens")
    parser.add_argument("--chunk", type=int, default=32, help="prefill chunk; scored from it")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--top-k", type=int, default=1024, help="tokens the KL tracks")
    parser.add_argument("--near-tie", type=float, default=0.05, help="a margin below: a tie")
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--no-transformers", action="store_true", help="skip the oracle")
    parser.add_argument("--out", default=str(RESULTS / "quality.json"))
    args = parser.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS or v == "fp32"]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; expected some of {list(VARIANTS)[1:]}")
    if args.tokens <= max(args.chunk + 1, args.prompt_tokens):
        raise SystemExit(f"--tokens {args.tokens} must exceed --chunk + 1 and --prompt-tokens")
    torch.set_num_threads(args.torch_threads)

    gguf = smollm2_gguf()
    paths = checkpoints(gguf, {VARIANTS[v][0] for v in names})
    corpus = load_corpus()[:args.passages]
    passages = _tokenize(gguf, corpus, args.tokens)
    ref = run_cleave(gguf, VARIANTS["fp32"][1], passages, args, None)
    result: dict = {
        "model": gguf.name, "corpus": "benchmarks/data/quality_corpus.jsonl",
        "passages": len(passages), "scored_positions_per_passage": "from --chunk on",
        "tokens_scored": sum(len(lps) for lps in ref["logprobs"]),
        "reference": {"perplexity": round(qm.perplexity(
            [x for lps in ref["logprobs"] for x in lps]), 5),
            "tail_mass_outside_top_k": qm.reference_tail_mass(ref["rows"], args.chunk),
            "seconds": round(ref["seconds"], 1)},
        "variants": {}, "command": command_line(argv)}
    print(f"fp32 (the reference): {result['reference']}", flush=True)
    if not args.no_transformers:
        oracle = run_transformers(gguf, passages, args, ref["rows"])
        cmp = compare(oracle, ref, args)  # Cleave fp32 as the variant of transformers
        cmp["seconds"] = round(oracle["seconds"], 1)  # the oracle's own
        result["fp32_vs_transformers"] = cmp
        result["fp32_vs_transformers_perplexity_ratio"] = cmp["perplexity_ratio"]
        print(f"fp32 against transformers: {cmp}", flush=True)
    for name in names:
        source, options = VARIANTS[name]
        with _cache_format(EARLIER_FORMATS.get(name, {})):
            run = run_cleave(paths[source], options, passages, args, ref["rows"])
        cmp = compare(ref, run, args)
        result["variants"][name] = cmp
        result[f"{name}_perplexity_ratio"] = cmp["perplexity_ratio"]
        print(f"{name}: {cmp}", flush=True)
    return emit(result, args.out)


@contextlib.contextmanager
def _cache_format(switches: dict) -> Iterator[None]:
    """`kv_quant`'s format switches set to `switches` while active (the engine runs in this
    process)."""
    saved = {name: getattr(kv_quant, name) for name in switches}
    for name, value in switches.items():
        setattr(kv_quant, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(kv_quant, name, value)


def _tokenize(gguf: Path, corpus: list[dict], tokens: int) -> list[list[int]]:
    from workers.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(str(gguf))
    return [tokenizer.encode(p["text"])[:tokens] for p in corpus]


if __name__ == "__main__":
    main()
