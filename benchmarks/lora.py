"""LoRA adapters mixed in one batch against the base model alone: output tokens/s of the engine
on the `small` preset (random weights, ~40M parameters) with 32 concurrent greedy requests,
each under one of 8 rank-16 adapters (attention and MLP targets) chosen uniformly, against the
same 32 requests on an engine without LoRA, and on the LoRA engine under the base model.
Measured in alternation (the order flips each round), in one process, on the offline engine
(`workers.LLM`): the served path adds the same router work to both sides.

`mixed_ratio` = tokens/s of the adapter mix / the engine without LoRA (issue 50's target:
>= 0.8); `one_adapter_ratio` = all 32 under one adapter (one segment per projection: what
leaving the base model's fused paths and the LoRA products cost, without the per-adapter
segments) / the engine without LoRA; `lora_engine_base_ratio` = the LoRA engine serving the
base model only / the engine without LoRA (what enabling LoRA costs requests that use none).

    python benchmarks/lora.py [--rounds 2] [--streams 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from results_io import RESULTS, command_line, emit

NUM_ADAPTERS, RANK, PROMPT_TOKENS = 8, 16, 64


def _engines(root: Path, streams: int) -> tuple[Any, Any, list[str]]:
    from workers import LLM
    from workers.models.lora.make_adapter import ATTENTION, MLP, make_adapter
    from workers.models.make_model import make_model

    model = make_model(root / "small", arch="llama", preset="small")
    names = [f"a{i}" for i in range(NUM_ADAPTERS)]
    folders = [make_adapter(model, root / n, rank=RANK, seed=i, targets=ATTENTION + MLP)
               for i, n in enumerate(names)]
    modules = tuple(f"{n}={f}" for n, f in zip(names, folders, strict=True))
    common = {"max_num_seqs": max(streams, 8), "enable_prefix_caching": False}
    base = LLM(str(model), **common)
    lora = LLM(str(model), enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK,
               lora_modules=modules, **common)
    return base, lora, names


def _run(llm: Any, loras: list[str | None], max_tokens: int) -> float:
    from workers import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [[1 + (7 * i + j) % 8000 for j in range(PROMPT_TOKENS)] for i in range(len(loras))]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_name=loras)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def run(rounds: int, streams: int, max_tokens: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        base, lora, names = _engines(Path(tmp), streams)
        mixed = [names[i % NUM_ADAPTERS] for i in range(streams)]  # uniform over the 8
        sides = {"base": (base, [None] * streams), "lora_engine_base": (lora, [None] * streams),
                 "one_adapter": (lora, [names[0]] * streams), "mixed": (lora, mixed)}
        for llm, loras in sides.values():  # warm: kernels, the slots filled once
            _run(llm, loras, 4)
        rates: dict[str, list[float]] = {k: [] for k in sides}
        for r in range(rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for key in order:
                rates[key].append(round(_run(*sides[key], max_tokens), 1))
            print(rates, flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"streams": streams, "max_tokens": max_tokens, "adapters": NUM_ADAPTERS,
            "rank": RANK, "tokens_per_s_rounds": rates,
            "tokens_per_s": {k: round(v, 1) for k, v in med.items()},
            "mixed_ratio": round(med["mixed"] / med["base"], 3),
            "one_adapter_ratio": round(med["one_adapter"] / med["base"], 3),
            "lora_engine_base_ratio": round(med["lora_engine_base"] / med["base"], 3)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(RESULTS / "lora.json"))
    args = parser.parse_args(argv)
    result = run(args.rounds, args.streams, args.max_tokens)
    result["command"] = command_line(argv)
    result["targets"] = {"mixed_ratio": ">= 0.8"}
    return emit(result, args.out)


if __name__ == "__main__":
    main()
