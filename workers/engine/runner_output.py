"""What a step's run gives the engine (`RunnerOutput`), and how a step's sampled rows become each
request's new tokens (`record_sampled`): one row a request, or k + 1 rows a verifying one."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.contract.protocol import TokenLogprob
from workers.engine.request import Request
from workers.engine.sampler import SamplerOutput
from workers.engine.speculative.verify import row_spans


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> next token
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # a verifying request's id -> the drafted tokens accepted before its `sampled` token
    accepted: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # request id -> (index of the first prompt token covered, logprobs of consecutive tokens)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)

    def new_logprobs(self, request_id: str) -> list[TokenLogprob]:
        """The logprobs of a request's new tokens this step, in order ([] without)."""
        last = self.logprobs.get(request_id)
        return [*self.accepted_logprobs.get(request_id, ()), *(() if last is None else (last,))]


def record_sampled(result: RunnerOutput, sampling: list[Request], sampled: SamplerOutput,
                   drafts: dict[int, tuple[int, ...]] | None = None) -> None:
    """Each request's new tokens from its rows into `result`. `drafts`: a verifying request's
    first row -> its draft (its k + 1 rows follow); None or empty: one row a request."""
    tokens, logprobs = sampled.token_ids, sampled.logprobs
    if len(tokens) != len(sampling):
        raise RuntimeError(f"{len(tokens)} tokens sampled for {len(sampling)} rows")
    if not drafts:  # no verification this step: row i is request i's (no span bookkeeping)
        for req, token, lp in zip(sampling, tokens, logprobs):
            result.sampled[req.request_id] = token
            if lp is not None:
                result.logprobs[req.request_id] = lp
        return
    for rid, first, m, num_drafted in row_spans(sampling, drafts, tokens, sampled.num_accepted):
        result.sampled[rid] = tokens[first + m]
        lp = logprobs[first + m]
        if lp is not None:
            result.logprobs[rid] = lp
        if num_drafted:
            result.accepted[rid] = tokens[first:first + m]
            if lp is not None:
                result.accepted_logprobs[rid] = [x for x in logprobs[first:first + m]
                                                 if x is not None]
