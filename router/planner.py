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
  workers' queues) of arrival rate λ and mean service S (the prompts' `prefill_s`); a class's
  TTFT at percentile p is its own prefill, its KV transfer and one decode step plus the
  queue's wait at p, `ln(C/(1-p)) · S/(n - λS)` with C the Erlang C probability of waiting (0
  while C <= 1-p). Exponential service waits longer than prompts of one length do: the planner
  errs towards more workers.
- **Decode pool** (m workers, every request decodes there; prompts < T prefill there too): a
  fraction f of each worker's time prefills short prompts; the streams a worker runs, B, and
  the inter-token latency, ITL = decode_step_s(B, ctx)/(1-f), solve Little's law
  B = λ · output · ITL / m. A short prompt's prefill stalls the streams of its worker once:
  decode_step_s + prefill_s(min(prompt, chunk)) must stay within `max_gap_itl` ITL targets,
  which bounds the threshold from the profile.

The chosen layout is the feasible one of fewest workers (ties: fewer prefill workers, then
fewer handoffs).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.profiles import StepProfile

AGGREGATED = 1 << 30  # a threshold past any prompt: every request runs whole


@dataclass(frozen=True)
class SloTargets:
    """The latency targets: `ttft_s` and `itl_s` at `percentile` (0..1)."""

    ttft_s: float
    itl_s: float
    percentile: float = 0.9
    # the slowest inter-token gap a stream tolerates (another prompt prefilled on its worker),
    # in ITL targets
    max_gap_itl: float = 5.0

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.itl_s <= 0:
            raise ValueError(f"SLO targets must be > 0, got ttft_s={self.ttft_s}, "
                             f"itl_s={self.itl_s}")
        if not 0 < self.percentile < 1:
            raise ValueError(f"percentile must be in (0, 1), got {self.percentile}")
        if self.max_gap_itl < 1:
            raise ValueError(f"max_gap_itl must be >= 1, got {self.max_gap_itl}")


@dataclass(frozen=True)
class RequestClass:
    """Requests alike: `rate` per second, `prompt_tokens` uncached, `output_tokens`."""

    rate: float
    prompt_tokens: float
    output_tokens: float

    def __post_init__(self) -> None:
        if self.rate < 0 or self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"a request class needs rate >= 0 and prompt and output tokens "
                             f">= 1, got {self}")


@dataclass(frozen=True)
class PoolBounds:
    min_prefill: int = 0
    max_prefill: int = 1 << 20
    min_decode: int = 1
    max_decode: int = 1 << 20

    def __post_init__(self) -> None:
        if not 0 <= self.min_prefill <= self.max_prefill:
            raise ValueError(f"need 0 <= min_prefill <= max_prefill, got {self.min_prefill} "
                             f"and {self.max_prefill}")
        if not 1 <= self.min_decode <= self.max_decode:
            raise ValueError(f"need 1 <= min_decode <= max_decode, got {self.min_decode} and "
                             f"{self.max_decode}")


@dataclass(frozen=True)
class PlanInput:
    """What one planning tick knows."""

    classes: tuple[RequestClass, ...]
    profile: StepProfile
    targets: SloTargets
    bounds: PoolBounds = PoolBounds()


@dataclass(frozen=True)
class Plan:
    """Workers per pool and the router's threshold (`RouterConfig.disagg_threshold_tokens`),
    with what the model predicts for them and why."""

    prefill: int
    decode: int  # decode-pool workers (they also run the prompts under the threshold)
    threshold_tokens: int  # AGGREGATED: no prompt is handed off
    feasible: bool  # False: the bounds do not allow meeting the targets; the plan is the max
    ttft_s: float  # predicted, at the percentile, for the worst class
    itl_s: float  # predicted mean inter-token latency
    reason: str

    @property
    def workers(self) -> int:
        return self.prefill + self.decode


