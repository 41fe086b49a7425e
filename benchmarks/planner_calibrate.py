"""Calibrating the control-plane simulator (`benchmarks/simulate.py`) against the Ray app: the
same trace as a `benchmarks/planner.py` run, replayed by the simulator at 2 workers, against
the Ray app's TTFT p50/p90 and ITL p50/p90 per phase, aggregated and 1P+1D.

    python benchmarks/planner_calibrate.py --report benchmarks/results/planner.json

What the simulator is given:
- the Ray run's own arrivals (`planner.trace` with its seed and the small preset's vocabulary:
  the same times, checked against the report's requests per phase);
- a step profile of compute measured here (the small preset, one torch thread, in this
  thread's CPU time, since the machine is shared: a 128- and a 2,048-token prefill, decode
  steps at batch 1 and 8 of 16-token contexts and at batch 1 of a 2,048-token context, each
  the median of three), with the Ray app's own figures (`--anchor`): the prefill cost from
  its two classes' single-request TTFTs, and its per-step overhead (engine loop, outputs
  pushed to the router) added to every decode step: its single-request ITL p50 less the
  measured batch-1 step at a short request's context;
- `--corun`: a step's slowdown while the other worker steps (`sim_cluster.Cluster.corun`: the
  running steps' work advances at 1/corun while both run). `benchmarks/planner_corun.py`
  measures it here: 1.0 in CPU time (the two cores do not slow each other's steps), 1.4 to
  2.0 in wall time (medians of runs minutes apart), that is, how much of the cores other
  processes take while both workers are busy: the machine's load, which the Ray report does
  not record. The default is the CPU time's 1.0; `--sweep` adds the count at other factors;
- `--spread` (off by default): each step's time drawn from how single engine steps spread on
  this machine with both cores busy (`planner_corun.step_spread`, as ratios to their median,
  so the anchored p50s stand): time-sharing with other processes, which the Ray app's tails
  have and exact steps do not. Like the wall-time co-run factor it is the machine's load at
  the time of measuring (its p90 1.4x to 2.5x the median in runs minutes apart), so the
  default leaves it out;
- `--stretch` (`benchmarks/planner_ttft_tail.py`'s result), measured on the Ray app replaying
  the same trace: how its step loop's CPU time stretched in wall time (runnable, waiting for
  its core while the app's other processes ran), per layout and phase, by a window's CPU time:
  each simulated step drawn from the bin of its length (`sim_cluster.Stretch`), in place of
  the co-run factor (the stretch's mean is that factor's contention, its spread the tails).
  Also set beside: that run's own TTFT / ITL cells against the report's (how its load
  compared) and the simulator against them. With a spread the count with exact steps is
  reported beside (`within_20_percent_steps_exact`).
- `--overheads` (`benchmarks/planner_overheads.py`'s result), measured on the Ray app: each
  layout's co-run factor from the CPU its other processes (Ray's daemons, Serve's proxy and
  router, the load generator) take under the trace's chat load, 2 / (2 - their cores), in
  place of `--corun`; and the 1P+1D first token's path (`StepProfile.handoff_s`: the prefill
  call's return with its KV offer), its single-request TTFTs over the aggregated layout's.
KV pulls cost nothing (both workers on one machine). `--measured` reuses an earlier
result's measurements (`measured_by` names the command that took them).

The ITL is taken as the Ray report takes it: every gap between tokens of every request,
percentiles by nearest rank (`loadgen.percentiles_ms`). The Ray app against itself:
`--repeat`, the same command's earlier report (the same trace), gives the run-to-run spread:
how many cells the two runs agree on within 20%, the cells where they differ by more than 1.5x
(no prediction is within 20% of both), and the simulator against the two runs' span.
Last line: one JSON object (`sim_over_ray_*` ratios; within 0.8..1.2 is the issue's
calibration bound), also written to benchmarks/results/planner_calibrate.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from loadgen import percentiles_ms
from results_io import RESULTS, command_line, emit

import benchmarks.simulate as simulate
from benchmarks.sim_cluster import Req, Stretch
from router.profiles import StepProfile

SIM_LAYOUT = {"aggregated": "aggregated", "disaggregated": "disagg_1to1"}


def measure_profile(model: str, chunk_tokens: int = 2048) -> StepProfile:
    """The small preset's step costs on one torch thread (see the module), in this thread's CPU
    time: the machine is shared, and time lent to other processes is no cost of a step."""
    import torch

    from workers import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(model, max_num_seqs=16, max_num_batched_tokens=chunk_tokens)

    rng = random.Random(0)

    def timed(n: int, tokens: int, max_tokens: int) -> float:
        """Median of three runs of `n` fresh random prompts (no prefix-cache hits)."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        runs = []
        for _ in range(3):
            prompts = [[rng.randrange(10, 1000) for _ in range(tokens)] for _ in range(n)]
            start = time.thread_time()
            llm.generate(prompts, params)
            runs.append(time.thread_time() - start)
        return statistics.median(runs)

    def decode_step(batch: int, context: int) -> float:
        return (timed(batch, context, 33) - timed(batch, context, 1)) / 32

    timed(1, 16, 2)  # warm-up
    short, long = timed(1, 128, 1), timed(1, 2048, 1)
    per_token = (long - short) / (2048 - 128)
    step = {b: decode_step(b, 16) for b in (1, 8)}
    per_seq = max(0.0, (step[8] - step[1]) / 7)
    per_ctx = max(0.0, (decode_step(1, 2048) - step[1]) / (2048 - 16))
    return StepProfile(prefill_fixed_s=max(0.0, short - 128 * per_token),
                       prefill_s_per_token=per_token,
                       decode_fixed_s=max(1e-4, step[1] - per_seq - 16 * per_ctx),
                       decode_s_per_seq=per_seq, decode_s_per_ctx_token=per_ctx,
                       chunk_tokens=chunk_tokens, source="measured here: small preset, one "
                                                         "torch thread, thread CPU time")


