"""Where the Ray app's TTFT tail comes from on the planner trace (issue 51's calibration: with
exact steps the simulator's chat TTFT p90 was 0.63-0.77x the Ray app's, its p50 within 20%),
and what the simulator needs to model it: how the engine's step loop stretches in wall time.

Each layout (`cleave serve` on two workers pinned to a core each, as `benchmarks/planner.py`
runs them) replays `benchmarks/planner.py`'s seeded trace (`--phases` of it, in a row, at its
arrival times: chat, summarization, chat at `--rates`, `--phase-s` each) with tracing on (an
OTLP/HTTP receiver in this process). Every request's TTFT is split where it is spent:
- `inbound_ms`: the client's send to the router's HTTP span (Serve's proxy hop);
- `router_ms`: the router's `router.start` span (its arrival to its first token back from the
  worker: routing, the worker call, the engine's queue and prefill; 1P+1D: the prefill call
  and the handoff);
- `outbound_ms`: the router's first token to the client's (the way back through the proxy);
and, on the worker that prefilled it (its engine process found by a probe request on the idle
app), its engine's threads' scheduler accounting over the client's TTFT window
(`/proc/<pid>/task/*/schedstat`: nanoseconds on a CPU and waiting runnable for one):
- `step_cpu_ms` / `step_wait_ms`: the engine's step loop thread on its core, and runnable
  but not running (another thread or process held the core: time-sharing);
- `other_cpu_ms`: the engine process's other threads (Ray's core worker, the asyncio loop);
- `<group>_cpu_ms`: the CPU the app's other processes took (by role: Serve's controller, the
  rest of Ray and `cleave serve`, this client; `/proc/<pid>/stat`, in clock ticks), and
  `foreign_cpu_ms`: what the cores ran beside the app (`/proc/stat`: other sessions' work).
The step thread neither on a core nor waiting for one is idle. Every gap between a request's
tokens gets the same split of its decoding engine's step thread (`itl`).

Reported per layout and phase: each part's p50 / p90 and its mean over the requests at or
above the TTFT p90 (the tail) against those within 10% of the p50, so the tail's extra time is
set beside where it went; the cores' use over the run (`cores`: the engines, the app's other
processes, `foreign`); and `spread`: every window's (a TTFT's, a gap's) step-thread wall time
over its CPU time, (CPU + runnable wait) / CPU, in bins of the window's CPU time, the
simulator's step spread (`planner_calibrate.py --stretch`, `sim_cluster.Stretch`). Last
line: one JSON object, also written to benchmarks/results/planner_ttft_tail.json.

    python benchmarks/planner_ttft_tail.py    # the 15-minute trace, both layouts: ~32 min
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from app_probe import Probe, Receiver, app_groups, busy_s, process_title, schedstat
from disagg_goodput import json_vocab, layout_config
from loadgen import client_session
from planner import start_app, trace
from planner_overheads import ENGINE, app_cpu_s
from results_io import RESULTS, command_line, emit
from serving_ray import RayApp

from workers.models.make_model import make_model

if TYPE_CHECKING:
    from benchmarks.sim_cluster import Stretch


async def one(client, url: str, ids: list[int], max_tokens: int, probe: Probe,
              at: float) -> dict:
    """One streamed request sent at `at` (perf_counter), its trace id in its `traceparent`:
    the client's times (time_ns) and the probe's snapshots at its send and first token, its
    step threads at every token."""
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    trace_id = secrets.token_hex(16)
    body = {"model": "model", "prompt": ids, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    out: dict = {"trace_id": trace_id, "before": probe.snapshot(), "tokens": []}
    out["send_ns"] = time.time_ns()
    async with client.post(url, json=body, headers={
            "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"choices"' in line:
                if "first_ns" not in out:
                    out["first_ns"] = time.time_ns()
                    out["at_first"] = probe.snapshot()
                out["tokens"].append(probe.token())
    out["end_ns"] = time.time_ns()
    return out


def replay(base_url: str, sends: list[tuple[float, list[int], int]], probe: Probe) -> list:
    async def main() -> list:
        async with client_session() as client:
            url = base_url + "/v1/completions"
            t0 = time.perf_counter()
            return list(await asyncio.gather(*(one(client, url, ids, n, probe, t0 + at)
                                               for at, ids, n in sends)))
    return asyncio.run(main())


def window(req: dict, pid: int, step_tid: int) -> dict[str, float]:
    """Over `req`'s TTFT window (ms): the engine `pid`'s step thread on its core and waiting
    for it, its other threads; the CPU each group of the app's other processes took, and what
    the cores ran beside the app (`foreign`)."""
    a, b = req["before"], req["at_first"]
    delta = {p: {t: (b["engines"][p][t][0] - a["engines"][p].get(t, (0, 0))[0],
                     b["engines"][p][t][1] - a["engines"][p].get(t, (0, 0))[1])
                 for t in b["engines"][p]} for p in b["engines"]}
    step = delta[pid].get(step_tid, (0, 0))
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    groups = {f"{g}_cpu_ms": (b["groups"][g] - a["groups"][g]) * tick_ms for g in b["groups"]}
    engines = sum(v[0] for d in delta.values() for v in d.values()) / 1e6
    return {"step_cpu_ms": step[0] / 1e6, "step_wait_ms": step[1] / 1e6,
            "other_cpu_ms": sum(v[0] for t, v in delta[pid].items() if t != step_tid) / 1e6,
            **groups, "foreign_cpu_ms": (b["busy_s"] - a["busy_s"]) * 1e3 - engines
            - sum(groups.values())}


def parts(req: dict, spans: dict, engine_of: dict[str, int], step_tid: dict[int, int]) -> dict:
    """One request's TTFT split (ms): the hops from the router's spans, its engine's threads."""
    http = next(v for k, v in spans.items() if k.startswith("POST"))
    start = spans["router.start"]
    pid = engine_of[start[2]["worker"]]
    row = {"ttft_ms": (req["first_ns"] - req["send_ns"]) / 1e6,
           "inbound_ms": (http[0] - req["send_ns"]) / 1e6,
           "router_ms": (start[1] - start[0]) / 1e6,
           "outbound_ms": (req["first_ns"] - start[1]) / 1e6, **window(req, pid, step_tid[pid])}
    if "worker.prefill" in spans:
        p = spans["worker.prefill"]
        row["worker_prefill_ms"] = (p[1] - p[0]) / 1e6
    return row


