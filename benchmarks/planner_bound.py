"""How much any planner can gain over the best fixed layout on two workers of this machine, at
any rates of the issue's trace (chat, summarization, chat, equal lengths), measured on the Ray
app: each fixed layout of `benchmarks/planner.py` (aggregated, 1P+1D, conditional at the
default threshold) is fed steady phases of one class at a sweep of rates (chat: 128-token
prompts, 128 out; summarization: 2,048 and 64), each phase drained before the next. For every
pair of a chat rate and a summarization rate the trace is then scored from those phases:

- `best_fixed`: the fixed layout with the most goodput over the trace (requests within the SLO
  a second, the SLO as `planner.py` defines it, from this run's single requests);
- `stitched`: in each phase, the layout with the most goodput among those meeting the SLO for
  at least 90% of the phase's requests (the issue's attainment target), switched at no cost;
  none where no layout meets 90% in a phase (no planner meets the target there).

At two workers the planner's choices (`router/planner.py`) are 0 prefill + 2 decode workers
(aggregated) or 1 + 1 with a threshold; a phase's prompts all have one length, so a threshold
sends all of them to the prefill worker (1P+1D) or none (conditional's chat: one worker serves
it whole, the other idle). Stitching these per phase at no switching cost is the most a planner
meeting 90% in every phase can reach, so `max_stitched_vs_best_fixed_goodput_ratio` bounds the
issue's 1.3x from above on this machine. `offered_vs_best_fixed` (every request of the trace
within the SLO) is reported beside it: the bound of a planner that ignored the 90%.

    python benchmarks/planner_bound.py [--chat-rates 1.2,1.8,2.4,3.0] \
        [--summary-rates 0.2,0.35,0.5,0.65] [--phase-s 60] \
        [--out benchmarks/results/planner_bound.json]

Last line: one JSON object, also written to `--out` with the command.
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
from disagg_goodput import json_vocab, layout_config, run, summarize
from loadgen import RequestSpec
from planner import (FIXED, Arrival, add_trace_options, replay, single_latencies, slo_of,
                     start_app)
from results_io import RESULTS, command_line, emit

from workers.models.make_model import make_model

ATTAINMENT = 0.9  # the per-phase SLO attainment target
CHAT, SUMMARY = "short", "long"


def phase_key(kind: str, rate: float) -> str:
    return f"{kind}@{rate:g}"


def phases(args: argparse.Namespace, vocab: int) -> dict[str, list[Arrival]]:
    """Each steady phase's seeded Poisson arrivals, times from the phase's own start."""
    out = {}
    kinds = [(CHAT, r, args.short_input, args.short_output) for r in args.chat_rates] + [
        (SUMMARY, r, args.long_input, args.long_output) for r in args.summary_rates]
    for index, (kind, rate, prompt, output) in enumerate(kinds):
        rng, t, arrivals = random.Random(args.seed * 1000 + index), 0.0, []
        while (t := t + rng.expovariate(rate)) < args.phase_s:
            ids = [rng.randrange(10, vocab) for _ in range(prompt)]
            arrivals.append(Arrival(t, index, RequestSpec(ids, output, kind)))
        out[phase_key(kind, rate)] = arrivals
    return out


def run_layout(layout: str, model: str, args: argparse.Namespace, vocab: int, tmp: str,
               steady: dict[str, list[Arrival]]) -> dict:
    """Start the layout, warm it, take the single requests on the aggregated layout, replay
    each phase and wait for all its requests. Returns {"single", "results": {phase: [...]}}."""
    path = Path(tmp, f"{layout}.yaml")
    path.write_text(yaml.safe_dump(layout_config(layout, args.cores, args.threshold)))
    app = start_app(model, str(path), len(args.cores) + 2)
    try:
        first = [a for arrivals in steady.values() for a in arrivals[:1]]
        run(app.base_url, [RequestSpec(a.spec.prompt, 2, a.spec.kind) for a in first],
            math.inf, None, 0)
        single = single_latencies(app.base_url, args, vocab) if layout == "aggregated" \
            else None
        results = {}
        for key, arrivals in steady.items():
            started = time.perf_counter()
            results[key] = asyncio.run(replay(app.base_url, arrivals))
            print(f"{layout} {key}: {sum(r.ok for r in results[key])}/{len(arrivals)} ok in "
                  f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
        return {"single": single, "results": results}
    finally:
        app.stop()


def score(curves: dict[str, dict[str, dict]], chat_rates: list[float],
          summary_rates: list[float]) -> dict:
    """The trace (chat, summarization, chat, equal lengths) at each pair of rates, scored from
    each layout's steady phases (`curves[layout][phase_key]`: that phase's `goodput` and
    `slo_met_fraction`): the best fixed layout, the stitched bound (see the module), their
    ratio and the offered load's over the best fixed; the maximum ratio and where."""
    grid, best_pair, best_ratio = [], None, 0.0
    for chat in chat_rates:
        for summary in summary_rates:
            c, s = phase_key(CHAT, chat), phase_key(SUMMARY, summary)
            trace = {n: (2 * p[c]["goodput"] + p[s]["goodput"]) / 3 for n, p in curves.items()}
            fixed = max(trace, key=lambda n: trace[n])
            meeting = [[p[k]["goodput"] for p in curves.values()
                        if p[k]["slo_met_fraction"] >= ATTAINMENT] for k in (c, s)]
            stitched = (2 * max(meeting[0]) + max(meeting[1])) / 3 \
                if all(meeting) else None
            offered = (2 * curves[fixed][c]["offered"] + curves[fixed][s]["offered"]) / 3
            row = {"chat_rate": chat, "summary_rate": summary, "best_fixed": fixed,
                   "best_fixed_goodput": round(trace[fixed], 3),
                   "stitched_goodput": None if stitched is None else round(stitched, 3),
                   "stitched_vs_best_fixed_goodput_ratio":
                       None if stitched is None or not trace[fixed]
                       else round(stitched / trace[fixed], 3),
                   "offered_vs_best_fixed_goodput_ratio":
                       round(offered / trace[fixed], 3) if trace[fixed] else None}
            grid.append(row)
            ratio = row["stitched_vs_best_fixed_goodput_ratio"]
            if ratio is not None and ratio > best_ratio:
                best_pair, best_ratio = (chat, summary), ratio
    return {"grid": grid, "max_stitched_vs_best_fixed_goodput_ratio": round(best_ratio, 3),
            "max_at_rates": best_pair,
            "max_offered_vs_best_fixed_goodput_ratio": max(
                (r["offered_vs_best_fixed_goodput_ratio"] or 0.0) for r in grid)}


