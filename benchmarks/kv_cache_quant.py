"""8-bit KV caches against the full-precision cache: the same greedy tokens, and the blocks a
budget holds.

For each family's tiny checkpoint (`cleave make-model --preset tiny`, fp32), the same prompts
(random token ids, 5-60 tokens, block size 16 so decodes read back many quantized blocks) decode
32 greedy tokens with the cache in the model's dtype and with `kv_cache_dtype` int8 and fp8
(e4m3), each value scaled per quarter of a token's head. Reported per family and dtype: the
fraction of continuations identical to the full-precision cache's, the largest difference in the
log-probability of a chosen token over the continuations that stayed identical, and for each
continuation that did not, how close the full-precision cache's own choice was at the step
where the two first differ (its top-1 minus top-2 log-probability, `divergence_gaps`): the
random tiny checkpoints sit on near-ties (`baseline_steps_gap_below_0_1`: the fraction of all
full-precision steps whose top two tokens are within 0.1 nats), where any perturbation of the
cache, bf16's rounding included, may pick the other token and change the rest. Capacity: the
KV blocks of the same byte budget for a bf16 model (Llama-3-8B's head size, 128) with and
without 8 bits, from the engine's own block arithmetic.

Last line: one JSON object; also written to benchmarks/results/kv_cache_quant.json.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch
from results_io import RESULTS, command_line, emit

ARCHS = ("llama", "qwen3", "gemma3", "gpt_oss", "mixtral", "deepseek_v3")
KV_DTYPES = ("bfloat16", "int8", "fp8")  # bf16: the yardstick, as lossy as int8


def agreement(model: str, kv_dtype: str, prompts: list[list[int]], steps: int,
              baseline: list | None = None) -> tuple[dict, list]:
    from workers import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=2)
    if baseline is None:
        base = LLM(model, num_blocks=512, block_size=16)
        baseline = [o.outputs[0] for o in base.generate(prompts, params)]
        base.engine.close()
    llm = LLM(model, num_blocks=512, block_size=16, kv_cache_dtype=kv_dtype)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    llm.engine.close()
    same = [a.token_ids == b.token_ids for a, b in zip(baseline, outs)]
    diffs = [abs(x.logprob - y.logprob) for a, b, s in zip(baseline, outs, same) if s
             for x, y in zip(a.logprobs, b.logprobs)]
    gaps = [top_gap(a.logprobs[first_difference(a.token_ids, b.token_ids)])
            for a, b, s in zip(baseline, outs, same) if not s]
    return {"identical_fraction": sum(same) / len(same),
            "max_logprob_diff": max(diffs) if diffs else None,
            "divergence_gaps": sorted(round(g, 4) for g in gaps),
            "divergences_at_gap_below_0_1": sum(g < 0.1 for g in gaps)}, baseline


def first_difference(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def top_gap(step) -> float:
    """Top-1 minus top-2 log-probability of one step (its `top` alternatives)."""
    best = sorted(step.top.values(), reverse=True)
    return best[0] - best[1]


def near_tie_fraction(baseline: list, below: float = 0.1) -> float:
    gaps = [top_gap(step) for out in baseline for step in out.logprobs]
    return sum(g < below for g in gaps) / len(gaps)


def capacity(budget: int = 2**30) -> dict:
    from workers.engine.kv_cache.spec import KVCacheSpec

    blocks = {}
    for name, dtype in (("bf16", torch.bfloat16), ("int8", torch.int8),
                        ("fp8", torch.float8_e4m3fn)):
        spec = KVCacheSpec(32, 1, 16, 8, 128, dtype)  # Llama-3-8B: 32 layers, 8 KV heads
        blocks[name] = budget // spec.bytes_per_block
    return blocks


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out", default=str(RESULTS / "kv_cache_quant.json"))
    args = parser.parse_args(argv)
    from workers.models.make_model import make_model

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 60))]
               for _ in range(args.num_prompts)]
    families: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            model = str(make_model(Path(tmp) / arch, arch=arch, preset="tiny"))
            baseline = None
            families[arch] = {}
            for kv_dtype in KV_DTYPES:
                figures, baseline = agreement(model, kv_dtype, prompts, args.steps, baseline)
                families[arch][kv_dtype] = figures
                families[arch]["baseline_steps_gap_below_0_1"] = near_tie_fraction(baseline)
                print(f"{arch:12s} {kv_dtype}: {figures}", file=sys.stderr)
    blocks = capacity()
    result = {"command": command_line(argv), "num_prompts": args.num_prompts,
              "steps": args.steps, "families": families, "blocks_per_gib_llama3_8b": blocks,
              "int8_blocks_vs_bf16_ratio": blocks["int8"] / blocks["bf16"],
              "fp8_blocks_vs_bf16_ratio": blocks["fp8"] / blocks["bf16"]}
    for kv_dtype in KV_DTYPES:
        fractions = [f[kv_dtype]["identical_fraction"] for f in families.values()]
        result[f"{kv_dtype}_min_identical_fraction"] = min(fractions)
        result[f"{kv_dtype}_mean_identical_fraction"] = sum(fractions) / len(fractions)
    return emit(result, args.out)


if __name__ == "__main__":
    main()
