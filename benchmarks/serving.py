"""Online serving benchmarks against OpenAI-compatible servers (`/v1/completions`, streamed),
with the load generator of `loadgen.py`. Two modes:

1. Against any running server (`--base-url`): requests arriving as a Poisson process
   (`--request-rate`, inf: all at once) and/or capped at `--max-concurrency` in flight;
   `--sweep-rates 1,2,4` runs one level per rate. Prompts are random token ids (exact input
   lengths, no tokenizer needed; ids below `--vocab-size`): `--workload random` (`--input-len`
   in, `--output-len` out) or `mixed` (the same, with a `--long-fraction` of long prompts,
   `--long-input-len` in and `--long-output-len` out, arriving while the others decode). Per
   level: TTFT, TPOT, inter-token latency (ITL) and end-to-end latency p50/p90/p99, requests/s,
   output tokens/s, and goodput under `--slo-ttft-ms` / `--slo-tpot-ms`; a PNG of the TTFT
   and ITL distributions lands next to the JSON.

2. `--layers offline,inprocess_agg,inprocess,inprocess_ppw,ray,transformers` (or `all`;
   `serving_layers.py`):
   one fixed-concurrency sweep (`--concurrency 1,8,32,64`) through the offline engine, the
   in-process server, the Ray app (`cleave serve`) and a transformers static-batch loop, on the
   same requests, for each of `--models` (tiny: the embedded default; small: the preset; or a
   folder); `--guidellm` adds guidellm's own measurement of the in-process server at the
   largest concurrency, against the load generator's (`serving_guidellm.py`).

Whether disaggregation pays is `disagg_goodput.py` (the Ray app, workers pinned to cores of
their own, a sweep of arrival rates); it replaced this script's `--compare-local`, whose
deployments shared one process.

Last line: one JSON object; also written to benchmarks/results/ with the command.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from loadgen import Workload, measure, plot, served_model
from results_io import RESULTS, command_line, emit


def _ints(p: argparse.ArgumentParser, flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        p.error(f"{flag} must be comma-separated integers >= 1, got {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from serving_layers import LAYERS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    p.add_argument("--workload", choices=("random", "mixed"), default="random")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="per rate (default 100); --layers: per concurrency (default "
                        "max(16, 2 x concurrency))")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=None, help="default 128; --layers: 64")
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
    p.add_argument("--disagg-threshold", type=int, default=64,
                   help="--layers: RouterConfig.disagg_threshold_tokens")
    p.add_argument("--layers", default=None,
                   help=f"comma-separated, of {', '.join(LAYERS)}; or all")
    p.add_argument("--concurrency", default="1,8,32,64", help="--layers: streams per level")
    p.add_argument("--rounds", type=int, default=1,
                   help="--layers: passes over the layers in turn; each figure is the round "
                        "of median throughput")
    p.add_argument("--models", default="tiny",
                   help="--layers: comma-separated tiny (the embedded default), small (the "
                        "preset, made for this run) or model folders, each optionally "
                        "LABEL=folder (the label prefixes its ratios' keys)")
    p.add_argument("--ray-num-cpus", type=float, default=4,
                   help="--layers ray: logical CPUs of cleave serve's local Ray")
    p.add_argument("--time-limit-s", type=float, default=600,
                   help="--layers: per level and layer, requests not started by then fail")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="--layers: torch threads in this process (the Ray app's replicas run "
                        "one each); 0: torch's default")
    p.add_argument("--guidellm", action="store_true",
                   help="--layers: also measure the in-process server with guidellm")
    p.add_argument("--guidellm-bin", default=None,
                   help="the guidellm command (default: next to this Python, else on PATH)")
    p.add_argument("--out", default=None, help="default: benchmarks/results/serving.json "
                   "(serving_layers.json with --layers)")
    args = p.parse_args(argv)
    rates = args.sweep_rates.split(",") if args.sweep_rates else [str(args.request_rate)]
    try:
        args.rates = [float(r) for r in rates]
    except ValueError:
        p.error(f"--sweep-rates must be comma-separated numbers, got {args.sweep_rates!r}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    args.concurrencies = _ints(p, "--concurrency", args.concurrency)
    if args.layers is not None:
        args.layer_list = list(LAYERS) if args.layers == "all" else args.layers.split(",")
        unknown = [x for x in args.layer_list if x not in LAYERS]
        if unknown:
            p.error(f"--layers: unknown {unknown}; choose from {', '.join(LAYERS)} or all")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.guidellm and args.layers is None:
        p.error("--guidellm runs with --layers (it measures the in-process server)")
    return args


def workload_of(args: argparse.Namespace) -> Workload:
    """Mode 1: the load the flags describe."""
    return Workload(args.workload, args.num_prompts or 100, args.input_len, args.output_len or 128,
                    args.long_input_len, args.long_output_len, args.long_fraction,
                    args.max_concurrency, args.warmup, args.seed, args.ignore_eos,
                    args.slo_ttft_ms, args.slo_tpot_ms, args.api_key)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.layers is not None:
        from serving_layers import layers_main

        return layers_main(args, command_line(argv))
    base_url = args.base_url.rstrip("/")
    model = args.model or served_model(base_url, args.api_key)
    out = Path(args.out or RESULTS / "serving.json")
    workload = workload_of(args)
    runs, raw = [], []
    for rate in args.rates:
        summary, results = measure(base_url, model, workload, rate, args.vocab_size)
        print(f"rate {summary['request_rate']}: {summary['request_throughput']} req/s, "
              f"{summary['output_throughput']} tok/s, TTFT {summary['ttft']}, ITL "
              f"{summary['itl']}")
        runs.append(summary)
        raw.append((f"{summary['request_rate']} req/s", results))
    png = plot(raw, out.with_suffix(".png"), f"{model} at {base_url} ({args.workload})")
    best = max(runs, key=lambda r: r["goodput"])
    result = {"benchmark": "serving", "base_url": base_url, "model": model,
              "workload": workload.setup(), "runs": runs,
              "best_goodput": best["goodput"],
              "goodput_vs_throughput_ratio": round(
                  best["goodput"] / best["request_throughput"], 3)
              if best["request_throughput"] else None,
              "plot": str(png), "command": command_line(argv)}
    return emit(result, out)


if __name__ == "__main__":
    main()