def meets_up_to(curves: dict[str, dict[str, dict]], kind: str, rates: list[float]) -> dict:
    """Per layout, the highest rate of `kind` at which it met the SLO for >= 90% (None)."""
    return {n: max((r for r in rates if p[phase_key(kind, r)]["slo_met_fraction"] >= ATTAINMENT),
                   default=None) for n, p in curves.items()}


def main() -> dict:
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder; default: the small preset")
    p.add_argument("--chat-rates", type=floats, default=[1.2, 1.8, 2.4, 3.0])
    p.add_argument("--summary-rates", type=floats, default=[0.2, 0.35, 0.5, 0.65])
    p.add_argument("--phase-s", type=float, default=60.0, help="seconds of arrivals a phase")
    add_trace_options(p)
    p.add_argument("--out", default=str(RESULTS / "planner_bound.json"))
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="planner-bound-")
    model = args.model or str(make_model(Path(tmp) / "small", arch="llama", preset="small"))
    vocab = json_vocab(model)
    steady = phases(args, vocab)
    slo, single, curves = None, None, {}
    for layout in FIXED:  # aggregated first: its single requests set the SLO
        raw = run_layout(layout, model, args, vocab, tmp, steady)
        single = single or raw["single"]
        slo = slo or slo_of(single, args)
        curves[layout] = {}
        for key, results in raw["results"].items():
            row = summarize(results, args.phase_s, slo)
            row.pop("per_request")
            curves[layout][key] = row | {"offered": round(len(results) / args.phase_s, 3)}
    report = {"benchmark": "planner_bound", "command": command_line(None),
              "setup": {k: v for k, v in vars(args).items() if k != "out"} | {
                  "model": args.model or "small preset (llama, ~40M parameters, fp32)",
                  "requests_per_phase": {k: len(v) for k, v in steady.items()},
                  "time": time.strftime("%Y-%m-%d %H:%M")},
              "single_request": single, "slo": slo, "curves": curves,
              "meets_90_percent_up_to": {
                  "chat": meets_up_to(curves, CHAT, args.chat_rates),
                  "summary": meets_up_to(curves, SUMMARY, args.summary_rates)},
              } | score(curves, args.chat_rates, args.summary_rates)
    emit(report, Path(args.out))
    return report


if __name__ == "__main__":
    main()