def anchored(measured: StepProfile, single: dict, setup: dict) -> StepProfile:
    """`measured` (compute alone) with the Ray app's own single-request figures: the prefill
    per token and its fixed cost from the two classes' TTFT p50s; a decode step the measured
    compute plus the Ray app's per-step overhead (its engine loop, the step's outputs pushed
    to the router), the single-request ITL p50 over the measured batch-1 step at a short
    request's mean context (its prompt and half its output: the ITL p50 is a short
    request's gap)."""
    short, long = setup["short_input"], setup["long_input"]
    ttft = single["ttft_p50_ms"]
    per_token = (ttft["long"] - ttft["short"]) / 1e3 / (long - short)
    itl = single["itl_p50_ms"] / 1e3
    overhead = itl - measured.decode_step_s(1, short + setup["short_output"] / 2)
    if overhead < 0:
        raise ValueError(f"the Ray app's ITL p50 ({itl * 1e3:.1f} ms) is below the measured "
                         f"step: a measurement on a faster machine?")
    return StepProfile(prefill_fixed_s=max(0.0, ttft["short"] / 1e3 - short * per_token - itl),
                       prefill_s_per_token=per_token,
                       decode_fixed_s=measured.decode_fixed_s + overhead,
                       decode_s_per_seq=measured.decode_s_per_seq,
                       decode_s_per_ctx_token=measured.decode_s_per_ctx_token,
                       chunk_tokens=measured.chunk_tokens,
                       source="prefill from the Ray app's single-request TTFTs; decode: the "
                              "step measured here plus the Ray app's per-step overhead "
                              f"({overhead * 1e3:.1f} ms, from its single-request ITL)")


def with_handoff(profile: StepProfile, overheads: dict, setup: dict) -> StepProfile:
    """`profile` with the disaggregated path's first-token cost (`StepProfile.handoff_s`)
    from `benchmarks/planner_overheads.py`: the 1P+1D layout's single-request TTFT over the
    aggregated layout's, per class (the median of its turns' differences), as a fixed cost and one
    per prompt token (clamped at 0)."""
    diff = overheads["single"]["disaggregated_minus_aggregated_ttft_ms"]
    short, long = diff["short"]["median"] / 1e3, diff["long"]["median"] / 1e3
    per_token = max(0.0, (long - short) / (setup["long_input"] - setup["short_input"]))
    return replace(profile, handoff_fixed_s=max(0.0, short - per_token * setup["short_input"]),
                   handoff_s_per_token=per_token,
                   source=profile.source + "; the 1P+1D first token's path from "
                                           "planner_overheads.py")


