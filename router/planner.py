"""The SLO planner: how many prefill and decode-pool workers, and which disaggregation
threshold, meet a TTFT and an ITL target at the fewest workers. Torch-free, pure: a
`PlanInput` (the traffic as request classes, a worker's `StepProfile`, the targets, the pools'
bounds) in, a `Plan` out; `SloPlanner` adds hysteresis. What carries a plan out (Serve's
replica counts, role switches, the router's threshold) is the actuator's
(`router.role_plan`), not this module's.

The model, per candidate layout (a threshold T: prompts of fewer uncached tokens run whole on a
decode-pool worker, the others are handed off; T = 0 hands every prompt off; past the longest
prompt, the layout is aggregated):

- **Prefill pool** (n workers, prompts >= T): an M/M/n queue (least-loaded routing pools the
  workers' queues) of arrival rate λ (plus the prompts queued now, cleared within the TTFT
  target: a backlog after a shift of the mix is worked off, not carried) and mean service S
  (the prompts' `prefill_s`). A class's TTFT at percentile p is its own prefill, its KV
  transfer and one decode step plus the queue's wait at p, `ln(C/(1-p)) · S/(n - λS)`, C the
  Erlang C probability of waiting (0 while C <= 1-p). Exponential service waits longer than
  prompts of one length do: the planner errs towards more workers.
- **Decode pool** (m workers, every request decodes there; prompts < T prefill there too, each
  riding a decode step at `prefill_s_per_token` a token): a fraction f of each worker's time
  prefills short prompts; the streams a worker runs, B, and
  the inter-token latency, ITL = decode_step_s(B, ctx)/(1-f), solve Little's law
  B = λ · output · ITL / m. A short prompt's prefill stalls the streams of its worker once:
  decode_step_s + its chunk's tokens must stay within `max_gap_itl` ITL targets,
  which bounds the threshold from the profile.

The chosen layout is the feasible one of fewest workers (ties: fewer prefill workers, then
fewer handoffs).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

from router.plan_records import Plan, PlanInput, PoolBounds, RequestClass, SloTargets
from router.queueing import fewest, queue_wait_s

AGGREGATED = 1 << 30  # a threshold past any prompt: every request runs whole
# with no layout meeting the targets, a layout change must cut the predicted overshoot to
# below this fraction of the current layout's
INFEASIBLE_MARGIN = 0.8


def _mean(classes: Sequence[RequestClass],
          value: Callable[[RequestClass], float]) -> tuple[float, float]:
    """Total rate of `classes` and the rate-weighted mean of `value(c)`."""
    rate = sum(c.rate for c in classes)
    if rate <= 0:
        return 0.0, 0.0
    return rate, sum(c.rate * value(c) for c in classes) / rate


def prefill_pool(classes: Sequence[RequestClass], inp: PlanInput, decode_step_s: float,
                 at: int | None = None) -> tuple[int, float]:
    """Fewest prefill workers (within bounds) for `classes`, and the worst class's TTFT
    (`at`: that many workers, and the TTFT at it)."""
    p, t = inp.profile, inp.targets
    rate, service = _mean(classes, lambda c: p.prefill_s(c.prompt_tokens))
    lo, hi = inp.bounds.min_prefill, inp.bounds.max_prefill
    if rate <= 0:
        return lo, 0.0
    rate += inp.backlog_tokens * p.prefill_s_per_token / service / t.ttft_s
    alone = max(p.prefill_s(c.prompt_tokens) + p.handoff_s(c.prompt_tokens)
                + p.transfer_s(c.prompt_tokens)
                for c in classes if c.rate > 0) + decode_step_s

    def ttft(n: int) -> float:
        return alone + queue_wait_s(rate, service, t.percentile, n) if n else math.inf

    if at is not None:
        return at, ttft(at)
    n = fewest(min(max(lo, 1, math.ceil(rate * service)), hi), hi,
               lambda n: ttft(n) <= t.ttft_s)
    return n, ttft(n)


def decode_pool(classes: Sequence[RequestClass], short: Sequence[RequestClass],
                inp: PlanInput, at: int | None = None) -> tuple[int, float, float, float]:
    """Fewest decode-pool workers for every class's decode and `short`'s prefills: (m, ITL,
    the short classes' worst TTFT, one step's time); `at`: at that many workers."""
    p, t, b = inp.profile, inp.targets, inp.bounds
    rate, out = _mean(classes, lambda c: c.output_tokens)
    ctx = _mean(classes, lambda c: c.prompt_tokens + c.output_tokens / 2)[1]
    # a short prompt rides a decode step: its tokens' cost, not a prefill step's fixed cost
    s_rate, s_service = _mean(short, lambda c: p.prefill_s_per_token * min(c.prompt_tokens,
                                                                           p.chunk_tokens))
    k = p.decode_s_per_seq + ctx * p.decode_s_per_ctx_token
    if s_rate and len(short) == len(classes):  # no prefill pool: the backlog is here
        s_rate += inp.backlog_tokens * p.prefill_s_per_token / s_service / t.ttft_s

    def predict(m: int) -> tuple[float, float, float]:
        """(ITL, the short classes' worst TTFT, one step) at m workers."""
        f = s_rate * s_service / m
        load = rate * out / ((1 - f) * m) if f < 1 else math.inf
        if load * k >= 1:
            return math.inf, math.inf, math.inf
        batch = load * p.decode_fixed_s / (1 - load * k)
        step = p.decode_step_s(batch, ctx)
        itl = step / (1 - f) if batch <= p.max_batch else math.inf
        short_ttft = 0.0
        if short:
            short_ttft = step + queue_wait_s(s_rate, s_service, t.percentile, m) + max(
                p.prefill_s_per_token * c.prompt_tokens for c in short if c.rate > 0)
        return itl, short_ttft, step

    def meets(m: int) -> bool:
        itl, short_ttft, _ = predict(m)
        return itl <= t.itl_s * t.itl_headroom and short_ttft <= t.ttft_s

    if at is not None:
        return (at, *predict(at))
    lo = min(max(b.min_decode, math.ceil(rate * out * k + s_rate * s_service)), b.max_decode)
    m = fewest(lo, b.max_decode, meets)
    return (m, *predict(m))


def gap_s(prompt_tokens: float, inp: PlanInput, step_s: float) -> float:
    """The slowest gap of a decode-pool worker's streams while it prefills `prompt_tokens`
    (one chunk of them) in a decode step."""
    p = inp.profile
    return step_s + p.prefill_s_per_token * min(prompt_tokens, p.chunk_tokens)


def gap_fits(prompt_tokens: float, inp: PlanInput, step_s: float) -> bool:
    """Whether prefilling `prompt_tokens` on a decode-pool worker keeps its streams' slowest
    gap within `max_gap_itl` ITL targets."""
    t = inp.targets
    return gap_s(prompt_tokens, inp, step_s) <= t.max_gap_itl * t.itl_s


def overshoot(plan: Plan, targets: SloTargets) -> float:
    """How far past its targets a plan is predicted to be: the largest of TTFT, ITL and the
    slowest gap over their bounds (<= 1: within all three)."""
    return max(plan.ttft_s / targets.ttft_s, plan.itl_s / targets.itl_s,
               plan.gap_s / (targets.max_gap_itl * targets.itl_s))


def layout(inp: PlanInput, threshold: int) -> Plan:
    """The fewest workers meeting the targets when prompts under `threshold` run whole."""
    live = [c for c in inp.classes if c.rate > 0]
    short = [c for c in live if c.prompt_tokens < threshold]
    long = [c for c in live if c.prompt_tokens >= threshold]
    m, itl, short_ttft, step = decode_pool(live, short, inp)
    n, long_ttft = prefill_pool(long, inp, step)
    over = n + m - inp.bounds.max_workers
    if over > 0:  # more than the bounds allow: both pools cut in proportion, predicted there
        b = inp.bounds
        # prompts handed off keep a prefill worker where the bounds leave room for one (none
        # would make this layout the aggregated one)
        floor = 1 if long and b.max_prefill >= 1 and b.max_workers > b.min_decode else 0
        n = max(b.min_prefill, floor, n - math.ceil(over * n / (n + m)))
        m, itl, short_ttft, step = decode_pool(live, short, inp,
                                               at=max(b.min_decode, b.max_workers - n))
        n, long_ttft = prefill_pool(long, inp, step, at=n)
    gaps = all(gap_fits(c.prompt_tokens, inp, step) for c in short)
    gap = max((gap_s(c.prompt_tokens, inp, step) for c in short), default=step)
    ttft = max(short_ttft, long_ttft)
    feasible = (over <= 0 and gaps and ttft <= inp.targets.ttft_s
                and itl <= inp.targets.itl_s)
    where = "aggregated" if not long else f"threshold {threshold}"
    reason = (f"{where}: {n} prefill for {sum(c.rate for c in long):.3g}/s, {m} decode for "
              f"{sum(c.rate for c in live):.3g}/s; TTFT p{inp.targets.percentile * 100:g} "
              f"{ttft:.3g}s (target {inp.targets.ttft_s:g}), ITL {itl:.3g}s (target "
              f"{inp.targets.itl_s:g})" + ("" if gaps else "; a short prefill stalls decode "
                                                           "past the gap bound"))
    return Plan(n, m, threshold, feasible, ttft, itl, reason, gap)


def thresholds(classes: Sequence[RequestClass]) -> list[int]:
    """The candidate thresholds: hand every prompt off, or run whole each class up to a
    prompt length (the last: every class, aggregated)."""
    lengths = sorted({math.floor(c.prompt_tokens) + 1 for c in classes if c.rate > 0})
    return [0] + lengths[:-1] + [AGGREGATED]


def best_plan(inp: PlanInput) -> Plan:
    """The feasible layout of fewest workers (ties: fewer prefill workers, then the higher
    threshold: fewer handoffs); when none is feasible within the bounds, the one predicting
    the least overshoot of its TTFT, ITL and gap bounds (`overshoot`)."""
    plans = [layout(inp, t) for t in thresholds(inp.classes)]

    def key(p: Plan) -> tuple[bool, float, int, int, int]:
        return (not p.feasible, 0.0 if p.feasible else overshoot(p, inp.targets), p.workers,
                p.prefill, -p.threshold_tokens)

    return min(plans, key=key)


class SloPlanner:
    """`best_plan` with hysteresis: the number of workers grows at once and shrinks only to
    the largest total the last `down_ticks` ticks asked for (a dip shorter than that removes
    nothing); the layout (the threshold) changes only for one that needs fewer workers than
    the current one does, or, while the bounds meet the targets with neither, for one whose
    overshoot is below `INFEASIBLE_MARGIN` times the current one's for `down_ticks` ticks in a
    row (no role switch back and forth between two layouts that both miss by about as much).
    The split between the pools follows the plan at once (a role switch is cheap); workers held
    beyond it stay in the decode pool, which runs both halves."""

    def __init__(self, down_ticks: int = 3) -> None:
        if down_ticks < 1:
            raise ValueError(f"down_ticks must be >= 1, got {down_ticks}")
        self.down_ticks = down_ticks
        self._wanted: deque[int] = deque(maxlen=down_ticks)
        self._candidate: tuple[int, int] | None = None  # (threshold, ticks it was the better)
        self.last: Plan | None = None

    def _persists(self, threshold: int, better: bool) -> bool:
        """Whether the layout at `threshold`, `better` (clearly smaller miss) this tick, has
        been so for `down_ticks` ticks in a row: a miss estimated from a few arrivals of a
        slow phase swings from tick to tick (0.2 requests/s: 3 in a 15 s window)."""
        if not better:
            self._candidate = None
            return False
        same = self._candidate is not None and self._candidate[0] == threshold
        ticks = self._candidate[1] + 1 if same and self._candidate else 1
        self._candidate = (threshold, ticks)
        return ticks >= self.down_ticks

    def decide(self, inp: PlanInput) -> Plan:
        """This tick's plan (kept as `last`)."""
        want = best_plan(inp)
        if self.last is None or self.last.threshold_tokens == want.threshold_tokens:
            self._candidate = None
        else:
            kept = layout(inp, self.last.threshold_tokens)  # a layout change must save workers
            if kept.feasible and kept.workers <= want.workers:
                want, self._candidate = kept, None
            elif not (kept.feasible or want.feasible) and not self._persists(
                    want.threshold_tokens, overshoot(want, inp.targets)
                    < INFEASIBLE_MARGIN * overshoot(kept, inp.targets)):
                want = kept  # both miss: change only for a clearly and lastingly smaller miss
        self._wanted.append(want.workers)
        total = min(max(self._wanted), inp.bounds.max_workers)
        decode = min(inp.bounds.max_decode, total - want.prefill)
        held = ""
        if decode != want.decode:
            held = (f"; {decode - want.decode} more decode held (the total shrinks after "
                    f"{self.down_ticks} ticks)")
        plan = Plan(want.prefill, decode, want.threshold_tokens, want.feasible, want.ttft_s,
                    want.itl_s, want.reason + held, want.gap_s)
        self.last = plan
        return plan


__all__ = ["AGGREGATED", "Plan", "PlanInput", "PoolBounds", "RequestClass", "SloPlanner",
           "SloTargets", "best_plan", "layout", "overshoot"]
