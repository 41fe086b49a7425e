"""The control plane at cluster scale: the real router decisions, SLO planner and role actuator
over simulated workers (`benchmarks/sim_cluster.py` says what is real and what is simulated),
replaying a trace whose prompt mix moves (short chat, then long-prompt summarization, then chat
again), with the planner on and with fixed layouts of the same maximum size.

    python benchmarks/simulate.py --workers 1000 --phase-s 30

Reports each layout's SLO attainment per phase, goodput, worker-seconds; the planner's decision
time per tick and the router's per request, the load reports (messages) per second, and the
router replicas those need (one core each doing only this); what a simulated second cost.
The workers' step costs: an H200 running an 8B model (`benchmarks/results/gpu_roofline.json`)
slowed by 70/8 (a 70B-class worker, derived, not measured), KV transfers at the ucx rate of
`benchmarks/results/kv_transfer.json` for a 70B-class KV of 320 KiB per token.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import time

import numpy as np

from benchmarks.results_io import RESULTS, command_line, emit
from benchmarks.sim_costs import control_plane_costs
from benchmarks.sim_cluster import BOTH, PREFILL, Cluster, Req, SimWorker
from router.decode_policy import get_decode_policy
from router.loads import NoHealthyWorker
from router.planner import PlanInput, PoolBounds, SloPlanner, SloTargets
from router.policy import get_policy
from router.profiles import StepProfile
from router.role_plan import WorkerState, role_changes
from router.split_policy import get_split_policy
from router.traffic import TrafficWindow
from workers.contract.protocol import SamplingParams, WorkerRequest

SCALE = 70 / 8
PROFILE = StepProfile(prefill_fixed_s=0.002 * SCALE, prefill_s_per_token=26.1e-6 * SCALE,
                      decode_fixed_s=4.9e-3 * SCALE, decode_s_per_seq=0.0555e-3 * SCALE,
                      transfer_s_per_token=320 * 1024 / 6.24e9, max_batch=256,
                      chunk_tokens=1536, source="gpu_roofline (8B on H200) x 70/8, derived")
TARGETS = SloTargets(ttft_s=2.0, itl_s=0.1, percentile=0.9, max_gap_itl=5.0)
# (prompt tokens, output tokens, requests/s at 1,000 workers)
PHASES = ((128, 128, 4000.0), (2048, 64, 1000.0), (128, 128, 4000.0))
START_S = 10.0  # a replica's start (a warm node, weights cached)
TICK_S = 1.0


def met(r: Req) -> bool:
    if r.refused or math.isnan(r.done):
        return False
    itl = (r.done - r.first) / max(1, r.output - 1)
    return (r.first - r.arrival <= TARGETS.ttft_s and itl <= TARGETS.itl_s
            and r.max_gap <= TARGETS.max_gap_itl * TARGETS.itl_s)


class Run:
    """One layout over the trace."""

    def __init__(self, layout: str, workers: int, phase_s: float, seed: int,
                 trace: list[Req] | None = None) -> None:
        """`trace`: arrivals to replay (another run's, e.g. the Ray app's seeded trace) instead
        of drawing Poisson arrivals from PHASES' rates."""
        self.layout, self.n, self.phase_s, self.trace = layout, workers, phase_s, trace
        self.c = Cluster(PROFILE, get_policy("prefix_aware"), get_decode_policy("least_loaded"))
        prefill = {"aggregated": 0, "disagg_1to1": workers // 2, "disagg_1to3": workers // 4,
                   "conditional_1to3": workers // 4, "planner": 0}[layout]
        for i in range(workers):
            self.c.add(PREFILL if i < prefill else BOTH, 0.0)
        threshold = {"aggregated": 0, "conditional_1to3": 512}.get(layout, 0)
        self.split = get_split_policy("uncached_threshold", threshold_tokens=threshold)
        self.planner = SloPlanner(down_ticks=10) if layout == "planner" else None
        self.traffic = TrafficWindow(window_s=10.0, burst_s=2.0)
        self.rng = random.Random(seed)
        self.requests: list[Req] = []
        self.route_s: list[float] = []
        self.tick_s: list[float] = []
        self.switches: list[float] = []
        self.plans: list[tuple] = []  # (time, prefill, decode, threshold, feasible, workers)
        self.worker_s = 0.0
        self._wreq: dict[int, WorkerRequest] = {}

    def _request(self, prompt: int) -> WorkerRequest:
        """The record the split policy reads (one per prompt length: only its length counts)."""
        if prompt not in self._wreq:
            self._wreq[prompt] = WorkerRequest("sim", tuple(range(prompt)), SamplingParams())
        return self._wreq[prompt]

    def arrivals(self, scale: float) -> None:
        for r in self.trace or ():
            self.requests.append(r)
            self.c.at(r.arrival, "arrive", r)
        t = 0.0
        for phase, (prompt, output, rate) in enumerate(() if self.trace else PHASES):
            end = (phase + 1) * self.phase_s
            while True:
                t += self.rng.expovariate(rate * scale)
                if t >= end:
                    t = end
                    break
                r = Req(t, prompt, output, phase)
                self.requests.append(r)
                self.c.at(t, "arrive", r)
        for k in range(1, int(len(PHASES) * self.phase_s / TICK_S) + 1):
            self.c.at(k * TICK_S, "tick", None)

    def arrive(self, r: Req, now: float) -> None:
        c = self.c
        self.traffic.arrived(now, r.prompt, r.output)
        start = time.perf_counter()
        prefill, decode = c.pool(True), c.pool(False)
        hand = bool(prefill) and self.split.run_here(self._request(r.prompt), 0) is None
        d = None
        for loads in ((prefill, decode) if hand else (decode,)):
            room = loads.any_with_room(256, 1 << 20)  # the queue admission (429 when False)
            if room is None:  # no healthy prefill worker: aggregated, as the orchestrator does
                continue
            d = c.route.choose((), loads, c.index) if room else None
            hand = hand and loads is prefill
            break
        self.route_s.append(time.perf_counter() - start)
        if d is None:
            r.refused = True
            return
        c.enqueue(c.workers[d.worker_id], r, hand, now)

    def tick(self, now: float) -> None:
        c = self.c
        self.worker_s += TICK_S * len(c.workers)
        if self.planner is None:
            return
        start = time.perf_counter()
        classes = self.traffic.classes(now)
        if not classes:
            return
        backlog = float(c.table.pending[c.table.rows_of(c.workers)].sum())
        inp = PlanInput(classes, c.fitter.profile() or PROFILE, TARGETS,
                        PoolBounds(0, self.n, 1, self.n, self.n), backlog)
        plan = self.planner.decide(inp)
        self.plans.append((round(now, 1), plan.prefill, plan.decode, plan.threshold_tokens,
                           plan.feasible, len(c.workers)))
        live = [w for w in c.workers.values() if not w.draining]
        changes = role_changes([WorkerState(w.wid, w.role, True, len(w.streams))
                                for w in live], plan)
        self.tick_s.append(time.perf_counter() - start)
        self.split = get_split_policy("uncached_threshold",
                                      threshold_tokens=plan.threshold_tokens)
        for wid, role in changes.switches:
            self.switch(c.workers[wid], role, now)
        self.resize(live, changes.switchable_replicas, plan.prefill, now)

    def resize(self, live: list[SimWorker], want: int, want_prefill: int, now: float) -> None:
        """Start replicas (as decode-pool workers) or drain the emptiest away."""
        c = self.c
        for _ in range(want - len(live)):
            c.add(BOTH, now, START_S)
        surplus = len(live) - want
        if surplus <= 0:
            return
        prefill = sum(1 for w in live if w.role == PREFILL)
        extra_p = max(0, min(surplus, prefill - want_prefill))
        by_load = sorted(live, key=lambda w: (len(w.streams) + len(w.queue), w.wid))
        gone = [w for w in by_load if w.role == PREFILL][:extra_p]
        gone += [w for w in by_load if w.role != PREFILL][:surplus - extra_p]
        for w in gone:
            self.switch(w, None, now)

    def switch(self, w: SimWorker, role: object, now: float) -> None:
        """Drain `w` (no new requests; its streams move by live migration, bulk pulls one at a
        time with a rest as long, as `router.live_migration` paces them), then it takes
        `role` (None: it is removed)."""
        c = self.c
        w.draining = True
        c.table.healthy[c.table.row_of[w.wid]] = False
        if w.role == PREFILL:  # to the decode pool, or away: once its prompts are done
            c.at(now + (PROFILE.prefill_s(w.pending) if w.pending else 0.0), "switched",
                 (w, role, now))
            return
        pulls = sum(PROFILE.transfer_s(r.prompt) for r in w.streams)
        c.at(now + 2 * pulls + PROFILE.decode_step_s(len(w.streams), 0), "switched",
             (w, role, now))

    def switched(self, what: tuple, now: float) -> None:
        w, role, began = what
        c = self.c
        if w.removed:
            return
        if w.role == PREFILL and w.queue:  # prompts still there (`router.role_switch`)
            c.at(now + PROFILE.prefill_s(w.pending), "switched", what)
            return
        for i, req in enumerate(w.streams):
            try:
                pick = c.decode.pick((), c.pool(False).without([w.wid]), c.index)
            except NoHealthyWorker:
                break
            pick.release()
            c.join(c.workers[pick.worker_id], req, now, int(w.left[i]), now)
        w.streams, w.left, w.last, w.gap = [], w.left[:0], w.last[:0], w.gap[:0]
        self.switches.append(now - began)
        if role is None:
            c.remove(w)
            return
        if role is not None:
            c.set_role(w, role)
            w.draining = False
            c.report(w, now)

    def joined(self, what: tuple, now: float) -> None:
        """A handoff's KV landed on its decode worker."""
        w, req = what
        w.incoming -= 1
        self.c.join(w, req, now, req.output - 1, req.first)

    def run(self, scale: float) -> dict:
        self.arrivals(scale)
        c, end = self.c, len(PHASES) * self.phase_s + 60.0
        handlers = {"arrive": self.arrive, "tick": lambda _, now: self.tick(now),
                    "ready": c.ready,
                    "step": lambda w, now: c.step(w, now),
                    "stepped": c.stepped,
                    "joined": self.joined,
                    "switched": self.switched}
        wall = time.perf_counter()
        while c.events and c.events[0][0] < end:
            now, _, kind, what = heapq.heappop(c.events)
            handlers[kind](what, now)
        wall = time.perf_counter() - wall
        return self.report(wall)

    def report(self, wall_s: float) -> dict:
        sim_s = len(PHASES) * self.phase_s
        worker_s = self.worker_s or self.n * sim_s
        phases = {}
        for p in range(len(PHASES)):
            mine = [r for r in self.requests if r.phase == p]
            phases[str(p)] = round(sum(map(met, mine)) / max(1, len(mine)), 4)
        good = sum(map(met, self.requests))
        out = {"requests": len(self.requests), "slo_met_by_phase": phases,
               "refused": sum(r.refused for r in self.requests),
               "goodput_per_s": round(good / sim_s, 1), "worker_s": round(worker_s),
               "goodput_per_worker_s": round(good / worker_s, 4),
               "wall_s_per_sim_s": round(wall_s / sim_s, 3),
               "route_us_mean": round(1e6 * float(np.mean(self.route_s)), 1),
               "reports_per_sim_s": round(self.c.messages / sim_s)}
        if self.tick_s:
            out.update(planner_tick_ms_mean=round(1e3 * float(np.mean(self.tick_s)), 2),
                       planner_tick_ms_max=round(1e3 * max(self.tick_s), 2),
                       role_switches=len(self.switches),
                       switch_s_median=round(float(np.median(self.switches)), 3)
                       if self.switches else None)
        return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--phase-s", type=float, default=30.0)
    ap.add_argument("--layouts", default="planner,aggregated,disagg_1to1,disagg_1to3,"
                                         "conditional_1to3")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate", type=float, default=10_000.0,
                    help="requests/s the control plane's costs are sized for")
    ap.add_argument("--same-cost", action=argparse.BooleanOptionalAction, default=True,
                    help="also run each fixed layout at the planner's mean worker count")
    ap.add_argument("--out", default=str(RESULTS / "simulate.json"))
    args = ap.parse_args(argv)
    scale = args.workers / 1000
    names = args.layouts.split(",")
    layouts = {name: Run(name, args.workers, args.phase_s, args.seed).run(scale)
               for name in names if name}
    if "planner" in layouts and args.same_cost:  # fixed layouts as large as the planner's mean
        mean = round(layouts["planner"]["worker_s"] / (len(PHASES) * args.phase_s))
        for name in names:
            if name != "planner" and mean < args.workers:
                layouts[f"{name}@{mean}"] = Run(name, mean, args.phase_s, args.seed).run(scale)
    result: dict = {"benchmark": "simulate", "command": command_line(argv),
                    "workers": args.workers, "phases": [
                        {"prompt": p, "output": o, "rate": r * scale} for p, o, r in PHASES],
                    "phase_s": args.phase_s, "profile": PROFILE.source,
                    "targets": {"ttft_s": TARGETS.ttft_s, "itl_s": TARGETS.itl_s,
                                "max_gap_s": TARGETS.max_gap_itl * TARGETS.itl_s},
                    "layouts": layouts}
    fixed = {k: v for k, v in layouts.items() if k != "planner"}
    if "planner" in layouts and fixed:
        p = layouts["planner"]
        best = max(fixed, key=lambda k: fixed[k]["goodput_per_worker_s"])
        result["best_fixed"] = best
        result["goodput_per_worker_s_vs_best_fixed_ratio"] = round(
            p["goodput_per_worker_s"] / max(1e-9, fixed[best]["goodput_per_worker_s"]), 3)
        result["worker_s_vs_best_fixed_ratio"] = round(
            p["worker_s"] / fixed[best]["worker_s"], 3)
        full = [k for k in fixed if "@" not in k]
        result["worker_s_vs_fixed_peak_ratio"] = round(
            p["worker_s"] / max(fixed[k]["worker_s"] for k in full), 3) if full else None
        meeting = [k for k in fixed if min(fixed[k]["slo_met_by_phase"].values()) >= 0.9]
        if meeting:  # the cheapest fixed layout that meets the SLO in every phase
            cheapest = min(meeting, key=lambda k: fixed[k]["worker_s"])
            result["cheapest_fixed_meeting_slo"] = cheapest
            result["worker_s_vs_cheapest_fixed_meeting_slo_ratio"] = round(
                p["worker_s"] / fixed[cheapest]["worker_s"], 3)
        result["min_phase_slo_planner"] = min(p["slo_met_by_phase"].values())
        result["min_phase_slo_best_fixed"] = min(fixed[best]["slo_met_by_phase"].values())
    costs = control_plane_costs(args.workers, args.rate, PROFILE, TARGETS, args.seed)
    # every worker reports to every router replica once per engine step; the requests divide
    steps_per_s = 1 / PROFILE.decode_step_s(
        (TARGETS.itl_s * TARGETS.itl_headroom - PROFILE.decode_fixed_s)
        / PROFILE.decode_s_per_seq, 0)
    reports = args.workers * steps_per_s
    report_load = reports * costs["report_us"] * 1e-6
    route_load = args.rate * (costs["route_us"] + costs["decode_pick_us"]) * 1e-6
    result.update({k: round(v, 2) for k, v in costs.items()})
    result.update(reports_per_router_s=round(reports), requests_per_s=args.rate,
                  report_core_load=round(report_load, 3), route_core_load=round(route_load, 3),
                  router_replicas_needed=(math.ceil(route_load / (1 - report_load))
                                          if report_load < 1 else None))
    return emit(result, args.out)


if __name__ == "__main__":
    main()
