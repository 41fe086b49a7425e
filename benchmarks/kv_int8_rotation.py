"""The int8 KV cache's Hadamard rotation: what it costs a decode step.

One engine (SmolLM2-135M-Instruct, the real model, fp32 weights, `--kv-cache-dtype int8`, the
default attention backend) holds `--batch` sequences of `--context` prompt tokens; decode steps
are then timed in pairs of steps, one with the rotation and one without
(`kv_quant.ROTATED_DTYPES`, read at call time: off, no cache dtype is rotated, which is the int8
format before the rotation), alternating which goes first, so both steps of a pair see the same
context length and about the same load of a shared machine. Switching the rotation
under live sequences makes their tokens meaningless but not their cost: every step does the same
work either way but the rotations (q before attention, the output after, and each new key and
value before its scales). Reported: the median step of each, and the median of the pairs'
ratios (`rotated_over_unrotated_step_ratio`, above 1: the rotation costs).

Last line: one JSON object; also written to benchmarks/results/kv_int8_rotation.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from results_io import RESULTS, command_line, emit, sig

from workers import LLM, SamplingParams
from workers.contract.protocol import WorkerRequest
from workers.kernels import kv_quant
from workers.models.trained_default import smollm2_gguf


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=40,
                        help="decode steps of each, alternated step by step")
    parser.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--out", default=str(RESULTS / "kv_int8_rotation.json"))
    args = parser.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    llm = LLM(str(smollm2_gguf()), dtype="float32", kv_cache_dtype="int8", block_size=16,
              num_blocks=args.batch * (args.context + args.pairs * 2 + 64) // 16,
              max_num_seqs=args.batch)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, ignore_eos=True,
                            max_tokens=args.pairs * 2 + 16)
    for i in range(args.batch):
        engine.generate(WorkerRequest(str(i), tuple(rng.randrange(3, 40000)
                                                    for _ in range(args.context)), params))
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill; the first decodes warm up
    rotated = kv_quant.ROTATED_DTYPES
    times: dict[str, list[float]] = {"rotated": [], "unrotated": []}
    try:
        for pair in range(args.pairs):
            order = ("rotated", "unrotated") if pair % 2 == 0 else ("unrotated", "rotated")
            for mode in order:
                kv_quant.ROTATED_DTYPES = rotated if mode == "rotated" else frozenset()
                start = time.perf_counter()
                engine.step()
                times[mode].append(time.perf_counter() - start)
    finally:
        kv_quant.ROTATED_DTYPES = rotated
        engine.close()
    step = {mode: statistics.median(t) for mode, t in times.items()}
    ratios = [a / b for a, b in zip(times["rotated"], times["unrotated"])]
    return emit({
        "model": "SmolLM2-135M-Instruct (fp32, int8 KV cache)",
        "attention_backend": engine.config.resolved_attention_backend,
        "batch": args.batch, "context": args.context, "pairs": args.pairs,
        "torch_threads": torch.get_num_threads(),
        "rotated_step_ms": sig(step["rotated"] * 1e3),
        "unrotated_step_ms": sig(step["unrotated"] * 1e3),
        # the median of each pair's ratio: the two steps of a pair share the machine's load
        "rotated_over_unrotated_step_ratio": sig(statistics.median(ratios)),
        "command": command_line(argv)}, args.out)


if __name__ == "__main__":
    main()
