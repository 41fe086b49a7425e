"""Deadline-aware admission: a request that carries its own TTFT target (the `x-slo-ttft-ms`
header) and cannot meet it under the current load is refused at once, with 429 and
Retry-After, before any worker does any work for it, rather than served late (Mooncake's early
rejection). Torch-free.

A worker's prediction is the prompt tokens this request would wait behind there (as pushed with
its load: under the worker's earliest-deadline-first queue, those running and those queued
with a deadline, not the ones without behind them; under `fcfs`, every one queued) and
this prompt's, at its measured prefill rate (`EngineStats.prefill_s_per_token`), plus `step_s`
for the step that returns the first token. A worker that has not measured its rate yet is
predicted at its measured peers' median (they serve the same model), and promises 0 when none
has. The request is routed only among the workers predicted to meet its deadline
(`within_deadline`); when there is none, it is refused (`refuse_late`). Requests without a
deadline are admitted and routed as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from router.counters import RouterCounters
from router.errors import BadRequestError, OverloadedError
from router.loads import LoadTable

TTFT_HEADER = "x-slo-ttft-ms"
MAX_TTFT_MS = 3_600_000.0  # an hour: a larger target is a typo, not a deadline


def ttft_deadline_s(headers: Mapping[str, str]) -> float | None:
    """The request's TTFT target in seconds from its `x-slo-ttft-ms` header (None: none).
    Raises `BadRequestError` for a value that is not a positive number of milliseconds."""
    raw = headers.get(TTFT_HEADER)
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if not 0 < ms <= MAX_TTFT_MS:
        raise BadRequestError(f"{TTFT_HEADER} must be a number of milliseconds in (0, "
                              f"{MAX_TTFT_MS:g}], got {raw!r}", param=TTFT_HEADER)
    return ms / 1000.0


def predicted_ttft_s(loads: LoadTable, prompt_tokens: int, step_s: float = 0.0) -> np.ndarray:
    """What each healthy candidate of `loads` promises a prompt of `prompt_tokens`, seconds,
    over `loads.healthy_rows()`' order (empty when none is healthy)."""
    rows = loads.rows[loads.healthy[loads.rows]]
    rate = loads.prefill_rate[rows]
    measured = rate[rate > 0]
    if len(measured) < len(rate) and len(measured):  # the same model: its peers' rate
        rate = np.where(rate > 0, rate, np.median(measured))
    return (loads.pending_due[rows] + prompt_tokens) * rate + step_s


def within_deadline(deadline_s: float, loads: LoadTable, prompt_tokens: int,
                    step_s: float = 0.0) -> LoadTable:
    """The healthy candidates of `loads` predicted to give the first token within
    `deadline_s` (the routing then chooses among them only)."""
    rows = loads.rows[loads.healthy[loads.rows]]
    return loads.select(rows[predicted_ttft_s(loads, prompt_tokens, step_s) <= deadline_s])


def refuse_late(deadline_s: float, pools: Sequence[LoadTable], prompt_tokens: int,
                retry_after_s: int, step_s: float = 0.0) -> OverloadedError:
    """The 429 (Retry-After) for a request no healthy worker of `pools` is predicted to give
    its first token within `deadline_s`."""
    best = min((float(np.min(p)) for p in (predicted_ttft_s(t, prompt_tokens, step_s)
                                           for t in pools) if len(p)), default=math.inf)
    return OverloadedError(
        f"the first token is predicted in {best * 1000:.0f} ms at best under the current load, "
        f"past the request's {TTFT_HEADER} of {deadline_s * 1000:.0f} ms; retry after "
        f"{retry_after_s} s", headers={"Retry-After": str(retry_after_s)})


__all__ = ["TTFT_HEADER", "predicted_ttft_s", "refuse_late", "ttft_deadline_s",
           "within_deadline"]


def pools_within(deadline_s: float, prefill: LoadTable, decode: LoadTable, prompt_tokens: int,
                 retry_after_s: int, counters: RouterCounters) -> tuple[LoadTable, LoadTable]:
    """The pools narrowed to the workers predicted to give the first token within
    `deadline_s` (the decode pool stays whole when none of it is, for the handoffs of the
    prefill workers that are); 429 before any work when none is (counted in `counters`). With
    no healthy worker at all, the pools as they are: the routing answers (503)."""
    fast_prefill = within_deadline(deadline_s, prefill, prompt_tokens)
    fast_decode = within_deadline(deadline_s, decode, prompt_tokens)
    if fast_prefill or fast_decode:
        return fast_prefill, fast_decode or decode
    if not any(p.healthy[p.rows].any() for p in (prefill, decode)):
        return prefill, decode
    counters.num_refused_deadline += 1
    raise refuse_late(deadline_s, (prefill, decode), prompt_tokens, retry_after_s)
