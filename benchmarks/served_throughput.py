"""engine_throughput's mixed-length workload through the Ray app, against the engine offline and
transformers on the same requests, in one run.

The requests of `benchmarks/engine_throughput.py` (prompts of 32-512 tokens, 16-256 output
tokens, ignore_eos, seed 0) go (1) through the offline `LLM` (continuous batching), (2) through
transformers `generate` (static batches), and (3) all at once over HTTP to `cleave serve` (1
prefill + 1 decode replica, the same KV budget per engine as the offline run, streamed
`/v1/completions` through `benchmarks/loadgen.py`). Reported: output tokens/s of each,
`engine_vs_transformers_ratio`, `ray_vs_transformers_ratio` and `ray_vs_engine_ratio` (issue 17's
target: the Ray app keeps at least 0.8 of the engine's offline ratio, i.e. this one >= 0.8).

Last line: one JSON object; also written to benchmarks/results/ with the command.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
from pathlib import Path

from engine_throughput import model_and_requests, run_cleave, run_transformers
from loadgen import RequestSpec, run_load, summarize
from results_io import RESULTS, command_line, emit
from serving_ray import RayApp


def kv_blocks(model: str, kv_bytes: int, block_size: int = 16) -> int:
    """Blocks of `block_size` tokens an fp32 cache of `kv_bytes` holds for `model`."""
    from workers.models.model_config import ModelConfig

    mc = ModelConfig.from_pretrained(model)
    per_block = 2 * mc.num_hidden_layers * block_size * mc.num_key_value_heads * mc.head_dim * 4
    return kv_bytes // per_block


def run_ray(model: str, requests: list[tuple[list[int], int]], max_num_seqs: int,
            num_blocks: int, num_cpus: float) -> dict:
    app = RayApp(model, "bench", num_cpus=num_cpus, disagg_threshold=64,
                 extra_args=("--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens",
                             "2048", "--num-gpu-blocks-override", str(num_blocks)))
    app.start()
    try:
        warm = [RequestSpec(requests[0][0][:32], 2)]
        asyncio.run(run_load(app.base_url, "bench", warm, math.inf))
        specs = [RequestSpec(p, m) for p, m in requests]
        results, duration = asyncio.run(run_load(app.base_url, "bench", specs, math.inf))
        summary = summarize(results, duration)
    finally:
        stop = app.stop()
    expected = sum(m for _, m in requests)
    tokens = sum(r.output_tokens for r in results if r.ok)
    return {"tokens_per_s": round(tokens / duration, 1), "output_tokens": tokens,
            "expected_output_tokens": expected, "failed": summary["failed"],
            "ttft": summary["ttft"], "tpot": summary["tpot"], "duration_s": round(duration, 1),
            "_stop": stop}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint folder; default: make the `small` preset")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="per engine")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--ray-num-cpus", type=float, default=4)
    parser.add_argument("--out", default=str(RESULTS / "served_throughput.json"))
    args = parser.parse_args(argv)

    tmp = tempfile.TemporaryDirectory()
    model, requests = model_and_requests(args.model, args.num_requests, Path(tmp.name))
    kv_bytes = int(args.kv_cache_gib * 1024**3)
    engine_s, engine_tokens = run_cleave(model, requests, args.max_num_seqs, "float32",
                                         kv_bytes)
    print(f"engine offline: {engine_tokens / engine_s:.1f} tokens/s", file=sys.stderr)
    hf_s, hf_tokens = run_transformers(model, requests, args.hf_batch_size, "float32")
    print(f"transformers: {hf_tokens / hf_s:.1f} tokens/s", file=sys.stderr)
    ray = run_ray(model, requests, args.max_num_seqs, kv_blocks(model, kv_bytes),
                  args.ray_num_cpus)
    print(f"ray app: {ray['tokens_per_s']} tokens/s, {ray['failed']} failed", file=sys.stderr)
    if ray["failed"] or ray["output_tokens"] != ray["expected_output_tokens"]:
        raise RuntimeError(f"the Ray app lost tokens or requests: {ray}")
    engine_tps, hf_tps = engine_tokens / engine_s, hf_tokens / hf_s
    result = {
        "benchmark": "served_throughput",
        "command": command_line(argv),
        "num_requests": len(requests), "output_tokens": engine_tokens,
        "engine_tokens_per_s": round(engine_tps, 1), "transformers_tokens_per_s": round(hf_tps, 1),
        "ray": ray,
        "engine_vs_transformers_ratio": round(engine_tps / hf_tps, 2),
        "ray_vs_transformers_ratio": round(ray["tokens_per_s"] / hf_tps, 2),
        "ray_vs_engine_ratio": round(ray["tokens_per_s"] / engine_tps, 3),
    }
    return emit(result, args.out)


if __name__ == "__main__":
    main()