def queue_wait_s(rate: float, service_s: float, percentile: float, servers: int = 1) -> float:
    """The wait at `percentile` of an M/M/c queue of `servers` (Erlang C; inf when
    saturated). The router's least-loaded routing pools the workers' queues, so a pool of c
    workers waits as one queue of c servers, not as c queues of one."""
    a = rate * service_s  # offered load, in servers
    if a >= servers:
        return math.inf
    if a <= 0:
        return 0.0
    erlang_b = 1.0
    for k in range(1, servers + 1):
        erlang_b = a * erlang_b / (k + a * erlang_b)
    waits = erlang_b / (1 - a / servers * (1 - erlang_b))  # P(wait > 0), Erlang C
    if waits <= 1 - percentile:
        return 0.0
    return math.log(waits / (1 - percentile)) * service_s / (servers - a)


def _mean(classes: Sequence[RequestClass],
          value: Callable[[RequestClass], float]) -> tuple[float, float]:
    """Total rate of `classes` and the rate-weighted mean of `value(c)`."""
    rate = sum(c.rate for c in classes)
    if rate <= 0:
        return 0.0, 0.0
    return rate, sum(c.rate * value(c) for c in classes) / rate


def prefill_pool(classes: Sequence[RequestClass], inp: PlanInput,
                 decode_step_s: float) -> tuple[int, float]:
    """Fewest prefill workers (within bounds) for `classes`, and the worst class's TTFT."""
    p, t = inp.profile, inp.targets
    rate, service = _mean(classes, lambda c: p.prefill_s(c.prompt_tokens))
    lo, hi = inp.bounds.min_prefill, inp.bounds.max_prefill
    if rate <= 0:
        return lo, 0.0
    n = min(max(lo, 1, math.ceil(rate * service)), hi)
    while True:
        wait = queue_wait_s(rate, service, t.percentile, n)
        ttft = max(p.prefill_s(c.prompt_tokens) + p.transfer_s(c.prompt_tokens)
                   for c in classes if c.rate > 0) + wait + decode_step_s
        if ttft <= t.ttft_s or n >= hi:
            return n, ttft
        n += 1


def decode_pool(classes: Sequence[RequestClass], short: Sequence[RequestClass],
                inp: PlanInput) -> tuple[int, float, float, float]:
    """Fewest decode-pool workers for every class's decode and `short`'s prefills: (m, ITL,
    the short classes' worst TTFT, one step's time)."""
    p, t, b = inp.profile, inp.targets, inp.bounds
    rate, out = _mean(classes, lambda c: c.output_tokens)
    ctx = _mean(classes, lambda c: c.prompt_tokens + c.output_tokens / 2)[1]
    s_rate, s_service = _mean(short, lambda c: p.prefill_s(min(c.prompt_tokens, p.chunk_tokens)))
    k = p.decode_s_per_seq + ctx * p.decode_s_per_ctx_token
    m = min(max(b.min_decode, math.ceil(rate * out * k + s_rate * s_service)), b.max_decode)
    while True:
        f = s_rate * s_service / m
        itl = step = math.inf
        short_ttft = 0.0
        load = rate * out / ((1 - f) * m) if f < 1 else math.inf
        if load * k < 1:
            batch = load * p.decode_fixed_s / (1 - load * k)
            step = p.decode_step_s(batch, ctx)
            itl = step / (1 - f) if batch <= p.max_batch else math.inf
            if short:
                wait = queue_wait_s(s_rate, s_service, t.percentile, m)
                short_ttft = step + wait + max(p.prefill_s(c.prompt_tokens)
                                               for c in short if c.rate > 0)
        if (itl <= t.itl_s and short_ttft <= t.ttft_s) or m >= b.max_decode:
            return m, itl, short_ttft, step
        m += 1


def gap_fits(prompt_tokens: float, inp: PlanInput, step_s: float) -> bool:
    """Whether prefilling `prompt_tokens` on a decode-pool worker keeps its streams' slowest
    gap within `max_gap_itl` ITL targets."""
    p, t = inp.profile, inp.targets
    return step_s + p.prefill_s(min(prompt_tokens, p.chunk_tokens)) <= t.max_gap_itl * t.itl_s


