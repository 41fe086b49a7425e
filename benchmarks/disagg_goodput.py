"""Does disaggregation pay? The Ray app (`cleave serve`; `--mode local`: the process-per-worker
local mode, no Ray) in three layouts on the same cores and the same seeded workload, over a
sweep of arrival rates:

- aggregated: 2 workers that prefill and decode, each pinned to a core of its own;
- disaggregated: 1 prefill + 1 decode worker on the same two cores, every prompt handed off
  (`disagg_threshold_tokens` 0);
- conditional: the same two workers, prompts with fewer uncached tokens than
  `--threshold` prefilled on the decode worker (the router's threshold policy).

Workers are pinned with the pools' `cpu_affinity` (each claims one core, one torch thread), as
if each had a GPU of its own; the router, Ray's daemons and the load generator are not pinned
and share both cores, the same way in every layout (the output says which process ran where).

The workload: Poisson arrivals of short requests (`--short-input` prompt tokens, `--short-output`
output tokens) mixed with long prompts (`--long-min`..`--long-max` tokens, `--long-output`
tokens), a `--long-fraction` of them, so long prompts arrive while others decode.

The SLO is picked as DistServe picks it, from single-request latencies: one request at a time on
the aggregated layout gives each class's TTFT (p50) and the ITL (p50); a request meets the SLO
when its TTFT is within `--ttft-scale` (5) times its class's and its slowest gap between tokens
within `--itl-scale` (20) times the ITL: an ITL-tight SLO in the sense that matters here, no
stall a user would see (a 1.5k-token prefill stalls a co-located stream about 80 ITLs), yet
above the gaps two cores shared with the router, Ray and the client put into any stream. The
goodput under the same TTFT bound and 2, 5, 10, 20 and 40 ITLs is reported beside it
(`goodput_by_itl_slo_ms`), and every request's TTFT and slowest gap (`per_request`), so any other
SLO can be read off the same run. Goodput: requests per second meeting the SLO.

Last line: one JSON object (ratios under keys ending in `_ratio`), also written to
benchmarks/results/disagg_goodput.json with the command, and a PNG of goodput and ITL p99 against
the rate beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import yaml
from loadgen import RequestResult, RequestSpec, percentiles_ms, run_load
from results_io import RESULTS, command_line, emit
from local_app import LocalApp
from serving_ray import RayApp

from cluster.cpu_affinity import affinity_of
from workers.models.make_model import make_model

LAYOUTS = ("aggregated", "disaggregated", "conditional")


def layout_config(layout: str, cores: list[int], threshold: int) -> dict:
    """The Cleave config of one layout: every worker one core of `cores`, one torch thread."""
    pool = {"cpus_per_rank": 1, "cpu_affinity": cores}
    if layout == "aggregated":
        pools = {"aggregated": {**pool, "replicas": {"min": 2, "max": 2, "initial": 2}}}
        router = {}
    else:
        one = {"min": 1, "max": 1, "initial": 1}
        pools = {"prefill": {**pool, "replicas": one}, "decode": {**pool, "replicas": one}}
        router = {"disagg_threshold_tokens": threshold if layout == "conditional" else 0}
    return {"pools": pools, "router": router}


def workload(args: argparse.Namespace, rate: float, vocab: int, seed: int) -> list[RequestSpec]:
    """`rate` x `--duration` requests, each long with probability `--long-fraction`."""
    rng = random.Random(seed)
    specs = []
    for _ in range(max(1, round(rate * args.duration))):
        long = rng.random() < args.long_fraction
        n = rng.randint(args.long_min, args.long_max) if long else args.short_input
        specs.append(RequestSpec([rng.randrange(10, vocab) for _ in range(n)],
                                 args.long_output if long else args.short_output,
                                 "long" if long else "short"))
    return specs


def run(base_url: str, specs: list[RequestSpec], rate: float, concurrency: int | None,
        seed: int) -> tuple[list[RequestResult], float]:
    return asyncio.run(run_load(base_url, "model", specs, rate, concurrency, seed=seed))


def single_request_latencies(base_url: str, args: argparse.Namespace, vocab: int) -> dict:
    """Each class's TTFT p50 and the ITL p50, one request at a time (4 short requests, 3 long
    ones of the mean long length; fresh prompts, no prefix hits)."""
    rng = random.Random(999)
    mean_long = (args.long_min + args.long_max) // 2

    def spec(n: int, out: int, kind: str) -> RequestSpec:
        return RequestSpec([rng.randrange(10, vocab) for _ in range(n)], out, kind)

    specs = ([spec(args.short_input, args.short_output, "short") for _ in range(4)]
             + [spec(mean_long, args.long_output, "long") for _ in range(3)])
    results, _ = run(base_url, specs, math.inf, 1, 0)
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"single requests failed: {bad}")
    by_kind = {k: percentiles_ms([r.ttft_s for r in results if r.kind == k])["p50_ms"]
               for k in ("short", "long")}
    itl = percentiles_ms([x for r in results for x in r.itl_s])["p50_ms"]
    return {"ttft_p50_ms": by_kind, "itl_p50_ms": itl, "long_prompt_tokens": mean_long}


def max_gap_ms(r: RequestResult) -> float:
    return max(r.itl_s) * 1e3 if r.itl_s else 0.0


def meets(r: RequestResult, slo: dict, itl_ms: float | None = None) -> bool:
    return (r.ok and r.ttft_s * 1e3 <= slo["ttft_ms"][r.kind]
            and max_gap_ms(r) <= (slo["itl_ms"] if itl_ms is None else itl_ms))


def summarize(results: list[RequestResult], duration_s: float, slo: dict) -> dict:
    ok = [r for r in results if r.ok]
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    return {"requests": len(results), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if not r.ok})[:3],
            "duration_s": round(duration_s, 1),
            "output_throughput": round(sum(r.output_tokens for r in ok) / duration_s, 1),
            "goodput": round(sum(meets(r, slo) for r in results) / duration_s, 3),
            "slo_met_fraction": round(sum(meets(r, slo) for r in results) / len(results), 3),
            # the same TTFT bound, each ITL bound of the sweep
            "goodput_by_itl_slo_ms": {str(ms): round(sum(meets(r, slo, ms) for r in results)
                                                     / duration_s, 3)
                                      for ms in slo["itl_sweep_ms"]},
            "ttft_met_fraction": round(sum(r.ok and r.ttft_s * 1e3 <= slo["ttft_ms"][r.kind]
                                           for r in results) / len(results), 3),
            "ttft": {k: percentiles_ms([r.ttft_s for r in ok if k in ("all", r.kind)])
                     for k in ("all", "short", "long")},
            "itl": percentiles_ms([x for r in ok for x in r.itl_s]),
            # each request's slowest gap between tokens: what a stalled stream looks like
            "max_gap": percentiles_ms([max(r.itl_s) for r in ok if r.itl_s]),
            "tpot": percentiles_ms(tpots),
            # per request: class, TTFT ms, slowest gap ms (the SLO can be re-read from these)
            "per_request": [[r.kind[0], round(r.ttft_s * 1e3, 1), round(max_gap_ms(r), 1)]
                            for r in ok]}


def run_layout(layout: str, model: str, args: argparse.Namespace, vocab: int,
               tmp: str) -> dict:
    """Start the layout, warm it, optionally take the single-request latencies, then the
    sweep. Returns {"placement", "single" (or None), "runs": {rate: (results, duration)}}."""
    path = Path(tmp, f"{layout}.yaml")
    path.write_text(yaml.safe_dump(layout_config(layout, args.cores, args.threshold)))
    if args.mode == "ray":
        app = RayApp(model, "model", config=str(path), num_cpus=len(args.cores) + 2).start()
        workers, routers = app.processes("EngineActor"), app.processes(
            "ServeReplica:cleave:router")
    else:
        app = LocalApp(model, "model", config=str(path), num_workers=2).start()
        workers, routers = app.processes(), [app.pid]
    try:
        placement = {"workers": {pid: list(affinity_of(pid)) for pid in workers},
                     "routers": {pid: list(affinity_of(pid)) for pid in routers}}
        print(f"{layout}: placement {placement}", file=sys.stderr)
        warm = workload(args, 4 / args.duration, vocab, 12345)[:4]
        run(app.base_url, [RequestSpec(s.prompt, 2, s.kind) for s in warm], math.inf, None, 0)
        single = (single_request_latencies(app.base_url, args, vocab)
                  if layout == "aggregated" else None)
        runs = {}
        for i, rate in enumerate(args.rates):
            specs = workload(args, rate, vocab, args.seed + i)
            runs[rate] = run(app.base_url, specs, rate, None, args.seed + i)
            print(f"{layout} @ {rate}/s: {len(specs)} requests, "
                  f"{sum(r.ok for r in runs[rate][0])} ok in {runs[rate][1]:.1f} s",
                  file=sys.stderr)
        return {"placement": placement, "single": single, "runs": runs}
    finally:
        app.stop()


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (good, itl, stall) = plt.subplots(1, 3, figsize=(15, 4))
    for layout, rows in report["layouts"].items():
        rates = [float(r) for r in rows]
        good.plot(rates, [rows[r]["goodput"] for r in rows], marker="o", label=layout)
        itl.plot(rates, [rows[r]["itl"]["p99_ms"] for r in rows], marker="o", label=layout)
        stall.plot(rates, [short_max_gap_p90(rows[r]) for r in rows], marker="o", label=layout)
    good.set_ylabel("goodput (requests/s within SLO)")
    itl.set_ylabel("ITL p99 over all gaps (ms)")
    stall.set_ylabel("short requests' slowest gap, p90 (ms)")
    for ax in (itl, stall):
        ax.set_yscale("log")
    for ax in (good, itl, stall):
        ax.set_xlabel("arrival rate (requests/s)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("Ray app, 2 workers pinned to a core each: aggregated vs disaggregated vs "
                 "conditional")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def short_max_gap_p90(row: dict) -> float:
    """The 90th percentile over short requests of each one's slowest gap (ms): a stall."""
    gaps = sorted(gap for kind, _, gap in row["per_request"] if kind == "s")
    return gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))] if gaps else 0.0