def ray_trace(setup: dict) -> list[Req]:
    """The Ray run's own arrivals (`planner.trace`, same seed, phases, rates and vocabulary:
    the same times), as the simulator's requests."""
    from planner import trace

    from workers.models.kit_configs import PRESETS

    args = argparse.Namespace(**{k: setup[k] for k in (
        "seed", "phase_s", "rates", "short_input", "short_output", "long_input", "long_output")})
    arrivals = trace(args, PRESETS["small"].vocab_size)
    counts = [sum(a.phase == k for a in arrivals) for k in range(3)]
    if counts != setup["requests_per_phase"]:
        raise ValueError(f"the trace rebuilt here has {counts} requests per phase, the Ray "
                         f"report {setup['requests_per_phase']}")
    return [Req(a.at_s, len(a.spec.prompt), a.spec.max_tokens, a.phase) for a in arrivals]


def simulated(setup: dict, profile: StepProfile, layout: str, corun: float = 1.0,
              spreads: tuple[tuple[float, Stretch], ...] = ()) -> dict:
    """The simulator's per-phase TTFT and ITL percentiles for the report's trace (its own
    arrival times), as the Ray report takes them (`loadgen.percentiles_ms`: nearest rank; ITL
    over every gap between tokens of every request)."""
    simulate.PROFILE = profile
    run = simulate.Run(layout, 2, setup["phase_s"], setup["seed"], trace=ray_trace(setup))
    run.c.keep_gaps, run.c.corun, run.c.spreads = True, corun, spreads
    run.run(2 / 1000)  # simulate's rates are per 1,000 workers (unused: the trace is given)
    out = {}
    for k in range(3):
        done = [r for r in run.requests if r.phase == k and not math.isnan(r.done)]
        pick = lambda xs: {q: v for q, v in percentiles_ms(xs).items()  # noqa: E731
                           if q in ("p50_ms", "p90_ms")}
        out[str(k)] = {"ttft": pick([r.first - r.arrival for r in done]),
                       "itl": pick([g for r in done for g in r.gaps or ()]),
                       "requests": len(done)}
    return out


CELLS = [(what, q) for what in ("ttft", "itl") for q in ("p50_ms", "p90_ms")]


def ray_cells(report: dict) -> dict:
    """{layout: {phase: {"ttft"|"itl": {"p50_ms", "p90_ms"}}}} of a Ray report."""
    return {name: {k: {"ttft": {q: v["ttft"]["all"][q] for q in ("p50_ms", "p90_ms")},
                       "itl": {q: v["itl"][q] for q in ("p50_ms", "p90_ms")}}
                   for k, v in report["layouts"][name]["phases"].items()}
            for name in SIM_LAYOUT if name in report["layouts"]}


def tail_run_cells(got: dict) -> dict:
    """A `benchmarks/planner_ttft_tail.py` run's own TTFT and ITL p50 / p90 per layout and
    phase, shaped as `ray_cells` shapes a Ray report's (its requests' nearest ranks too)."""
    pick = lambda t: {"p50_ms": t["p50"], "p90_ms": t["p90"]}  # noqa: E731
    return {n: {k: {"ttft": pick(v["summary"]["ttft_ms"]), "itl": pick(v["itl"]["ttft_ms"])}
                for k, v in got["layouts"][n]["phases"].items()}
            for n in SIM_LAYOUT if n in got["layouts"]}


def ratios_of(a: dict, b: dict, prefix: str) -> dict[str, float]:
    """`a` over `b`, cell by cell (as `ray_cells` shapes them)."""
    out = {}
    for name in a:
        for k in a[name]:
            for what, q in CELLS:
                x, y = a[name][k][what][q], b[name][k][what][q]
                if x is not None and y:
                    out[f"{prefix}_{name}_phase{k}_{what}_{q[:3]}_ratio"] = round(x / y, 2)
    return out


def within(ratios: dict[str, float]) -> str:
    return f"{sum(0.8 <= v <= 1.2 for v in ratios.values())} of {len(ratios)}"


