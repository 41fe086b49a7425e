"""Online serving load generator against any OpenAI-compatible server (`/v1/completions`).

Streaming requests, arriving as a Poisson process (`--request-rate`, inf: all at once) and/or
capped at `--max-concurrency` in flight; `--sweep-rates 1,2,4` runs one level per rate. Prompts
are random token ids (exact input lengths, no tokenizer needed; ids below `--vocab-size`):

- `random`: `--input-len` prompt tokens, `--output-len` output tokens each;
- `mixed`: the same, except that a `--long-fraction` of the requests are long prompts
  (`--long-input-len` in, `--long-output-len` out) arriving while the others decode, the
  workload where prefill interferes with decode.

Per level: TTFT, TPOT, inter-token latency (ITL, between streamed chunks) and end-to-end latency
p50/p90/p99 in ms, throughput (requests/s, output tokens/s) and goodput (requests/s meeting
`--slo-ttft-ms` and `--slo-tpot-ms`; every completed request when neither is set). A PNG of
the TTFT and ITL distributions lands next to the JSON.

`--compare-local` starts, in this run, two deployments of a `cleave make-model --preset small`
model with `cluster.local_server.LocalServer` (two aggregated workers, then one prefill plus one decode
worker over TCP), runs the same mixed workload on each and reports both ITL p99 and
`itl_p99_ratio` = aggregated / disaggregated (above 1: disaggregation helps).

Last line: one JSON object; also written to benchmarks/results/ with the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from results_io import RESULTS, command_line, emit

QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestSpec:
    prompt: list[int]  # token ids
    max_tokens: int
    kind: str  # "short" or "long"


@dataclass
class RequestResult:
    kind: str
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between streamed chunks
    output_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def make_workload(workload: str, num_prompts: int, input_len: int, output_len: int,
                  vocab_size: int, seed: int = 0, long_input_len: int = 1024,
                  long_output_len: int = 16, long_fraction: float = 0.25) -> list[RequestSpec]:
    """`num_prompts` requests in arrival order; in `mixed`, every 1/`long_fraction`-th is long
    (evenly spread, so long prompts keep arriving while short ones decode)."""
    if workload not in ("random", "mixed"):
        raise ValueError(f"workload must be random or mixed, got {workload!r}")
    if not 0.0 < long_fraction <= 1.0:
        raise ValueError(f"long_fraction must be in (0, 1], got {long_fraction}")
    if min(num_prompts, input_len, output_len, long_input_len, long_output_len) < 1:
        raise ValueError("num_prompts and every length must be >= 1, got "
                         f"{(num_prompts, input_len, output_len, long_input_len, long_output_len)}")
    rng = random.Random(seed)
    every = round(1 / long_fraction)
    specs = []
    for i in range(num_prompts):
        long = workload == "mixed" and i % every == every - 1
        n_in, n_out = (long_input_len, long_output_len) if long else (input_len, output_len)
        specs.append(RequestSpec([rng.randrange(10, vocab_size) for _ in range(n_in)], n_out,
                                 "long" if long else "short"))
    return specs


async def send(client: httpx.AsyncClient, url: str, model: str, spec: RequestSpec,
               ignore_eos: bool) -> RequestResult:
    """One streamed completion, timed chunk by chunk."""
    body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}
    if ignore_eos:
        body["ignore_eos"] = True
    out = RequestResult(spec.kind)
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = str(chunk["error"].get("message"))[:200]
                    return out
                if chunk.get("usage"):
                    out.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if chunks == 0:
                        out.ttft_s = now - start
                    else:
                        out.itl_s.append(now - last)
                    last, chunks = now, chunks + 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
        return out
    out.latency_s = time.perf_counter() - start
    out.output_tokens = out.output_tokens or chunks
    out.ok = chunks > 0
    return out


async def run_load(base_url: str, model: str, specs: list[RequestSpec], request_rate: float,
                   max_concurrency: int | None = None, api_key: str = "EMPTY",
                   ignore_eos: bool = True, seed: int = 0) -> tuple[list[RequestResult], float]:
    """Send `specs` (Poisson arrivals at `request_rate`/s; inf: all at once), at most
    `max_concurrency` in flight; returns the results in spec order and the wall time (s)."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or len(specs))
    url = base_url.rstrip("/") + "/v1/completions"
    timeout = httpx.Timeout(600.0, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits,
                                 headers={"Authorization": f"Bearer {api_key}"}) as client:
        async def one(spec: RequestSpec) -> RequestResult:
            async with limit:
                return await send(client, url, model, spec, ignore_eos)

        start = time.perf_counter()
        tasks = []
        for spec in specs:
            tasks.append(asyncio.ensure_future(one(spec)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start


def percentiles_ms(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 (nearest rank) and the mean of `values` (seconds), in ms."""
    if not values:
        return {f"p{q}_ms": None for q in QUANTILES} | {"mean_ms": None}
    xs = sorted(values)
    out: dict[str, float | None] = {
        f"p{q}_ms": round(xs[min(len(xs) - 1, math.ceil(q / 100 * len(xs)) - 1)] * 1e3, 2)
        for q in QUANTILES}
    out["mean_ms"] = round(sum(xs) / len(xs) * 1e3, 2)
    return out


def summarize(results: list[RequestResult], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    """The report of one run (no raw samples)."""
    ok = [r for r in results if r.ok]
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]

    def meets_slo(r: RequestResult) -> bool:
        tpot = r.tpot_s or 0.0
        return ((slo_ttft_ms is None or r.ttft_s * 1e3 <= slo_ttft_ms)
                and (slo_tpot_ms is None or tpot * 1e3 <= slo_tpot_ms))

    good = [r for r in ok if meets_slo(r)]
    errors = sorted({r.error for r in results if not r.ok})[:5]
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": errors, "duration_s": round(duration_s, 2),
        "request_throughput": round(len(ok) / duration_s, 3),
        "output_throughput": round(sum(r.output_tokens for r in ok) / duration_s, 1),
        "goodput": round(len(good) / duration_s, 3),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms,
                "met_fraction": round(len(good) / len(results), 3) if results else None},
        "ttft": percentiles_ms([r.ttft_s for r in ok]), "tpot": percentiles_ms(tpots),
        "itl": percentiles_ms([x for r in ok for x in r.itl_s]),
        "e2e": percentiles_ms([r.latency_s for r in ok]),
    }


def plot(runs: list[tuple[str, list[RequestResult]]], path: Path, title: str) -> Path:
    """CDFs of TTFT and ITL (ms) for each labelled run, as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, results in runs:
        ok = [r for r in results if r.ok]
        for ax, values in zip(axes, ([r.ttft_s for r in ok], [x for r in ok for x in r.itl_s])):
            xs = sorted(v * 1e3 for v in values)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    for ax, name in zip(axes, ("TTFT", "inter-token latency")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    p.add_argument("--workload", choices=("random", "mixed"), default="random")
    p.add_argument("--num-prompts", type=int, default=100, help="per rate")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--long-input-len", type=int, default=1024)
    p.add_argument("--long-output-len", type=int, default=16)
    p.add_argument("--long-fraction", type=float, default=0.25)
    p.add_argument("--vocab-size", type=int, default=500, help="prompt ids are below it")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf")
    p.add_argument("--sweep-rates", default=None, help="comma-separated request rates")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests sent first")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-local", action="store_true",
                   help="start and compare two local deployments of the small model")
    p.add_argument("--model-path", default=None, help="--compare-local: this model, not a "
                   "fresh `make-model --preset small`")
    p.add_argument("--disagg-threshold", type=int, default=64,
                   help="--compare-local: RouterConfig.disagg_threshold_tokens")
    p.add_argument("--out", default=None, help="default: benchmarks/results/serving.json "
                   "(serving_compare_local.json with --compare-local)")
    args = p.parse_args(argv)
    rates = args.sweep_rates.split(",") if args.sweep_rates else [str(args.request_rate)]
    try:
        args.rates = [float(r) for r in rates]
    except ValueError:
        p.error(f"--sweep-rates must be comma-separated numbers, got {args.sweep_rates!r}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    return args


def workload_setup(args: argparse.Namespace) -> dict:
    """The options that shape the load (for the JSON; no API key)."""
    keys = ("workload", "num_prompts", "input_len", "output_len", "long_input_len",
            "long_output_len", "long_fraction", "max_concurrency", "warmup", "seed")
    return {k: getattr(args, k) for k in keys}


def workload_of(args: argparse.Namespace, vocab_size: int, seed: int) -> list[RequestSpec]:
    return make_workload(args.workload, args.num_prompts, args.input_len, args.output_len,
                         vocab_size, seed, args.long_input_len, args.long_output_len,
                         args.long_fraction)


def measure(args: argparse.Namespace, base_url: str, model: str, rate: float,
            vocab_size: int) -> tuple[dict, list[RequestResult]]:
    """Warm up, then one measured run at `rate`: (summary, results)."""
    if args.warmup:  # one of each kind the workload sends, then short ones
        warm = make_workload(args.workload, args.warmup, args.input_len, 4, vocab_size, -1,
                             args.long_input_len, 2, 1 / max(2, args.warmup))
        asyncio.run(run_load(base_url, model, warm, math.inf, None, args.api_key,
                             args.ignore_eos))
    results, duration = asyncio.run(run_load(
        base_url, model, workload_of(args, vocab_size, args.seed), rate, args.max_concurrency,
        args.api_key, args.ignore_eos, args.seed))
    summary = summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    return {"request_rate": rate if math.isfinite(rate) else "inf", **summary}, results


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.compare_local:
        from serving_local import compare_local

        return compare_local(args, command_line(argv))
    base_url = args.base_url.rstrip("/")
    model = args.model or httpx.get(f"{base_url}/v1/models", timeout=30, headers={
        "Authorization": f"Bearer {args.api_key}"}).json()["data"][0]["id"]
    out = Path(args.out or RESULTS / "serving.json")
    runs, raw = [], []
    for rate in args.rates:
        summary, results = measure(args, base_url, model, rate, args.vocab_size)
        print(f"rate {summary['request_rate']}: {summary['request_throughput']} req/s, "
              f"{summary['output_throughput']} tok/s, TTFT {summary['ttft']}, ITL "
              f"{summary['itl']}")
        runs.append(summary)
        raw.append((f"{summary['request_rate']} req/s", results))
    png = plot(raw, out.with_suffix(".png"), f"{model} at {base_url} ({args.workload})")
    best = max(runs, key=lambda r: r["goodput"])
    result = {"benchmark": "serving", "base_url": base_url, "model": model,
              "workload": workload_setup(args), "runs": runs,
              "best_goodput": best["goodput"],
              "goodput_vs_throughput_ratio": round(
                  best["goodput"] / best["request_throughput"], 3)
              if best["request_throughput"] else None,
              "plot": str(png), "command": command_line(argv)}
    return emit(result, out)


if __name__ == "__main__":
    main()
