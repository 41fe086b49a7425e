"""Calibrating the control-plane simulator (`benchmarks/simulate.py`) against the Ray app: the
same trace as a `benchmarks/planner.py` run (its phases, rates and seed as the report records
them), replayed by the simulator at 2 workers with a step profile measured here on the same
model (the small preset, one torch thread: one pinned worker's core), against the Ray app's
TTFT p50/p90 and ITL p50/p90 per phase, aggregated and 1P+1D.

    python benchmarks/planner_calibrate.py --report benchmarks/results/planner.json

The simulator draws its own Poisson arrivals (same phases, rates and seed; not the same
times).

The profile (`--anchor`, the default): the Ray app's own single-request figures (prefill per
token and fixed cost from the two classes' TTFTs, a batch-1 decode step its ITL), with the
decode cost's growth per sequence from a measurement here; `--no-anchor`: the measurement
alone. The measurement: a 128- and a 2,048-token prompt's prefill (the per-token cost and the fixed
cost; fresh random prompts, no prefix-cache hits), and decode steps at batch 1 and 8 (the
per-sequence cost), each the median of three.
KV transfers cost nothing in the simulator (both workers on one machine). The simulator's ITL
is each request's mean gap (its decode time over its tokens), the Ray app's every gap between
streamed chunks: p50s compare, p90s less so. Last line: one JSON object (`sim_over_ray_*`
ratios; within 0.8..1.2 is the issue's calibration bound), also written to
benchmarks/results/planner_calibrate.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

from results_io import RESULTS, command_line, emit

import benchmarks.simulate as simulate
from router.profiles import StepProfile

SIM_LAYOUT = {"aggregated": "aggregated", "disaggregated": "disagg_1to1"}


def measure_profile(model: str, chunk_tokens: int = 2048) -> StepProfile:
    """The small preset's step costs on one torch thread (see the module)."""
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
            start = time.perf_counter()
            llm.generate(prompts, params)
            runs.append(time.perf_counter() - start)
        return statistics.median(runs)

    timed(1, 16, 2)  # warm-up
    short, long = timed(1, 128, 1), timed(1, 2048, 1)
    per_token = (long - short) / (2048 - 128)
    step = {b: (timed(b, 16, 33) - timed(b, 16, 1)) / 32 for b in (1, 8)}
    per_seq = max(0.0, (step[8] - step[1]) / 7)
    return StepProfile(prefill_fixed_s=max(0.0, short - 128 * per_token),
                       prefill_s_per_token=per_token,
                       decode_fixed_s=max(1e-4, step[1] - per_seq), decode_s_per_seq=per_seq,
                       chunk_tokens=chunk_tokens, source="measured here: small preset, one "
                                                         "torch thread")


def anchored(measured: StepProfile, single: dict, setup: dict) -> StepProfile:
    """`measured` scaled to the Ray app's own single-request figures: the prefill per token and
    its fixed cost from the two classes' TTFT p50s, a decode step at batch 1 the ITL p50; of
    the measurement only the decode cost's growth with the batch (per sequence over a batch-1
    step) is kept (a loaded machine slows both alike)."""
    short, long = setup["short_input"], setup["long_input"]
    ttft = single["ttft_p50_ms"]
    per_token = (ttft["long"] - ttft["short"]) / 1e3 / (long - short)
    itl = single["itl_p50_ms"] / 1e3
    grow = measured.decode_s_per_seq / (measured.decode_fixed_s + measured.decode_s_per_seq)
    return StepProfile(prefill_fixed_s=max(0.0, ttft["short"] / 1e3 - short * per_token - itl),
                       prefill_s_per_token=per_token, decode_fixed_s=itl * (1 - grow),
                       decode_s_per_seq=itl * grow, chunk_tokens=measured.chunk_tokens,
                       source="the Ray app's single-request TTFT and ITL, the batch slope "
                              "measured here")


def pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_ms": None, "p90_ms": None}
    xs = sorted(values)
    at = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3  # noqa: E731
    return {"p50_ms": round(at(0.5), 1), "p90_ms": round(at(0.9), 1)}


def simulated(setup: dict, profile: StepProfile, layout: str) -> dict:
    """The simulator's per-phase TTFT and ITL percentiles for the report's trace."""
    scale = 2 / 1000  # simulate's rates are per 1,000 workers
    kinds = [(setup["short_input"], setup["short_output"]),
             (setup["long_input"], setup["long_output"]),
             (setup["short_input"], setup["short_output"])]
    simulate.PROFILE = profile
    simulate.PHASES = tuple((p, o, r / scale) for (p, o), r in zip(kinds, setup["rates"]))
    run = simulate.Run(layout, 2, setup["phase_s"], setup["seed"])
    run.run(scale)
    out = {}
    for k in range(3):
        done = [r for r in run.requests if r.phase == k and not math.isnan(r.done)]
        out[str(k)] = {"ttft": pcts([r.first - r.arrival for r in done]),
                       "itl": pcts([(r.done - r.first) / max(1, r.output - 1) for r in done]),
                       "requests": len(done)}
    return out


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", default=str(RESULTS / "planner.json"))
    p.add_argument("--out", default=str(RESULTS / "planner_calibrate.json"))
    p.add_argument("--anchor", action=argparse.BooleanOptionalAction, default=True,
                   help="scale the profile to the Ray app's single-request figures")
    p.add_argument("--measured", default=None,
                   help="a planner_calibrate.json whose measured profile to use (no measuring)")
    args = p.parse_args()
    report = json.loads(Path(args.report).read_text())
    setup = report["setup"]
    if args.measured:  # an earlier run's measurement
        earlier = json.loads(Path(args.measured).read_text())
        measured = StepProfile(**(earlier.get("measured") or earlier["profile"]))
    else:
        from workers.models.make_model import make_model

        measured = measure_profile(str(make_model(
            Path(tempfile.mkdtemp(prefix="calib-")) / "small", arch="llama", preset="small")))
    profile = anchored(measured, report["single_request"], setup) if args.anchor else measured
    rows, ratios = {}, {}
    for ray_name, sim_name in SIM_LAYOUT.items():
        if ray_name not in report["layouts"]:
            continue
        sim = simulated(setup, profile, sim_name)
        ray = {k: {"ttft": {q: v["ttft"]["all"][q] for q in ("p50_ms", "p90_ms")},
                   "itl": {q: v["itl"][q] for q in ("p50_ms", "p90_ms")}}
               for k, v in report["layouts"][ray_name]["phases"].items()}
        rows[ray_name] = {"ray": ray, "sim": sim}
        for k in sim:
            for what in ("ttft", "itl"):
                for q in ("p50_ms", "p90_ms"):
                    r, s = ray[k][what][q], sim[k][what][q]
                    if r and s is not None:
                        ratios[f"sim_over_ray_{ray_name}_phase{k}_{what}_{q[:3]}_ratio"] = \
                            round(s / r, 2)
    within = [v for v in ratios.values() if 0.8 <= v <= 1.2]
    return emit({"benchmark": "planner_calibrate", "command": command_line(None),
                 "ray_report": args.report, "ray_report_command": report["command"],
                 "measured": dict(vars(measured)), "profile": dict(vars(profile)), "layouts": rows,
                 "within_20_percent": f"{len(within)} of {len(ratios)}", **ratios},
                Path(args.out))


if __name__ == "__main__":
    main()
