"""The SLO planner on the Ray app against fixed layouts: `cleave serve` on two workers pinned to
a core each (`benchmarks/disagg_goodput.py`'s layouts: aggregated, 1P+1D, conditional at the
default threshold), and the same two workers as one aggregated pool with the router's SLO
planner on (`--slo-ttft-ms` / `--slo-itl-ms`: it switches a worker's role and moves the
disaggregation threshold as the mix moves), each replaying the same seeded trace in turn:

    phase 0: short chat      (`--short-input` 128-token prompts, `--short-output` 128 out)
    phase 1: summarization   (`--long-input` 2,048-token prompts, `--long-output` 64 out)
    phase 2: short chat again

each `--phase-s` seconds (300: the 15-minute trace) of Poisson arrivals at its `--rates`.

The SLO is disagg_goodput's (its functions, reused): each class's single-request TTFT p50 and
the ITL p50 measured on the aggregated layout; a request meets the SLO when its TTFT is within
`--ttft-scale` (5) times its class's and its slowest gap between tokens within `--itl-scale`
(20) times the ITL. The planner's targets come from it: TTFT, the longer class's bound (the
planner bounds the worst class's); ITL, the gap bound over the planner's `max_gap_itl` (5), so
the planner's gap rule is the SLO's.

Reported: each layout's SLO attainment and goodput per phase and its goodput over the whole
trace (requests meeting the SLO per second of trace), the best fixed layout in hindsight,
`planner_vs_best_fixed_goodput_ratio`, `min_phase_attainment_planner`, the bound any
planner on these two workers has (`best_per_phase_vs_best_fixed_goodput_ratio`: the best fixed
layout of each phase, stitched) and the one any layout has
(`offered_vs_best_fixed_goodput_ratio`: the trace's requests per second, all meeting the SLO,
over the best fixed layout's), the planner's decisions with their times (its `/metrics`,
polled each second, and `cleave status` late in each phase, with the plan's reason), and each
phase's TTFT and ITL percentiles (what `benchmarks/simulate.py` calibrates against). Last
line: one JSON object, also written to benchmarks/results/planner.json with the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml
from disagg_goodput import json_vocab, layout_config, meets, run, single_request_latencies
from disagg_goodput import summarize
from loadgen import RequestResult, RequestSpec, client_session, send
from results_io import RESULTS, command_line, emit
from serving_ray import CLEAVE, RayApp

from workers.models.make_model import make_model

FIXED = ("aggregated", "disaggregated", "conditional")
LAYOUTS = (*FIXED, "planner")
MAX_GAP_ITL = 5.0  # router.planner.SloTargets.max_gap_itl's default


@dataclass(frozen=True)
class Arrival:
    at_s: float  # from the trace's start
    phase: int
    spec: RequestSpec


def phase_kinds(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(class, prompt tokens, output tokens) of each phase."""
    short = ("short", args.short_input, args.short_output)
    return [short, ("long", args.long_input, args.long_output), short]


def trace(args: argparse.Namespace, vocab: int) -> list[Arrival]:
    """The seeded trace: each phase's Poisson arrivals within its `phase_s` window, fresh
    random prompts (no prefix hits)."""
    rng = random.Random(args.seed)
    out = []
    for phase, ((kind, prompt, output), rate) in enumerate(zip(phase_kinds(args), args.rates)):
        t = phase * args.phase_s
        while (t := t + rng.expovariate(rate)) < (phase + 1) * args.phase_s:
            ids = [rng.randrange(10, vocab) for _ in range(prompt)]
            out.append(Arrival(t, phase, RequestSpec(ids, output, kind)))
    return out


async def replay(base_url: str, arrivals: list[Arrival]) -> list[RequestResult]:
    """Send each arrival at its time; the results in trace order."""
    url = base_url.rstrip("/") + "/v1/completions"
    async with client_session() as client:
        start = time.perf_counter()

        async def one(a: Arrival) -> RequestResult:
            await asyncio.sleep(max(0.0, start + a.at_s - time.perf_counter()))
            return await send(client, url, "model", a.spec, True)

        return list(await asyncio.gather(*(one(a) for a in arrivals)))