def repeat_check(ray: dict, again: dict, sim: dict) -> dict:
    """The Ray app against itself (the same command run again): how many cells its two runs
    agree on within 20%; the cells where they differ by more than 1.5x (no prediction is within
    20% of both); the simulator (anchored on the first run) within 20% of the second, and
    within the runs' span widened by 20%."""
    agree = ratios_of(again, ray, "repeat_over_ray")
    apart = [k for k, v in agree.items() if max(v, 1 / v) > 1.5]
    inside = sum(min(ray[n][k][w][q], again[n][k][w][q]) * 0.8 <= sim[n][k][w][q]
                 <= max(ray[n][k][w][q], again[n][k][w][q]) * 1.2
                 for n in sim for k in sim[n] for w, q in CELLS)
    return {"repeat_within_20_percent": within(agree),
            "cells_the_runs_differ_over_1.5x": apart,
            "most_cells_any_prediction_within_20_percent_of_both_runs":
                f"{len(agree) - len(apart)} of {len(agree)}",
            "sim_within_20_percent_of_the_repeat": within(ratios_of(sim, again, "sim")),
            "sim_within_the_runs_span_widened_20_percent": f"{inside} of {len(agree)}",
            **agree}


def main() -> dict:
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", default=str(RESULTS / "planner.json"))
    p.add_argument("--repeat", default=str(RESULTS / "planner_run1.json"),
                   help="the same command's earlier Ray report (its run-to-run spread)")
    p.add_argument("--out", default=str(RESULTS / "planner_calibrate.json"))
    p.add_argument("--anchor", action=argparse.BooleanOptionalAction, default=True,
                   help="add the Ray app's per-step overhead and take its prefill figures")
    p.add_argument("--measured", default=None,
                   help="a planner_calibrate.json whose measurements to use (no measuring)")
    p.add_argument("--corun", type=float, default=1.0,
                   help="a step's slowdown while the other worker steps (1: none, as the "
                        "measured CPU time has it)")
    p.add_argument("--overheads", default=None,
                   help="a planner_overheads.json: the 1P+1D first token's path and each "
                        "layout's co-run factor from its other processes' CPU (measured; "
                        "replaces --corun)")
    p.add_argument("--sweep", type=floats, default=[1.1, 1.2, 1.3, 1.5, 1.8],
                   help="co-run factors also simulated (the count within 20%% at each)")
    p.add_argument("--spread", action=argparse.BooleanOptionalAction, default=False,
                   help="each step's time drawn from the measured spread of steps on this "
                        "machine with both cores busy (`planner_corun.step_spread`)")
    p.add_argument("--stretch", default=None,
                   help="a planner_ttft_tail.json: each layout's steps stretched as the Ray "
                        "app's step loop was in each phase of the same trace (measured; "
                        "replaces the co-run factor, which its mean holds)")
    args = p.parse_args()
    report = json.loads(Path(args.report).read_text())
    setup = report["setup"]
    measured, corun_measured = measurements(args.measured)
    profile = anchored(measured, report["single_request"], setup) if args.anchor else measured
    ray = ray_cells(report)
    profiles, corun = layout_inputs(args, profile, list(ray), setup)
    spreads, exact = step_spreads(args, corun_measured, list(ray), setup), dict.fromkeys(ray, ())
    corun_exact = corun
    if args.stretch:  # its mean holds what the co-run factor stood for
        corun = dict.fromkeys(ray, 1.0)

    def sim_at(factor: dict[str, float], spread: dict[str, tuple]) -> dict:
        return {n: simulated(setup, profiles[n], SIM_LAYOUT[n], factor[n], spread[n])
                for n in ray}

    sim = sim_at(corun, spreads)
    ratios = ratios_of(sim, ray, "sim_over_ray")
    sweep = {str(c): within(ratios_of(sim_at(dict.fromkeys(ray, c), exact), ray, "x"))
             for c in args.sweep}
    out = {"benchmark": "planner_calibrate", "command": command_line(None),
           "ray_report": args.report, "ray_report_command": report["command"],
           "measured": dict(vars(measured)), "corun_measured": corun_measured,
           "measured_by": measured_by(args.measured) if args.measured else command_line(None),
           "profile": dict(vars(profile)), "overheads": args.overheads,
           "profiles": {n: dict(vars(v)) for n, v in profiles.items()}, "corun": corun,
           "step_spread": "--stretch " + args.stretch if args.stretch else (
               "--spread" if args.spread else None),
           "layouts": {n: {"ray": ray[n], "sim": sim[n]} for n in ray},
           "within_20_percent": within(ratios), "within_20_percent_by_corun": sweep}
    if args.stretch:  # the stretch's own run: how its load compared, and the sim against it
        own = tail_run_cells(json.loads(Path(args.stretch).read_text()))
        out["stretch_run_over_ray"] = ratios_of(own, ray, "x")
        out["stretch_run_within_20_percent_of_ray"] = within(out["stretch_run_over_ray"])
        out["sim_over_stretch_run"] = ratios_of(sim, own, "x")
        out["within_20_percent_of_the_stretch_run"] = within(out["sim_over_stretch_run"])
    if any(spreads.values()):  # the same inputs with exact steps at the co-run factors
        sim_exact = sim_at(corun_exact, exact)
        out["within_20_percent_steps_exact"] = within(ratios_of(sim_exact, ray, "x"))
        if args.stretch:
            out["within_20_percent_of_the_stretch_run_steps_exact"] = within(ratios_of(
                sim_exact, own, "x"))
    out.update(ratios)
    if args.repeat and Path(args.repeat).exists():
        again = json.loads(Path(args.repeat).read_text())
        out.update(repeat_report=args.repeat, repeat_single_request=again["single_request"],
                   **repeat_check(ray, ray_cells(again), sim))
    return emit(out, Path(args.out))


