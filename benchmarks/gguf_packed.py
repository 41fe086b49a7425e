"""A GGUF file's Q4_1 weights served packed against the same file dequantized at load, and
against Cleave's own int4 copy, on the real model (SmolLM2-135M-Instruct, Q4_1 as shipped).

Variants, all loaded at once, measured in turn (alternated) `--rounds` times:

- packed: the file's Q8_0/Q4_x blocks kept as they are (`gguf_packed`, the default on the
  CPU), fp32 activations; the tied 49,152 x 576 output projection / embedding stays Q8_0;
- fp32: the same file dequantized to fp32 at load (`--no-gguf-packed`), the reference;
- int4_bf16: `cleave quantize` of the dequantized weights, int4 in groups of 32 with zero
  points, in a bf16 engine (the copy issue 47 measured against llama.cpp); the tied output
  projection stays bf16;
- int4_f32: the same copy packed in an fp32 engine (`fp32_int_kernels`, the fused C stack),
  output projection fp32.

Per variant and stream count (1 and 8): decode tokens/s = streams x new tokens / (the
generation's time less its prefill's, a 1-token generation of the same prompts) and the
inter-token latency (its inverse per stream), the best of the rounds (this 2-core machine is
shared; the best is the least disturbed). Prompts: real text (the Python reference manual's
topics every CPython carries), `--prompt-len` tokens each. Also, in the same run: the packed
path's 32-token greedy continuations of 8 prompts against the dequantized path's, and the
largest difference of their log-probabilities (top 20 per position, prompt and steps); the
raw logits are compared in tests/workers/test_gguf_packed.py.

Last line: one JSON object with `_ratio` keys (packed over each other variant's tokens/s);
also written to benchmarks/results/gguf_packed.json.
"""

from __future__ import annotations

import argparse
import json
import pydoc_data.topics
import sys
import time
from pathlib import Path

import torch
from results_io import RESULTS, command_line, emit

TOPICS = ("assert", "for", "lambda", "while", "with", "try", "if", "return")
VARIANTS = {  # name: (checkpoint: "gguf" or "int4", engine options)
    "packed": ("gguf", {"dtype": "float32", "gguf_packed": True}),
    "fp32": ("gguf", {"dtype": "float32", "gguf_packed": False}),
    "int4_bf16": ("int4", {"dtype": "bfloat16"}),
    "int4_f32": ("int4", {"dtype": "float32", "fp32_int_kernels": True}),
}


def int4_copy(gguf_file: Path, cache: Path) -> Path:
    """`cleave quantize` (int4, groups of 32, zero points) of the file's dequantized weights,
    written once under `cache` as a Hugging Face folder."""
    from safetensors.torch import save_file

    from workers.models.gguf_config import read_gguf_config
    from workers.models.gguf_weights import checkpoint_tensors
    from workers.models.model_config import ModelConfig
    from workers.quant.writer import quantize_checkpoint

    fp32, int4 = cache / "smollm2-fp32", cache / "smollm2-int4-g32-asym"
    if not (fp32 / "config.json").exists():
        fp32.mkdir(parents=True, exist_ok=True)
        config = ModelConfig.from_pretrained(gguf_file)
        tensors = {name: t.contiguous() for name, t in checkpoint_tensors(gguf_file, config)}
        save_file(tensors, str(fp32 / "model.safetensors"))
        (fp32 / "config.json").write_text(json.dumps(read_gguf_config(gguf_file).raw))
    if not (int4 / "config.json").exists():
        quantize_checkpoint(fp32, int4, "compressed-tensors", bits=4, group_size=32,
                            symmetric=False)
    return int4


def prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    text = " ".join(pydoc_data.topics.topics[key] for key in TOPICS)
    ids = tokenizer.encode(text)
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def decode_seconds(llm, batch: list[list[int]], new_tokens: int) -> float:
    from workers import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=new_tokens + 1, ignore_eos=True)
    llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    start = time.perf_counter()
    llm.generate(batch, one)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(batch, full)
    return max(time.perf_counter() - start - prefill_s, 1e-9)


def agreement(packed, reference, batch: list[list[int]], steps: int) -> dict:
    """The packed path's greedy tokens and log-probabilities against the dequantized path's:
    `steps` greedy tokens per prompt (the decode kernels), and the 20 most likely tokens'
    log-probabilities at every prompt position (the prefill's tiles) and every step while both
    agree."""
    from workers import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=20,
                            prompt_logprobs=20)
    a, b = packed.generate(batch, params), reference.generate(batch, params)
    diff = {"prefill": 0.0, "decode": 0.0}
    same = 0
    divergence: list[int | None] = []
    for x, y in zip(a, b):
        tx, ty = x.outputs[0].token_ids, y.outputs[0].token_ids
        same += tx == ty
        first = next((i for i, (s, t) in enumerate(zip(tx, ty)) if s != t), None)
        divergence.append(first)
        pairs = [("prefill", p, q) for p, q in zip(x.prompt_logprobs or [],
                                                    y.prompt_logprobs or [])]
        pairs += [("decode", p, q) for p, q in zip(x.outputs[0].logprobs or [],
                                                   y.outputs[0].logprobs or [])][:first]
        for kind, p, q in pairs:
            if p is None or q is None:
                continue
            common = p.top.keys() & q.top.keys()
            diff[kind] = max([diff[kind], *(abs(p.top[t] - q.top[t]) for t in common)])
    return {"greedy_identical": same, "prompts": len(batch), "steps": steps,
            "first_divergence": divergence, "max_logprob_diff_prefill": diff["prefill"],
            "max_logprob_diff_decode": diff["decode"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", default=str(Path.home() / ".cache/cleave/gguf_packed"))
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from workers import LLM
    from workers.models.trained_default import smollm2_gguf

    gguf_file = smollm2_gguf()
    paths = {"gguf": gguf_file, "int4": int4_copy(gguf_file, Path(args.cache))}
    streams = [int(s) for s in args.streams.split(",")]
    names = args.variants.split(",")
    engines = {name: LLM(str(paths[VARIANTS[name][0]]), max_num_seqs=max(streams),
                         num_blocks=max(streams) * 16 + 16, block_size=16,
                         max_num_batched_tokens=max(256, max(streams) * args.prompt_len),
                         **VARIANTS[name][1])
               for name in names}
    texts = prompts(engines["packed"].tokenizer, max(streams), args.prompt_len)
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for batch in streams:
            for name in names:  # alternated: each round measures every variant in turn
                s = decode_seconds(engines[name], texts[:batch], args.new_tokens)
                key = f"{name}_{batch}"
                best[key] = min(best.get(key, float("inf")), s)
    runs = {key: {"tokens_per_s": int(key.rsplit("_", 1)[1]) * args.new_tokens / s,
                  "inter_token_ms": 1e3 * s / args.new_tokens}
            for key, s in best.items()}
    result = {"command": command_line(argv), "threads": args.threads, "model": gguf_file.name,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "rounds": args.rounds, "runs": runs}
    if "fp32" in engines:
        result["packed_vs_dequantized"] = agreement(engines["packed"], engines["fp32"],
                                                    texts[:8], 32)
    for batch in streams:
        for name in names:
            if name != "packed":
                packed, other = runs[f"packed_{batch}"], runs[f"{name}_{batch}"]
                result[f"packed_over_{name}_{batch}_streams_ratio"] = (
                    packed["tokens_per_s"] / other["tokens_per_s"])
    emit(result, RESULTS / "gguf_packed.json")
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
