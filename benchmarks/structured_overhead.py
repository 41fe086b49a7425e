"""What a JSON-schema constraint costs a served request, measured through the in-process server
(`LocalServer` in a child process, one aggregated worker) with the shared load generator.

For each model and each concurrency (1, 8, 32 by default): the same kind of requests (random
128-token prompts, drawn afresh for each run so none is cached, 64 output tokens) once free and
once under a JSON schema whose shortest valid output is
longer than 64 tokens, so both runs decode exactly 64 tokens per request; run free, structured,
structured, free, the output tokens/s of the two constrained runs over the two free ones is
`<model>_c<c>_structured_vs_free_ratio` (target: >= 0.9 at 32). Then time to first token of a request whose schema the worker has never seen (compiled on
the worker's grammar thread before the request is queued) against the same schema again (cached),
median of `--ttft-repeats` fresh schemas: `<model>_ttft_first_vs_cached_schema_ratio`. Last, the
engine alone on the same shapes (`LLM` in this process, prefill included), where the grammar's
per-step cost (a mask per constrained row, then the sampled token fed to its matcher) is not
hidden by the served path's noise: `<model>_engine_c<c>_structured_vs_free_ratio`.

Usage: python benchmarks/structured_overhead.py [--models tiny,small] [--concurrency 1,8,32]
Last line: one JSON object; also written to benchmarks/results/structured_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import tempfile
import time

import httpx
from loadgen import RequestSpec, run_load, summarize
from results_io import RESULTS, command_line, emit
from serving_layers import code_state, inprocess_server, resolve_model, vocab_of

INPUT_LEN, OUTPUT_LEN = 128, 64
ITEMS = 40  # strings in the schema's array: far more than 64 tokens of output


def schema(tag: str = "") -> dict:
    """An object holding exactly `ITEMS` short strings (and a tag making a schema new)."""
    return {"type": "object", "properties": {
        "kind": {"enum": [f"list{tag}"]},
        "items": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 6},
                  "minItems": ITEMS, "maxItems": ITEMS}},
        "required": ["kind", "items"], "additionalProperties": False}


def specs(n: int, vocab: int, seed: int, constrained: bool) -> list[RequestSpec]:
    import random

    rng = random.Random(seed)
    extra = {"structured_outputs": {"json": schema()}} if constrained else None
    return [RequestSpec([rng.randrange(10, vocab) for _ in range(INPUT_LEN)], OUTPUT_LEN,
                        extra=extra) for _ in range(n)]


def throughput(base_url: str, name: str, vocab: int, c: int, constrained: bool,
               repeat: int = 0) -> dict:
    n = max(8, 4 * c)
    # prompts of their own for each run: no run finds another's in the prefix cache
    seed = 4 * c + 2 * repeat + constrained
    results, duration = asyncio.run(run_load(
        base_url, name, specs(n, vocab, seed, constrained), math.inf, max_concurrency=c))
    summary = summarize(results, duration)
    summary["expected_output_tokens"] = n * OUTPUT_LEN
    return summary


def offline(model: str, concurrencies: list[int]) -> dict:
    """The engine alone (`LLM`, one torch thread, in this process): tokens/s of each batch of
    `c` requests, free and constrained in the same ABBA order, prefill included."""
    import random

    import torch

    from workers.engine.llm import LLM
    from workers.contract.protocol import SamplingParams
    from workers.contract.structured_output import StructuredOutput

    torch.set_num_threads(1)
    llm = LLM(model=model, num_blocks=4096)
    vocab = llm.engine.model_config.vocab_size
    spec = StructuredOutput.json_schema(schema())
    rng = random.Random(0)
    llm.generate([[11] * 8], SamplingParams(max_tokens=4, structured=spec))  # compile, warm up
    out: dict = {}
    for c in concurrencies:
        runs: dict[bool, list[float]] = {False: [], True: []}
        for constrained in (False, True, True, False):
            prompts = [[rng.randrange(10, vocab) for _ in range(INPUT_LEN)] for _ in range(c)]
            params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True,
                                    structured=spec if constrained else None)
            start = time.perf_counter()
            done = llm.generate(prompts, params)
            tokens = sum(len(o.outputs[0].token_ids) for o in done)
            runs[constrained].append(round(tokens / (time.perf_counter() - start), 1))
        out[c] = {"free_tokens_per_s": runs[False], "structured_tokens_per_s": runs[True]}
    llm.engine.close()
    return out


def ttft_ms(base_url: str, name: str, body_extra: dict) -> float:
    body = {"model": name, "prompt": "ttft", "max_tokens": 1, "temperature": 0, **body_extra}
    start = time.perf_counter()
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return (time.perf_counter() - start) * 1e3


def measure_model(model: str, concurrencies: list[int], repeats: int) -> dict:
    vocab = vocab_of(model)
    out: dict = {"levels": {}}
    with inprocess_server(model, {"num_workers": 1}, 10**6, 1) as (base_url, name):
        throughput(base_url, name, vocab, 2, True, 99)  # warm-up, both paths
        throughput(base_url, name, vocab, 2, False, 99)
        for c in concurrencies:
            # free, structured, structured, free: drift over the run (the machine's other
            # load, a warming cache) falls on both alike
            runs = {False: [], True: []}
            for constrained in (False, True, True, False):
                runs[constrained].append(throughput(base_url, name, vocab, c, constrained, len(
                    runs[constrained])))
            out["levels"][c] = {"free": runs[False], "structured": runs[True]}
        first, cached, plain = [], [], []
        for i in range(repeats):
            extra = {"structured_outputs": {"json": schema(f"-{time.time_ns()}-{i}")}}
            first.append(ttft_ms(base_url, name, extra))
            cached.append(ttft_ms(base_url, name, extra))
            plain.append(ttft_ms(base_url, name, {}))
        out["ttft_ms"] = {"first_schema_p50": round(statistics.median(first), 2),
                          "cached_schema_p50": round(statistics.median(cached), 2),
                          "free_p50": round(statistics.median(plain), 2)}
    out["offline"] = offline(model, concurrencies)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--ttft-repeats", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS / "structured_overhead.json"))
    args = p.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    result: dict = {"benchmark": "structured_overhead", "command": command_line(argv),
                    "code": code_state(), "cpu_cores": os.cpu_count(),
                    "workload": {"input_len": INPUT_LEN, "output_len": OUTPUT_LEN,
                                 "schema": schema()}, "models": {}}
    with tempfile.TemporaryDirectory(prefix="cleave-structured-") as tmp:
        for name in args.models.split(","):
            figures = measure_model(resolve_model(name, tmp), concurrencies, args.ttft_repeats)
            result["models"][name] = figures
            for c, level in figures["levels"].items():
                free = sum(r["output_throughput"] for r in level["free"])
                result[f"{name}_c{c}_structured_vs_free_ratio"] = round(
                    sum(r["output_throughput"] for r in level["structured"]) / free, 3) \
                    if free else None
            for c, level in figures["offline"].items():
                result[f"{name}_engine_c{c}_structured_vs_free_ratio"] = round(
                    sum(level["structured_tokens_per_s"]) / sum(level["free_tokens_per_s"]), 3)
            t = figures["ttft_ms"]
            result[f"{name}_ttft_first_vs_cached_schema_ratio"] = round(
                t["first_schema_p50"] / t["cached_schema_p50"], 2)
    result["load_average_1m"] = round(os.getloadavg()[0], 2)
    return emit(result, args.out)


if __name__ == "__main__":
    main()