def ratios(layouts: dict) -> dict:
    out = {}
    agg, dis, cond = (layouts[name] for name in LAYOUTS)
    for rate in agg:
        a, d, c = agg[rate], dis[rate], cond[rate]
        out[f"itl_p99_aggregated_over_disaggregated_at_{rate}_ratio"] = round(
            a["itl"]["p99_ms"] / max(d["itl"]["p99_ms"], 1e-9), 2)
        for name, other in (("disaggregated", d), ("conditional", c)):
            out[f"short_max_gap_p90_aggregated_over_{name}_at_{rate}_ratio"] = round(
                short_max_gap_p90(a) / max(short_max_gap_p90(other), 1e-9), 2)
            out[f"goodput_{name}_over_aggregated_at_{rate}_ratio"] = round(
                other["goodput"] / a["goodput"], 2) if a["goodput"] else None
        best = max(a["goodput"], d["goodput"])
        out[f"goodput_conditional_over_best_at_{rate}_ratio"] = round(
            c["goodput"] / best, 2) if best else None
    return out


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder; default: the small preset")
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                   default=[0.5, 1.0, 2.0, 3.0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    p.add_argument("--cores", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1])
    p.add_argument("--threshold", type=int, default=512)
    p.add_argument("--short-input", type=int, default=128)
    p.add_argument("--short-output", type=int, default=64)
    p.add_argument("--long-min", type=int, default=1024)
    p.add_argument("--long-max", type=int, default=2048)
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument("--long-fraction", type=float, default=0.2)
    p.add_argument("--ttft-scale", type=float, default=5.0)
    p.add_argument("--itl-scale", type=float, default=20.0,
                   help="the headline SLO's bound on a request's slowest gap, in single-request "
                        "ITLs (goodput at 2, 5, 10, 20 and 40 is reported too)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=("ray", "local"), default="ray",
                   help="ray: `cleave serve`; local: `cleave serve --in-process "
                        "--process-per-worker` (each worker its own process, no Ray)")
    p.add_argument("--layouts", type=lambda s: s.split(","), default=list(LAYOUTS),
                   help="a subset to look at one (aggregated first: it sets the SLO)")
    p.add_argument("--out", default=str(RESULTS / "disagg_goodput.json"))
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="disagg-goodput-")
    model = args.model or str(make_model(Path(tmp) / "small", arch="llama", preset="small"))
    vocab = json_vocab(model)
    raw = {layout: run_layout(layout, model, args, vocab, tmp) for layout in args.layouts}
    single = raw["aggregated"]["single"]
    slo = {"ttft_ms": {k: round(v * args.ttft_scale, 1)
                       for k, v in single["ttft_p50_ms"].items()},
           "itl_ms": round(single["itl_p50_ms"] * args.itl_scale, 1),
           "itl_sweep_ms": [round(single["itl_p50_ms"] * x, 1) for x in (2, 5, 10, 20, 40)],
           "rule": f"TTFT <= {args.ttft_scale}x its class's single-request TTFT p50 and every "
                   f"gap between tokens <= {args.itl_scale}x the single-request ITL p50"}
    layouts = {name: {str(rate): summarize(*res, slo) for rate, res in r["runs"].items()}
               for name, r in raw.items()}
    report = {"benchmark": "disagg_goodput", "command": command_line(None),
              "setup": {k: v for k, v in vars(args).items() if k != "out"} | {
                  "model": "small preset (llama, ~40M parameters, fp32)" if not args.model
                  else args.model,
                  "cores": "each worker pinned to one core of --cores (one torch thread); "
                           "router, Ray's daemons and the load generator unpinned, on all "
                           "cores, in every layout",
                  "placement": {n: r["placement"] for n, r in raw.items()},
                  "time": time.strftime("%Y-%m-%d %H:%M")},
              "single_request": single, "slo": slo, "layouts": layouts} | (
                  ratios(layouts) if list(layouts) == list(LAYOUTS) else {})
    plot(report, Path(args.out).with_suffix(".png"))
    emit(report, Path(args.out))
    return report


def json_vocab(model: str) -> int:
    import json

    return json.loads(Path(model, "config.json").read_text())["vocab_size"]


if __name__ == "__main__":
    main()
