"""How long a request's draft is: the length that yields the most tokens per second of steps,
from the request's measured acceptance and the server's measured cost of a drafted token.

A step verifying a draft of L tokens costs about 1 + c L one-row steps, c the cost of one
drafted token (its verification row, and drafting it where a model drafts) relative to a step
without a draft. With p the chance that a drafted token is accepted once the ones before it
were, it yields 1 + p + p^2 + ... + p^L tokens on average. `best_length` picks the L in 0..k
with the most tokens per cost; 0 (p too low for what a row costs) and the request decodes one
token a step for `PAUSE_STEPS` steps, then tries again from the prior. So drafting backs off
where it does not pay, per request, and drafts long where the text is predictable and rows are
cheap (a GPU's verification rows, nearly free) but short where they are not (this 2-core CPU's:
a 5-row step 1.45-1.85x a one-row step).

p is each request's where a model drafts: a moving average of the share of the drafted tokens
its drafts reached that were accepted (a rejection ends a draft: the tokens after it were
never judged). An n-gram draft's p is that of the server's drafts copied after a match as long
as its own (`MatchAcceptance`): a draft after a long match is accepted far more often than one
after two tokens (SmolLM2 repeating code: 0.5 after 2 tokens, 0.8 after 3, 0.9 after 4 and
more), which a request's average blurs.

c is the server's (`StepClock`): the time from one step's drafting to the next's is that whole
step (drafting, the forward, sampling, the host's work on the outputs). Over the steps where one
request runs alone, decoding, a line fitted to those times against the step's rows (1 + L) gives
a one-row step's time and a drafted token's, by moving moments, so the fit follows the machine's
load. Until the steps' widths have varied enough to fit, c is `PRIOR_TOKEN_COST`.
"""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter

from workers.engine.request import Request, RequestStatus

PRIOR_ACCEPTANCE = 0.6  # a request's p before its first verified draft, and after a pause
ACCEPTANCE_WEIGHT = 0.5  # of a verified draft in a request's p
PRIOR_TOKEN_COST = 0.15  # c until measured (between a GPU's ~0.02 and this CPU's 0.1-0.2)
COST_WEIGHT = 0.05  # of a step in the fit's moving moments
MIN_STEPS = 8  # steps the fit needs before it counts
MIN_WIDTH_VARIANCE = 0.25  # (rows^2) the steps' widths must spread by for a slope
# the fit's least: a drafted token is never free (at 0, any acceptance would draft the most)
MIN_TOKEN_COST = 0.02
PAUSE_STEPS = 2
MATCH_DECAY = 0.99  # of a match length's counts at each draft from such a match verified


def reached(accepted: int, drafted: int) -> int:
    """The drafted tokens a verification judged: the accepted ones and the first rejected one
    (a rejection ends a draft: the tokens after it were never judged)."""
    return accepted + (accepted < drafted)


def best_length(acceptance: float, token_cost: float, k: int) -> int:
    """The draft length in 0..k with the most expected tokens per step cost (ties: shorter)."""
    best_rate, length = 1.0, 0
    expected, term = 1.0, 1.0
    for n in range(1, k + 1):
        term *= acceptance
        expected += term
        rate = expected / (1.0 + token_cost * n)
        if rate > best_rate:
            best_rate, length = rate, n
    return length


def decoding(req: Request) -> bool:
    """Whether `req` runs a decode step next (its prompt computed, one token to compute)."""
    return (req.status is RequestStatus.RUNNING
            and req.num_computed_tokens == req.num_tokens - 1)