def layout_inputs(args: argparse.Namespace, profile: StepProfile, layouts: list[str],
                  setup: dict) -> tuple[dict[str, StepProfile], dict[str, float]]:
    """Each layout's profile and co-run factor: from `--overheads` (measured: the 1P+1D first
    token's path, each layout's other processes' CPU under load), or else `profile` and
    `--corun` for both."""
    if not args.overheads:
        return dict.fromkeys(layouts, profile), dict.fromkeys(layouts, args.corun)
    overheads = json.loads(Path(args.overheads).read_text())
    profiles = {n: with_handoff(profile, overheads, setup) if n == "disaggregated" else profile
                for n in layouts}
    return profiles, {n: overheads["load"][n]["corun"] for n in layouts}


def step_spreads(args: argparse.Namespace, corun_measured: dict | None, layouts: list[str],
                 setup: dict) -> dict[str, tuple[tuple[float, Stretch], ...]]:
    """Each layout's step spreads (`Cluster.spreads`): `--stretch`'s (measured per layout and
    phase, by a step's length; each from its phase's start), or `--spread`'s (single steps on
    this machine, one for both), or none (exact steps)."""
    if args.stretch:
        from planner_ttft_tail import stretch_of

        got = json.loads(Path(args.stretch).read_text())
        if got["trace"]["phase_s"] != setup["phase_s"] or got["trace"]["rates"] != setup["rates"]:
            raise ValueError(f"{args.stretch} replayed {got['trace']}, not the report's trace")
        return {n: tuple((int(k) * setup["phase_s"], stretch_of(v["spread"]))
                         for k, v in sorted(got["layouts"][n]["phases"].items()))
                for n in layouts}
    if not args.spread:
        return dict.fromkeys(layouts, ())
    spread = (corun_measured or {}).get("step_spread", {}).get("both")
    if spread is None:
        raise ValueError("--spread needs a measured step spread (an earlier result without "
                         "one: --no-spread)")
    # the measured quantiles over the median, from the fastest (q 0) to the slowest (q 1)
    points = sorted((float(q), r) for q, r in spread["over_median"].items())
    return dict.fromkeys(layouts, ((0.0, Stretch(((math.inf, (
        (0.0, points[0][1]), *points[:3], (0.5, 1.0), *points[3:], (1.0, points[-1][1]))),))),))


def measured_by(earlier_path: str) -> str:
    """The command whose measurements an earlier result holds."""
    earlier = json.loads(Path(earlier_path).read_text())
    return str(earlier.get("measured_by") or earlier["command"])


def measurements(earlier_path: str | None) -> tuple[StepProfile, dict | None]:
    """The step profile and the co-run factors (`benchmarks/planner_corun.py`): measured here
    now, or an earlier result's."""
    if earlier_path:
        earlier = json.loads(Path(earlier_path).read_text())
        return (StepProfile(**(earlier.get("measured") or earlier["profile"])),
                earlier.get("corun_measured"))
    from planner_corun import corun_slowdown

    from workers.models.make_model import make_model

    model = str(make_model(Path(tempfile.mkdtemp(prefix="calib-")) / "small", arch="llama",
                           preset="small"))
    return measure_profile(model), corun_slowdown(model)


if __name__ == "__main__":
    main()