class PlanWatch:
    """Polls the router's `/metrics` each `every_s` for the planner's gauges; keeps each
    change with its time from `start()`."""

    PATTERN = re.compile(r"^(cleave_planner_\w+)(\{[^}]*\})? (\S+)$")

    def __init__(self, base_url: str, every_s: float = 1.0) -> None:
        self.url, self.every_s = base_url.rstrip("/") + "/metrics", every_s
        self.changes: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def read(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.url, timeout=5).read().decode()
        found = {}
        for line in text.splitlines():
            m = self.PATTERN.match(line)
            if m and not m.group(1).endswith("_created"):
                found[m.group(1)[len("cleave_planner_"):] + (m.group(2) or "")] = float(
                    m.group(3))
        return found

    def start(self) -> PlanWatch:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def _loop(self) -> None:
        last: dict[str, float] = {}
        while not self._stop.wait(self.every_s):
            try:
                now = self.read()
            except OSError:
                continue
            if now != last:
                changed = {k: v for k, v in now.items() if last.get(k) != v}
                self.changes.append({"t_s": round(time.perf_counter() - self._t0, 1),
                                     **{k: (None if math.isinf(v) else v)
                                        for k, v in changed.items()}})
                last = now

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return self.changes


def planner_status(app: RayApp) -> dict:
    """The planner's part of `cleave status --json` (its plan, with the reason, and its
    decisions by kind), or the error."""
    env = dict(os.environ, RAY_TMPDIR=app._tmp, RAY_ADDRESS="auto")
    done = subprocess.run([CLEAVE, "status", "--json"], env=env, capture_output=True,
                          text=True, timeout=120)
    if done.returncode:
        return {"error": done.stderr[-300:]}
    return json.loads(done.stdout).get("planner") or {}


def status_at(app: RayApp, times_s: list[float], out: list[dict]) -> threading.Thread:
    """A thread taking `planner_status` at each of `times_s` (from now) into `out`."""
    t0 = time.perf_counter()

    def loop() -> None:
        for at in times_s:
            time.sleep(max(0.0, t0 + at - time.perf_counter()))
            try:
                out.append({"t_s": round(time.perf_counter() - t0, 1), **planner_status(app)})
            except (OSError, ValueError, subprocess.SubprocessError) as exc:
                out.append({"t_s": round(time.perf_counter() - t0, 1), "error": str(exc)})

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def config_for(layout: str, args: argparse.Namespace, slo: dict | None) -> dict:
    if layout != "planner":
        return layout_config(layout, args.cores, args.threshold)
    if slo is None:
        raise ValueError("the planner's targets come from the SLO: run the aggregated layout "
                         "first")
    pool = {"cpus_per_rank": 1, "cpu_affinity": args.cores,
            "replicas": {"min": 2, "max": 2, "initial": 2}}
    return {"pools": {"aggregated": pool}, "router": planner_targets(slo)}


def planner_targets(slo: dict) -> dict:
    """The router's SLO settings from the benchmark's SLO (see the module)."""
    return {"slo_ttft_ms": max(slo["ttft_ms"].values()),
            "slo_itl_ms": round(slo["itl_ms"] / MAX_GAP_ITL, 1), "slo_percentile": 0.9}