def tail_table(rows: list[dict]) -> dict:
    """Each part's p50 / p90, and its mean over the tail (TTFT >= p90) and the middle (TTFT
    within 10% of the p50): where the tail's extra time went."""
    ttft = sorted(r["ttft_ms"] for r in rows)
    p50, p90 = ttft[len(ttft) // 2], ttft[int(0.9 * (len(ttft) - 1))]
    tail = [r for r in rows if r["ttft_ms"] >= p90]
    mid = [r for r in rows if abs(r["ttft_ms"] - p50) <= 0.1 * p50]
    out = {"requests": len(rows), "tail_requests": len(tail), "middle_requests": len(mid)}
    for key in rows[0]:
        xs = sorted(r[key] for r in rows)
        out[key] = {"p50": round(xs[len(xs) // 2], 1),
                    "p90": round(xs[int(0.9 * (len(xs) - 1))], 1),
                    "tail_mean": round(statistics.fmean(r[key] for r in tail), 1),
                    "middle_mean": round(statistics.fmean(r[key] for r in mid), 1)}
    return out


def step_threads(app: RayApp, pids: list[int]) -> list[tuple[int, int]]:
    """(pid, tid) of each engine's step loop: the thread that ran the most while two
    concurrent requests (one per aggregated worker; both on a 1P+1D pair) ran, after two
    others warmed the engines (their first requests' one-off work runs on other threads)."""
    warm = [(0.0, [11] * 128, 8), (0.0, [13] * 128, 8)]
    replay(app.base_url, warm, Probe(pids))
    before = {p: schedstat(p) for p in pids}
    replay(app.base_url, [(0.0, [14] * 128, 8), (0.0, [15] * 128, 8)], Probe(pids))
    after = {p: schedstat(p) for p in pids}
    grew = {p: {t: after[p][t][0] - before[p].get(t, (0, 0))[0] for t in after[p]}
            for p in pids}
    found = [(p, max(grew[p], key=grew[p].__getitem__)) for p in pids]
    for p, t in found:
        if grew[p][t] < 0.5 * sum(grew[p].values()):
            raise RuntimeError(f"engine {p}: no thread ran most of its steps ({grew[p]})")
    return found


def measure(name: str, model: str, tmp: str, sends: list, phases: list[int],
            receiver: Receiver) -> dict:
    """One layout's app: its step threads found; a probe maps worker ids to engine processes;
    then the trace, with the cores' busy time and the app's own CPU over it."""
    path = Path(tmp, f"{name}.yaml")
    path.write_text(yaml.safe_dump(layout_config(name, [0, 1], 512)))
    app = start_app(model, str(path), 4)
    try:
        pids = app.processes(ENGINE)
        steppers = step_threads(app, pids)
        probe = replay(app.base_url, [(0.0, [12] * 128, 2)], Probe(pids))[0]
        time.sleep(1.0)
        busy, (engine, other), wall = busy_s(), app_cpu_s(app), time.perf_counter()
        groups = app_groups(app, pids)
        titles = {g: sorted({process_title(p) for p in ps}) for g, ps in groups.items()}
        results = replay(app.base_url, sends, Probe(pids, steppers, groups))
        wall = time.perf_counter() - wall
        busy, engine, other = (b - a for a, b in zip((busy, engine, other),
                                                       (busy_s(), *app_cpu_s(app))))
        time.sleep(2.0)  # the last spans exported
    finally:
        app.stop()
    cpu = {p: sum(v[0] for v in probe["at_first"]["engines"][p].values())
           - sum(v[0] for v in probe["before"]["engines"][p].values()) for p in pids}
    attrs = receiver.traces[probe["trace_id"]]["router.route"][2]
    busiest = max(pids, key=cpu.__getitem__)
    other_id = attrs["decode_worker"] if name == "disaggregated" else next(
        s["router.start"][2]["worker"] for s in receiver.traces.values()
        if s.get("router.start", (0, 0, {}))[2].get("worker") not in (None,
                                                                       attrs["prefill_worker"]))
    engine_of = {attrs["prefill_worker"]: busiest,
                 other_id: next(p for p in pids if p != busiest)}
    step_tid = dict(steppers)
    decode_pid = engine_of[other_id] if name == "disaggregated" else None
    done = [r for r in results
            if "first_ns" in r and "router.start" in receiver.traces.get(r["trace_id"], {})]
    kept = {id(r) for r in done}
    stepper_of = {w: [p for p, _ in steppers].index(decode_pid or pid)
                  for w, pid in engine_of.items()}
    by_phase = {}
    for k in sorted(set(phases)):
        mine = [r for r, ph in zip(results, phases) if ph == k and id(r) in kept]
        rows = [parts(r, receiver.traces[r["trace_id"]], engine_of, step_tid) for r in mine]
        gaps = [g for r in mine for g in gap_windows(r, stepper_of[
            receiver.traces[r["trace_id"]]["router.start"][2]["worker"]])]
        by_phase[str(k)] = {
            "summary": tail_table(rows), "itl": tail_table(gaps),
            "spread": spread([(r["step_cpu_ms"], r["step_wait_ms"]) for r in rows]
                             + [(g["step_cpu_ms"], g["step_wait_ms"]) for g in gaps]),
            "requests": [{k: round(v, 2) for k, v in r.items()} for r in rows]}
    return {"engines": engine_of, "step_threads": step_tid,
            "groups": titles,
            "probe_cpu_ms": {p: round(c / 1e6, 1) for p, c in cpu.items()},
            "cores": {"wall_s": round(wall, 1), "busy": round(busy / wall, 3),
                      "engines": round(engine / wall, 3), "app_others": round(other / wall, 3),
                      "foreign": round((busy - engine - other) / wall, 3)},
            "phases": by_phase}


def gap_windows(req: dict, k: int) -> list[dict]:
    """`req`'s gaps between tokens (ms), with its decoding engine's step thread (the `k`th
    stepper) over each: on a core, and runnable waiting."""
    return [{"ttft_ms": (b[0] - a[0]) / 1e6, "step_cpu_ms": (b[1 + k][0] - a[1 + k][0]) / 1e6,
             "step_wait_ms": (b[1 + k][1] - a[1 + k][1]) / 1e6}
            for a, b in itertools.pairwise(req["tokens"])]


BINS_MS = (5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, math.inf)
QUANTILES = (0.01, *(round(0.05 * i, 2) for i in range(1, 20)), 0.99)


def spread(windows: list[tuple[float, float]]) -> dict:
    """How a stretch of the step thread's CPU time stretches in wall time under the load:
    (CPU + runnable wait) / CPU of every window (a TTFT, a gap between tokens), by the
    window's CPU time (`BINS_MS`, upper edges): each bin's `QUANTILES` and its count."""
    out: dict = {"bins_ms": [b if math.isfinite(b) else None for b in BINS_MS],
                 "quantiles": list(QUANTILES), "ratios": [], "windows": []}
    lo = 0.0
    for hi in BINS_MS:
        r = sorted((c + w) / c for c, w in windows if lo <= c < hi and c > 0)
        out["windows"].append(len(r))
        out["ratios"].append([round(r[min(len(r) - 1, int(q * len(r)))], 3) for q in QUANTILES]
                             if r else None)
        lo = hi
    return out


def stretch_of(spread: dict, min_windows: int = 20) -> Stretch:
    """A layout's measured `spread` as the simulator's `Stretch` (step seconds): each bin's
    quantiles, its lowest and highest standing for quantiles 0 and 1; a bin of fewer than
    `min_windows` windows takes the nearest bin's with enough."""
    from benchmarks.sim_cluster import Stretch

    full = [i for i, n in enumerate(spread["windows"]) if n >= min_windows]
    if not full:
        raise ValueError(f"no bin has {min_windows} windows: {spread['windows']}")
    bins = []
    for i, edge in enumerate(spread["bins_ms"]):
        ratios = spread["ratios"][min(full, key=lambda k: (abs(k - i), k))]
        points = ((0.0, ratios[0]), *zip(spread["quantiles"], ratios), (1.0, ratios[-1]))
        bins.append((math.inf if edge is None else edge / 1e3, tuple(points)))
    return Stretch(tuple(bins))


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", type=lambda s: s.split(","),
                   default=["aggregated", "disaggregated"])
    p.add_argument("--phase-s", type=float, default=300.0)
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                   default=[1.2, 0.2, 1.2])
    p.add_argument("--phases", type=lambda s: [int(x) for x in s.split(",")],
                   default=[0, 1, 2], help="the trace's phases replayed, in a row")
    p.add_argument("--out", default=str(RESULTS / "planner_ttft_tail.json"))
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="ttft-tail-")
    model = str(make_model(Path(tmp) / "small", arch="llama", preset="small"))
    setup = argparse.Namespace(seed=0, phase_s=args.phase_s, rates=args.rates,
                               short_input=128, short_output=128, long_input=2048,
                               long_output=64)
    chosen = [a for a in trace(setup, json_vocab(model)) if a.phase in args.phases]
    shift = min(args.phases) * args.phase_s  # the first phase replayed starts at once
    sends = [(a.at_s - shift, a.spec.prompt, a.spec.max_tokens) for a in chosen]
    phases = [a.phase for a in chosen]
    receiver = Receiver()
    os.environ.update(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=
                      f"http://127.0.0.1:{receiver.server_address[1]}/v1/traces",
                      OTEL_BSP_SCHEDULE_DELAY="200")
    layouts = {name: measure(name, model, tmp, sends, phases, receiver)
               for name in args.layouts}
    return emit({"benchmark": "planner_ttft_tail", "command": command_line(None),
                 "time": time.strftime("%Y-%m-%d %H:%M"), "load_average": os.getloadavg(),
                 "trace": {"phase_s": args.phase_s, "rates": args.rates, "phases": args.phases,
                           "requests": [phases.count(k) for k in args.phases]},
                 "layouts": layouts}, Path(args.out))


if __name__ == "__main__":
    main()
