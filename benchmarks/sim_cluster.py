"""Simulated workers under the real control plane (`benchmarks/simulate.py` drives it).

What is real: the router's load table (`router.loads.LoadTable`, one row per worker, updated by
one report per engine step, as the workers' channels push them), its routing and decode
policies (`router.policy`, `router.decode_policy`), the split policy with the planner's
threshold (`router.split_policy`), the queue admission (`LoadTable.any_with_room`) and the
deadline admission (`router.deadline`), the traffic window, the profile fitter, the SLO planner
and the role actuator (`router.traffic`, `router.profiles`, `router.planner`,
`router.role_plan`). What is simulated: the workers' steps (their durations from a
`StepProfile`), KV transfers (from the profile's measured transfer rate), replica starts, and
a role switch's live migration (its bulk pulls paced as `router.live_migration` paces them).
The orchestrator's async plumbing and the channels are not run.

A worker steps while it has work: a decode-pool worker decodes every running stream and
prefills up to `chunk_tokens` of its queue in one step (chunked prefill); a prefill worker
prefills only, and hands each finished prompt to the decode worker the decode policy picks,
where it joins after the KV transfer. Workers on one machine (`Cluster.corun` > 1, the
calibration's two workers on two shared cores) slow each other: while more than one steps,
each step's work advances at 1/corun. Or, measured per step (`Cluster.spreads`, each a
`Stretch` from its time on): its time over its profile's drawn from how the Ray app's step
loop stretched under the same load (runnable but waiting for its core while other processes
ran: `benchmarks/planner_ttft_tail.py`), by the step's length. `Cluster.keep_gaps` keeps
every gap between a request's tokens (the Ray benchmark's ITL is over those).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from router.decode_policy import DecodePolicy
from router.loads import LoadTable, NoHealthyWorker
from router.prefix_index import PrefixIndex
from router.profiles import ProfileFitter, StepProfile
from workers.contract.protocol import WorkerRole

PREFILL, BOTH = WorkerRole.PREFILL, WorkerRole.BOTH


@dataclass
class Req:
    arrival: float
    prompt: int
    output: int
    phase: int
    first: float = math.nan  # first token's time
    done: float = math.nan
    max_gap: float = 0.0
    refused: bool = False
    gaps: list[float] | None = None  # every gap between its tokens, where the run keeps them


@dataclass(frozen=True)
class Stretch:
    """A step's time over its profile's, drawn per step from a measured distribution that
    depends on the step's length. `bins`: (upper edge of the step's profile time (s), its
    (quantile, ratio) points from quantile 0 to 1, linear between them), edges ascending; a
    step past the last edge draws from the last bin."""

    bins: tuple[tuple[float, tuple[tuple[float, float], ...]], ...]

    def draw(self, step_s: float, u: float) -> float:
        """The ratio at quantile `u` (in [0, 1)) for a step of `step_s` seconds."""
        points = next((pts for edge, pts in self.bins if step_s < edge), self.bins[-1][1])
        q, ratio = zip(*points)
        return float(np.interp(u, q, ratio))


@dataclass
class SimWorker:
    wid: str
    role: WorkerRole
    ready_at: float  # started (or starting) until then
    queue: deque = field(default_factory=deque)  # [Req, prompt tokens left, hand off?]
    pending: int = 0  # prompt tokens queued
    streams: list = field(default_factory=list)  # Reqs decoding here
    left: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last: np.ndarray = field(default_factory=lambda: np.zeros(0))
    gap: np.ndarray = field(default_factory=lambda: np.zeros(0))
    incoming: int = 0  # handoffs on their way here (reported as waiting for KV)
    stepping: bool = False
    draining: bool = False
    removed: bool = False


class Cluster:
    """Workers, their steps as events, and the router's table they report to."""

    def __init__(self, profile: StepProfile, route: object, decode: DecodePolicy) -> None:
        self.profile, self.route, self.decode = profile, route, decode
        self.table = LoadTable.empty()
        self.index = PrefixIndex()  # the trace shares no prefixes: every lookup misses
        self.workers: dict[str, SimWorker] = {}
        self.events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._pools: dict[bool, np.ndarray] = {}
        self.fitter = ProfileFitter(profile)
        self.messages = 0  # load reports (one per engine step)
        self.finished: list[Req] = []
        self.keep_gaps = False  # each request's every gap between tokens (`Req.gaps`)
        # a step's slowdown while another worker steps on the same machine (shared memory bus
        # and cache; `benchmarks/planner_corun.py`); 1: each worker on its own machine
        self.corun = 1.0
        # a step's time over its profile's, drawn per step from a measured spread: (from this
        # time (s) on, its `Stretch`), ascending from 0; (): exact
        self.spreads: tuple[tuple[float, Stretch], ...] = ()
        self._rng = np.random.default_rng(0)
        self._running: dict[str, list] = {}  # worker id -> [work left (s), step, its end's token]
        self._mark = 0.0  # when `_running`'s work was last advanced

    # ---- membership -------------------------------------------------------------------------

    def add(self, role: WorkerRole, now: float, start_s: float = 0.0) -> SimWorker:
        w = SimWorker(f"w{next(self._ids)}", role, now + start_s)
        self.workers[w.wid] = w
        self.table.add(w.wid)
        self.table.report(w.wid, 0, 0, 0.0, 0, start_s == 0,
                          prefill_s_per_token=self.profile.prefill_s_per_token)
        self._pools.clear()
        if start_s:
            self.at(w.ready_at, "ready", w)
        return w

    def ready(self, w: SimWorker, now: float) -> None:
        if not w.removed:
            self.report(w, now)

    def set_role(self, w: SimWorker, role: WorkerRole) -> None:
        w.role = role
        self._pools.clear()

    def remove(self, w: SimWorker) -> None:
        w.removed = True
        self.table.remove(w.wid)
        del self.workers[w.wid]
        self._pools.clear()

    def pool(self, prefill: bool) -> LoadTable:
        """The prefill pool's or the decode pool's rows of the router's table."""
        rows = self._pools.get(prefill)
        if rows is None:
            rows = self._pools[prefill] = self.table.rows_of(
                [w.wid for w in self.workers.values() if (w.role == PREFILL) == prefill])
        return self.table.select(rows)

    # ---- events -----------------------------------------------------------------------------

    def at(self, t: float, kind: str, what: object) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, what))

    def enqueue(self, w: SimWorker, req: Req, hand_off: bool, now: float) -> None:
        w.queue.append([req, req.prompt, hand_off])
        w.pending += req.prompt
        self.table.waiting[self.table.row_of[w.wid]] += 1  # `WorkerSet.note_routed`
        self.wake(w, now)

    def join(self, w: SimWorker, req: Req, now: float, left: int, last: float) -> None:
        """`req` decodes on `w` from now, `left` tokens to go, its last token sent at
        `last`. On a worker routed as prefill (or draining) it moves on at once, as
        `LiveMigrations.track` moves it."""
        if (w.role == PREFILL or w.draining) and self.pool(False).without([w.wid]):
            try:
                pick = self.decode.pick((), self.pool(False).without([w.wid]), self.index)
                pick.release()
                w = self.workers[pick.worker_id]
            except NoHealthyWorker:
                pass
        w.streams.append(req)
        w.left = np.append(w.left, left)
        w.last = np.append(w.last, last)
        w.gap = np.append(w.gap, req.max_gap)
        self.wake(w, now)

    def wake(self, w: SimWorker, now: float) -> None:
        if not w.stepping and not w.removed:
            w.stepping = True
            self.at(max(now, w.ready_at), "step", w)

    def step(self, w: SimWorker, now: float) -> None:
        """`w` runs one step from `now`: its effects land at the step's end ("stepped")."""
        p = self.profile
        budget, chunks = p.chunk_tokens, []
        for item in w.queue:
            if budget <= 0:
                break
            take = min(budget, item[1])
            chunks.append((item, take))
            budget -= take
        tokens = p.chunk_tokens - budget
        batch = len(w.streams)  # a switched worker's engine still decodes what it holds
        if not tokens and not batch:
            w.stepping = False
            return
        ctx = (float(np.mean([r.prompt for r in w.streams]))
               if batch and p.decode_s_per_ctx_token else 0.0)
        if batch:  # prompt tokens ride the decode step (no second fixed cost)
            dur = p.decode_step_s(batch, ctx) + p.prefill_s_per_token * tokens
        else:
            dur = p.prefill_s(tokens)
        if self.spreads:
            stretch = next(st for since, st in reversed(self.spreads) if since <= now)
            dur *= stretch.draw(dur, self._rng.random())
        if batch and not tokens:
            self.fitter.observe_decode(batch, ctx, dur)
        if self.corun == 1.0:
            self.at(now + dur, "stepped", (w, chunks, batch, None))
            return
        self._share(now)
        self._running[w.wid] = [dur, (w, chunks, batch), None]
        self._reschedule(now)

    # ---- steps that share one machine (`corun` > 1) -----------------------------------------

    def _rate(self) -> float:
        """Alone-seconds of work a running step does per second: slower while another worker
        of the machine steps too."""
        return 1.0 / self.corun if len(self._running) > 1 else 1.0

    def _share(self, now: float) -> None:
        """The running steps' work left, advanced to `now` at the rate they ran at."""
        rate = self._rate()
        for entry in self._running.values():
            entry[0] -= (now - self._mark) * rate
        self._mark = now

    def _reschedule(self, now: float) -> None:
        """Each running step's end at the rate from `now` (earlier end events go stale)."""
        rate = self._rate()
        for entry in self._running.values():
            entry[2] = token = next(self._seq)
            self.at(now + max(0.0, entry[0]) / rate, "stepped", (*entry[1], token))

    def stepped(self, what: tuple, now: float) -> None:
        """A step's end: `what` is (worker, its prompt chunks, its batch, the end's token: None
        for a step alone on its machine, else stale unless its running entry's latest)."""
        w, chunks, batch, token = what
        if token is not None:
            entry = self._running.get(w.wid)
            if entry is None or entry[2] != token:
                return
            self._share(now)
            del self._running[w.wid]
            self._reschedule(now)
        if batch:
            n = batch
            if self.keep_gaps:
                for req, gap in zip(w.streams[:n], (now - w.last[:n]).tolist()):
                    req.gaps.append(gap)
            w.gap[:n] = np.maximum(w.gap[:n], now - w.last[:n])
            w.last[:n] = now
            w.left[:n] -= 1
            done = np.flatnonzero(w.left[:n] <= 0)
            for i in done[::-1]:
                req = w.streams.pop(int(i))
                req.done, req.max_gap = now, float(w.gap[i])
                self.finished.append(req)
            if len(done):
                keep = np.ones(len(w.left), bool)
                keep[done] = False
                w.left, w.last, w.gap = w.left[keep], w.last[keep], w.gap[keep]
        for item, take in chunks:
            item[1] -= take
            w.pending -= take
            if item[1] == 0:
                w.queue.remove(item)
                self.first_token(w, item[0], item[2], now)
        self.report(w, now)  # one report per step, as the channel pushes it
        w.stepping = False
        if w.queue or w.streams:
            self.wake(w, now)

    def report(self, w: SimWorker, now: float) -> None:
        """`w`'s load as its channel pushes it (after a step; after a change while idle, as
        its heartbeat would)."""
        if w.wid in self.table.row_of:
            self.table.report(w.wid, len(w.queue) + w.incoming, len(w.streams),
                              min(1.0, len(w.streams) / 256), w.pending,
                              not w.draining and now >= w.ready_at,
                              prefill_s_per_token=self.profile.prefill_s_per_token)
            self.messages += 1

    def first_token(self, w: SimWorker, req: Req, hand_off: bool, now: float) -> None:
        """`req`'s prompt is in. A handed-off request's first token reaches the client with
        its handoff (the prefill call returns both: `router.orchestrator`), the profile's
        `handoff_s` later; it joins its decode worker once its KV is pulled (`transfer_s`)."""
        hand_off = hand_off and req.output > 1  # one token: no handoff, done at the prefill
        req.first = now + (self.profile.handoff_s(req.prompt) if hand_off else 0.0)
        if self.keep_gaps:
            req.gaps = []
        if req.output <= 1:
            req.done = now
            self.finished.append(req)
        elif not hand_off:
            self.join(w, req, now, req.output - 1, now)
        else:  # the decode policy picks where it decodes; it joins once the KV is there
            pick = self.decode.pick((), self.pool(False), self.index)
            target = self.workers[pick.worker_id]
            pick.release()
            target.incoming += 1  # `WorkerSet.note_routed`, then its reports count it
            self.table.waiting[self.table.row_of[target.wid]] += 1
            self.at(req.first + self.profile.transfer_s(req.prompt), "joined", (target, req))