def run_layout(layout: str, model: str, args: argparse.Namespace, vocab: int, tmp: str,
               arrivals: list[Arrival], slo: dict | None) -> dict:
    """Start the layout, warm it, take the single-request latencies on the aggregated layout,
    replay the trace. Returns {"single", "results", "decisions", "log"}."""
    path = Path(tmp, f"{layout}.yaml")
    path.write_text(yaml.safe_dump(config_for(layout, args, slo)))
    app = start_app(model, str(path), len(args.cores) + 2)
    try:
        warm = [RequestSpec(a.spec.prompt, 2, a.spec.kind) for a in arrivals[:2]]
        run(app.base_url, warm, math.inf, None, 0)
        single = single_latencies(app.base_url, args, vocab) if layout == "aggregated" \
            else None
        watch, statuses, status_thread = None, [], None
        if layout == "planner":  # `cleave status` late in each phase
            watch = PlanWatch(app.base_url).start()
            status_thread = status_at(app, [args.phase_s * (k + 0.8) for k in range(3)],
                                      statuses)
        started = time.perf_counter()
        results = asyncio.run(replay(app.base_url, arrivals))
        print(f"{layout}: {sum(r.ok for r in results)}/{len(results)} ok in "
              f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
        if status_thread is not None:
            status_thread.join()
        decisions = watch.stop() if watch is not None else None
        return {"single": single, "results": results, "decisions": decisions,
                "status": statuses or None}
    finally:
        app.stop()


def single_latencies(base_url: str, args: argparse.Namespace, vocab: int) -> dict:
    """Each class's single-request TTFT and the ITL (`disagg_goodput`'s), the classes
    shaped by `args` (`add_trace_options`)."""
    return single_request_latencies(base_url, argparse.Namespace(
        short_input=args.short_input, short_output=args.short_output,
        long_min=args.long_input, long_max=args.long_input, long_output=args.long_output),
        vocab)


def start_app(model: str, config: str, num_cpus: int, tries: int = 2) -> RayApp:
    """`cleave serve` of the layout; a start that fails (Ray's node start timing out on a
    loaded machine) is tried again."""
    for _ in range(tries - 1):
        try:
            return RayApp(model, "model", config=config, num_cpus=num_cpus).start()
        except (RuntimeError, TimeoutError) as exc:
            print(f"cleave serve did not start ({str(exc)[:200]}); again", file=sys.stderr)
    return RayApp(model, "model", config=config, num_cpus=num_cpus).start()


def slo_of(single: dict, args: argparse.Namespace) -> dict:
    return {"ttft_ms": {k: round(v * args.ttft_scale, 1)
                        for k, v in single["ttft_p50_ms"].items()},
            "itl_ms": round(single["itl_p50_ms"] * args.itl_scale, 1),
            "itl_sweep_ms": [round(single["itl_p50_ms"] * x, 1) for x in (2, 5, 10, 20, 40)],
            "rule": f"TTFT <= {args.ttft_scale}x its class's single-request TTFT p50 and every "
                    f"gap between tokens <= {args.itl_scale}x the single-request ITL p50"}


def layout_report(results: list[RequestResult], arrivals: list[Arrival], slo: dict,
                  phase_s: float, phases: int) -> dict:
    """Per phase: attainment, goodput and latency percentiles; the whole trace's goodput."""
    out: dict = {"phases": {}}
    for k in range(phases):
        mine = [r for r, a in zip(results, arrivals) if a.phase == k]
        row = summarize(mine, phase_s, slo) if mine else {"requests": 0}
        row.pop("per_request", None)
        row.pop("goodput_by_itl_slo_ms", None)
        out["phases"][str(k)] = row
    met = sum(meets(r, slo) for r in results)
    out["goodput"] = round(met / (phases * phase_s), 3)
    out["slo_met_fraction"] = round(met / max(1, len(results)), 3)
    out["min_phase_attainment"] = min(
        (p.get("slo_met_fraction", 1.0) for p in out["phases"].values()), default=0.0)
    return out


def compare(layouts: dict, phases: int, offered_per_s: float) -> dict:
    """The best fixed layout in hindsight, the planner against it, and two bounds: a planner
    switching among the fixed layouts per phase, and any layout at all (`offered_per_s`: every
    request of the trace meeting its SLO)."""
    fixed = {n: r for n, r in layouts.items() if n in FIXED}
    if not fixed:
        return {}
    best = max(fixed, key=lambda n: fixed[n]["goodput"])
    base = fixed[best]["goodput"]
    stitched = sum(max(r["phases"][str(k)].get("goodput", 0.0) for r in fixed.values())
                   for k in range(phases)) / phases
    out: dict = {"best_fixed": best, "best_fixed_goodput": base,
                 "best_per_phase": {str(k): max(fixed, key=lambda n: fixed[n]["phases"][
                     str(k)].get("goodput", 0.0)) for k in range(phases)},
                 "best_per_phase_vs_best_fixed_goodput_ratio":
                     round(stitched / base, 3) if base else None,
                 "offered_vs_best_fixed_goodput_ratio":
                     round(offered_per_s / base, 3) if base else None}
    if "planner" in layouts:
        p = layouts["planner"]
        out["planner_vs_best_fixed_goodput_ratio"] = round(p["goodput"] / base, 3) \
            if base else None
        out["min_phase_attainment_planner"] = p["min_phase_attainment"]
    return out


def add_trace_options(p: argparse.ArgumentParser) -> None:
    """The options `planner.py` and `planner_bound.py` share: the cores, the conditional
    layout's threshold, the two classes' prompt and output tokens, the SLO's scales, the seed."""
    p.add_argument("--cores", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1])
    p.add_argument("--threshold", type=int, default=512, help="the conditional layout's")
    p.add_argument("--short-input", type=int, default=128)
    p.add_argument("--short-output", type=int, default=128)
    p.add_argument("--long-input", type=int, default=2048)
    p.add_argument("--long-output", type=int, default=64)
    p.add_argument("--ttft-scale", type=float, default=5.0)
    p.add_argument("--itl-scale", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)