def layout(inp: PlanInput, threshold: int) -> Plan:
    """The fewest workers meeting the targets when prompts under `threshold` run whole."""
    live = [c for c in inp.classes if c.rate > 0]
    short = [c for c in live if c.prompt_tokens < threshold]
    long = [c for c in live if c.prompt_tokens >= threshold]
    m, itl, short_ttft, step = decode_pool(live, short, inp)
    n, long_ttft = prefill_pool(long, inp, step)
    gaps = all(gap_fits(c.prompt_tokens, inp, step) for c in short)
    ttft = max(short_ttft, long_ttft)
    feasible = gaps and ttft <= inp.targets.ttft_s and itl <= inp.targets.itl_s
    where = "aggregated" if not long else f"threshold {threshold}"
    reason = (f"{where}: {n} prefill for {sum(c.rate for c in long):.3g}/s, {m} decode for "
              f"{sum(c.rate for c in live):.3g}/s; TTFT p{inp.targets.percentile * 100:g} "
              f"{ttft:.3g}s (target {inp.targets.ttft_s:g}), ITL {itl:.3g}s (target "
              f"{inp.targets.itl_s:g})" + ("" if gaps else "; a short prefill stalls decode "
                                                           "past the gap bound"))
    return Plan(n, m, threshold, feasible, ttft, itl, reason)


def thresholds(classes: Sequence[RequestClass]) -> list[int]:
    """The candidate thresholds: hand every prompt off, or run whole each class up to a
    prompt length (the last: every class, aggregated)."""
    lengths = sorted({math.floor(c.prompt_tokens) + 1 for c in classes if c.rate > 0})
    return [0] + lengths[:-1] + [AGGREGATED]


def best_plan(inp: PlanInput) -> Plan:
    """The feasible layout of fewest workers (ties: fewer prefill workers, then the higher
    threshold: fewer handoffs); when none is
    feasible within the bounds, the one predicting the least TTFT and ITL overshoot."""
    plans = [layout(inp, t) for t in thresholds(inp.classes)]
    t = inp.targets

    def key(p: Plan) -> tuple[bool, float, int, int, int]:
        over = max(p.ttft_s / t.ttft_s, p.itl_s / t.itl_s)
        return (not p.feasible, 0.0 if p.feasible else over, p.workers, p.prefill,
                -p.threshold_tokens)

    return min(plans, key=key)


class SloPlanner:
    """`best_plan` with hysteresis: a pool grows at once and shrinks only to the largest count
    the last `down_ticks` ticks asked for (so a dip shorter than that moves nothing)."""

    def __init__(self, down_ticks: int = 3) -> None:
        if down_ticks < 1:
            raise ValueError(f"down_ticks must be >= 1, got {down_ticks}")
        self._wanted: deque[Plan] = deque(maxlen=down_ticks)
        self.last: Plan | None = None

    def decide(self, inp: PlanInput) -> Plan:
        """This tick's plan (kept as `last`)."""
        want = best_plan(inp)
        self._wanted.append(want)
        prefill = max(p.prefill for p in self._wanted)
        decode = max(p.decode for p in self._wanted)
        held = ""
        if (prefill, decode) != (want.prefill, want.decode):
            held = (f"; held at {prefill} prefill, {decode} decode (shrinks after "
                    f"{self._wanted.maxlen} ticks)")
        plan = Plan(prefill, decode, want.threshold_tokens, want.feasible, want.ttft_s,
                    want.itl_s, want.reason + held)
        self.last = plan
        return plan


__all__ = ["AGGREGATED", "Plan", "PlanInput", "PoolBounds", "RequestClass", "SloPlanner",
           "SloTargets", "best_plan", "layout", "queue_wait_s"]
