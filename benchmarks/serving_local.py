"""`serving.py --compare-local`: two deployments of one model started in this process with
`cluster.local_server.LocalServer`, the same mixed workload on each, and the ITL p99 ratio.

- aggregated: two "both" workers (each prefills and decodes its own requests);
- disaggregated: one prefill and one decode worker, KV handed off over TCP on 127.0.0.1.

Everything (the engines, the router, this load generator) shares this machine's CPU cores and
one Python process, so a prefill on the prefill worker still takes cycles from the decode worker:
on CPU the ratio shows the scheduling effect only, not the isolation separate GPUs give.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from loadgen import Workload, measure, plot
from results_io import RESULTS, emit

from cluster.local_server import LocalServeConfig, LocalServer

LAYOUTS = {
    "aggregated": {"num_workers": 2},
    "disaggregated": {"num_prefill_workers": 1, "num_decode_workers": 1},
}
NOTE = ("CPU-bound, in-process: all workers, the router and the load generator share "
        "{cores} CPU core(s) and one Python process, so prefill on the prefill worker still "
        "competes with decode; disaggregation's benefit is limited here compared with GPUs")


def start(model_path: str, layout: dict, threshold: int) -> LocalServer:
    config = LocalServeConfig(model_path, http_port=0, grpc_port=0, transport="tcp",
                              router={"disagg_threshold_tokens": threshold}, **layout)
    return LocalServer(config).start(timeout_s=300)


def run_layout(model_path: str, name: str, workload: Workload, rate: float,
               threshold: int) -> tuple[dict, list]:
    server = start(model_path, LAYOUTS[name], threshold)
    try:
        base_url = f"http://127.0.0.1:{server.http_port}"
        vocab_size = server.workers[0].vocab_size
        summary, results = measure(base_url, server.router.model_name, workload, rate,
                                   vocab_size)
        c = server.router.counters
        # other processes on this machine (its 1-minute load average) skew the figures
        summary["load_average_1m"] = round(os.getloadavg()[0], 2)
        summary["router"] = {"disaggregated": c.num_disaggregated,
                             "aggregated_by_reason": dict(c.aggregated),
                             "fallbacks": dict(c.fallbacks),
                             "first_tokens_by_worker": dict(c.first_tokens_by_worker)}
    finally:
        server.stop()
    return summary, results


def compare_local(model: str | None, workload: Workload, rate: float, threshold: int,
                  out: str | None, command: str) -> dict:
    """Both layouts on the same workload (seeded identically) at `rate`, on `model` (None: a
    fresh `small` preset); emits and returns the JSON."""
    if workload.kind != "mixed":
        print(f"note: --compare-local with the {workload.kind!r} workload (the issue's "
              "comparison uses --workload mixed)")
    out = Path(out or RESULTS / "serving_compare_local.json")
    with tempfile.TemporaryDirectory(prefix="cleave-small-") as tmp:
        model_path = model
        if model_path is None:
            from workers.make_model import make_model

            t0 = time.perf_counter()
            model_path = str(make_model(Path(tmp) / "small", preset="small"))
            print(f"made the small model in {time.perf_counter() - t0:.1f}s")
        summaries, raw = {}, []
        for name in LAYOUTS:
            t0 = time.perf_counter()
            summaries[name], results = run_layout(model_path, name, workload, rate, threshold)
            s = summaries[name]
            print(f"{name}: ITL {s['itl']}  TTFT {s['ttft']}  {s['output_throughput']} tok/s "
                  f"({time.perf_counter() - t0:.0f}s)")
            raw.append((name, results))
    agg = summaries["aggregated"]["itl"]["p99_ms"]
    dis = summaries["disaggregated"]["itl"]["p99_ms"]
    png = plot(raw, out.with_suffix(".png"),
               "small model, mixed workload: 2 aggregated vs 1 prefill + 1 decode (CPU)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    result = {
        "benchmark": "serving_compare_local",
        "model": model or "cleave make-model --preset small (llama)",
        "workload": workload.setup() | {"request_rate": summaries["aggregated"]["request_rate"]},
        "disagg_threshold_tokens": threshold,
        "aggregated": summaries["aggregated"], "disaggregated": summaries["disaggregated"],
        "itl_p99_ms_aggregated": agg, "itl_p99_ms_disaggregated": dis,
        "itl_p99_ratio": round(agg / dis, 3) if agg and dis else None,
        "note": NOTE.format(cores=cores), "plot": str(png), "command": command,
    }
    print(f"ITL p99: aggregated {agg} ms, disaggregated {dis} ms, ratio "
          f"{result['itl_p99_ratio']} (aggregated / disaggregated; > 1: disaggregation helps)")
    print(result["note"])
    return emit(result, out)