def main() -> dict:
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder; default: the small preset")
    p.add_argument("--phase-s", type=float, default=300.0, help="seconds of each phase")
    p.add_argument("--rates", type=floats, default=[4.0, 0.4, 4.0],
                   help="requests/s of each phase")
    add_trace_options(p)
    p.add_argument("--layouts", type=lambda s: s.split(","), default=list(LAYOUTS),
                   help="a subset (aggregated first: it sets the SLO)")
    p.add_argument("--out", default=str(RESULTS / "planner.json"))
    args = p.parse_args()
    if len(args.rates) != 3 or args.layouts[0] != "aggregated":
        raise ValueError(f"need 3 rates and the aggregated layout first, got {args.rates} and "
                         f"{args.layouts}")
    tmp = tempfile.mkdtemp(prefix="planner-")
    model = args.model or str(make_model(Path(tmp) / "small", arch="llama", preset="small"))
    vocab = json_vocab(model)
    arrivals = trace(args, vocab)
    slo = None
    raw, layouts = {}, {}
    for name in args.layouts:
        raw[name] = run_layout(name, model, args, vocab, tmp, arrivals, slo)
        slo = slo or slo_of(raw[name]["single"], args)
        layouts[name] = layout_report(raw[name]["results"], arrivals, slo, args.phase_s, 3)
        Path(args.out).with_suffix(".partial.json").write_text(json.dumps(layouts))
    planner = raw.get("planner", {})
    report = {"benchmark": "planner", "command": command_line(None),
              "setup": {k: v for k, v in vars(args).items() if k != "out"} | {
                  "model": args.model or "small preset (llama, ~40M parameters, fp32)",
                  "requests_per_phase": [sum(a.phase == k for a in arrivals) for k in range(3)],
                  "time": time.strftime("%Y-%m-%d %H:%M")},
              "single_request": raw["aggregated"]["single"], "slo": slo,
              "planner_targets": planner_targets(slo), "layouts": layouts,
              "planner_decisions": planner.get("decisions"),
              "planner_status": planner.get("status"),
              } | compare(layouts, 3, len(arrivals) / (3 * args.phase_s))
    emit(report, Path(args.out))
    return report


if __name__ == "__main__":
    main()