class StepClock:
    """The cost of a drafted token relative to a one-row step, measured from the steps of a lone
    decoding request (see the module docstring). `lap` at the start of each step's drafting,
    `mark` once its drafts are set."""

    def __init__(self) -> None:
        self.steps = 0  # steps fitted
        # moving E[w], E[t], E[w^2], E[w t] of the steps' widths w and seconds t
        self.moments = [0.0, 0.0, 0.0, 0.0]
        self._last: tuple[str, int, float] | None = None  # (request, width, start)
        self._start = 0.0

    def lap(self, running: Sequence[Request]) -> None:
        """A step begins: the one before it counts if the same lone request decoded in both."""
        now = self._start = perf_counter()
        last, self._last = self._last, None
        if last is None or len(running) != 1 or running[0].request_id != last[0]:
            return
        if decoding(running[0]):
            self._add(last[1], now - last[2])

    def mark(self, running: Sequence[Request]) -> None:
        """This step's drafts are set: remember its width if one request runs alone, decoding."""
        if len(running) == 1 and decoding(running[0]):
            req = running[0]
            self._last = (req.request_id, 1 + len(req.draft_token_ids), self._start)

    def _add(self, width: int, seconds: float) -> None:
        sample = (width, seconds, width * width, width * seconds)
        weight = 1.0 / (self.steps + 1) if self.steps < 1 / COST_WEIGHT else COST_WEIGHT
        self.moments = [m + weight * (x - m) for m, x in zip(self.moments, sample)]
        self.steps += 1

    def fit(self) -> tuple[float, float] | None:
        """(a one-row step's seconds, the seconds a drafted token adds) as fitted; None until
        the steps' widths have spread enough, or where the line's one-row step is not positive."""
        mean_w, mean_t, mean_ww, mean_wt = self.moments
        variance = mean_ww - mean_w * mean_w
        if self.steps < MIN_STEPS or variance < MIN_WIDTH_VARIANCE:
            return None
        slope = (mean_wt - mean_w * mean_t) / variance
        one_row = mean_t - slope * (mean_w - 1.0)
        return (one_row, slope) if one_row > 0.0 else None

    @property
    def token_cost(self) -> float:
        """c: a drafted token's seconds over a one-row step's, fitted (`fit`); the prior until
        then, and whatever the fit gives clamped to [`MIN_TOKEN_COST`, 4]."""
        fitted = self.fit()
        if fitted is None:
            return PRIOR_TOKEN_COST
        one_row, slope = fitted
        return min(max(slope / one_row, MIN_TOKEN_COST), 4.0)


class MatchAcceptance:
    """p by the length of the match an n-gram draft was copied after: of the drafted tokens that
    the server's drafts from matches of that length reached, the share accepted; each length's
    counts decay by `MATCH_DECAY` a draft, so they follow the text being served. Unseen
    lengths start from the prior; the p of a length whose drafts do not pay (none drafted) moves
    1 - `MATCH_DECAY` of its way back to the prior at each draft not made, so it is tried again
    (at c = 0.2, some 20 skips from p = 0.1) rather than never measured again."""

    def __init__(self) -> None:
        self.counts: dict[int, tuple[float, float]] = {}  # match length -> (accepted, reached)

    def acceptance(self, match: int) -> float:
        accepted, reached = self.counts.get(match, (PRIOR_ACCEPTANCE, 1.0))
        return accepted / reached

    def record(self, match: int, accepted: int, drafted: int) -> None:
        """A draft of `drafted` tokens copied after a `match`-token match had `accepted`."""
        a, r = self.counts.get(match, (PRIOR_ACCEPTANCE, 1.0))
        self.counts[match] = (MATCH_DECAY * a + accepted,
                              MATCH_DECAY * r + reached(accepted, drafted))

    def length(self, match: int, token_cost: float, k: int) -> int:
        """`best_length` at the acceptance of drafts after `match`-token matches; 0 (the draft
        not made) moves that acceptance back towards the prior (`skip`)."""
        length = best_length(self.acceptance(match), token_cost, k)
        if not length:
            self.skip(match)
        return length

    def skip(self, match: int) -> None:
        """A draft after a `match`-token match was not made (it did not pay)."""
        a, r = self.counts.get(match, (PRIOR_ACCEPTANCE, 1.0))
        self.counts[match] = (a + (1 - MATCH_DECAY) * (PRIOR_ACCEPTANCE * r - a), r)
