"""What the Ray app's served path adds to the engine's steps, per layout: the inputs
`benchmarks/planner_calibrate.py` was missing (its simulator ran the disaggregated layout's
first token at the end of the prefill and gave the two workers both cores to themselves).

Each layout (`cleave serve` on two workers pinned to a core each, as `benchmarks/planner.py`
runs them: aggregated and 1P+1D) started `--turns` times in turn (both cannot hold the cores
at once; the machine's drift falls on both):
- **single requests**, one at a time (`--rounds` of 4 short requests and one long one a turn,
  fresh prompts): each class's TTFT p50 and p90 and the ITL p50 and p90. The 1P+1D layout's
  first token goes through a prefill call and its handoff (`router.orchestrator`): its TTFT
  over the aggregated layout's, the median of the turns' differences per class, is that
  path's cost (`handoff_s` of `router.profiles`);
- **the CPU the rest of the app takes under load** (first turn): the trace's first phase
  (short chat, Poisson at `--rate`) replayed for `--load-s` seconds while the CPU time of
  every process of the app (`cleave serve`, its Ray's daemons, Serve's controller, proxy and
  router replicas) and of this process (the load generator) is read before and after: the
  engine actors' cores and the others' (`other_cores`). While both workers step, each has
  (2 - other_cores) / 2 of a core: the co-run factor 2 / (2 - other_cores).

    python benchmarks/planner_overheads.py

Last line: one JSON object, also written to benchmarks/results/planner_overheads.json.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import yaml
from disagg_goodput import json_vocab, layout_config, run
from loadgen import RequestSpec, percentiles_ms
from planner import start_app
from results_io import RESULTS, command_line, emit
from serving_ray import RayApp

from workers.models.make_model import make_model

ENGINE = "EngineActor"


def app_cpu_s(app: RayApp) -> tuple[float, float]:
    """(engine actors', everything else's) CPU seconds so far: `cleave serve`, its Ray's
    processes, and this process."""
    engines = set(app.processes(ENGINE))
    engine = other = 0.0
    for pid in {app.pid, os.getpid(), *app.ray_pids()}:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        if pid in engines:
            engine += t.user + t.system
        else:
            other += t.user + t.system
    return engine, other


def singles(base_url: str, vocab: int, rounds: int, long: int, seed: int) -> list:
    """`rounds` x (4 short requests and one long one), one at a time, fresh prompts."""
    rng = random.Random(seed)
    specs = [RequestSpec([rng.randrange(10, vocab) for _ in range(n)], out, kind)
             for _ in range(rounds)
             for n, out, kind in [(128, 128, "short")] * 4 + [(long, 64, "long")]]
    results, _ = run(base_url, specs, math.inf, 1, 0)
    return results


def summary(got: dict[str, list[list]]) -> dict:
    """Each layout's TTFT p50 / p90 per class and ITL p50 / p90 over all its turns; the 1P+1D
    layout's TTFT p50 over the aggregated one's, per class, the median of the turns'."""
    pick = lambda xs: {q: v for q, v in percentiles_ms(xs).items()  # noqa: E731
                       if q in ("p50_ms", "p90_ms")}
    out: dict = {name: {"ttft": {k: pick([r.ttft_s for t in turns for r in t if r.kind == k])
                                 for k in ("short", "long")},
                        "itl": pick([x for t in turns for r in t for x in r.itl_s])}
                 for name, turns in got.items()}
    if {"aggregated", "disaggregated"} <= set(got):
        med = lambda t, k: statistics.median(r.ttft_s for r in t if r.kind == k)  # noqa: E731
        out["disaggregated_minus_aggregated_ttft_ms"] = {}
        for k in ("short", "long"):
            d = [(med(b, k) - med(a, k)) * 1e3
                 for a, b in zip(got["aggregated"], got["disaggregated"])]
            out["disaggregated_minus_aggregated_ttft_ms"][k] = {
                "median": round(statistics.median(d), 1), "turns": [round(x, 1) for x in d]}
    return out


def under_load(app: RayApp, vocab: int, rate: float, seconds: float) -> dict:
    rng = random.Random(7)
    specs = [RequestSpec([rng.randrange(10, vocab) for _ in range(128)], 128, "short")
             for _ in range(max(1, round(rate * seconds)))]
    before, wall = app_cpu_s(app), time.perf_counter()
    results, _ = run(app.base_url, specs, rate, None, 1)
    after, wall = app_cpu_s(app), time.perf_counter() - wall
    engine, other = ((b - a) / wall for a, b in zip(before, after))
    return {"requests": len(results), "ok": sum(r.ok for r in results),
            "wall_s": round(wall, 1), "engine_cores": round(engine, 3),
            "other_cores": round(other, 3), "corun": round(2 / (2 - min(other, 1.9)), 3)}


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", type=lambda s: s.split(","),
                   default=["aggregated", "disaggregated"])
    p.add_argument("--turns", type=int, default=2,
                   help="each layout started this many times, in turn (drift falls on both)")
    p.add_argument("--rounds", type=int, default=3,
                   help="single requests a turn: rounds of 4 short and one long")
    p.add_argument("--long-input", type=int, default=2048)
    p.add_argument("--rate", type=float, default=1.2, help="requests/s under load")
    p.add_argument("--load-s", type=float, default=60.0)
    p.add_argument("--out", default=str(RESULTS / "planner_overheads.json"))
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="overheads-")
    model = str(make_model(Path(tmp) / "small", arch="llama", preset="small"))
    vocab = json_vocab(model)
    got: dict[str, list[list]] = {name: [] for name in args.layouts}
    load = {}
    for turn in range(args.turns):
        for name in args.layouts:
            path = Path(tmp, f"{name}.yaml")
            path.write_text(yaml.safe_dump(layout_config(name, [0, 1], 512)))
            app = start_app(model, str(path), 4)
            try:
                run(app.base_url, [RequestSpec([10 + turn] * 128, 2, "short")] * 2, math.inf,
                    1, 0)
                got[name].append(singles(app.base_url, vocab, args.rounds, args.long_input,
                                         999 + turn))
                if turn == 0:
                    load[name] = under_load(app, vocab, args.rate, args.load_s)
            finally:
                app.stop()
    return emit({"benchmark": "planner_overheads", "command": command_line(None),
                 "time": time.strftime("%Y-%m-%d %H:%M"),
                 "load_average": os.getloadavg(), "single": summary(got), "load": load},
                Path(args.out))


if __name__ == "__main__":
    main()
