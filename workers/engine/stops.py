"""The stop conditions a request's newest token is checked against, one token at a time
(a speculative step's accepted tokens too): stop token ids and EOS after `min_tokens`,
`max_tokens`, and the context's end. Stop strings are the output processor's
(`workers.engine.output_processor`)."""

from __future__ import annotations

from collections.abc import Sequence

from workers.contract.protocol import FinishReason
from workers.engine.request import Request


def check_stop(req: Request, max_model_len: int) -> FinishReason | None:
    """Whether the request's newest token ends it (a stop token id is kept in
    `req.stop_reason`)."""
    params, num_output = req.params, len(req.output_token_ids)
    if num_output > params.min_tokens:
        token = req.output_token_ids[-1]
        if token in params.stop_token_ids:
            req.stop_reason = token
            return FinishReason.STOP
        if not params.ignore_eos and token in req.eos_token_ids:
            return FinishReason.STOP
    if num_output >= params.max_tokens or len(req.all_token_ids) >= max_model_len:
        return FinishReason.LENGTH
    return None


def append_checked(req: Request, tokens: Sequence[int],
                   max_model_len: int) -> tuple[int, FinishReason | None]:
    """Append `tokens` to the request's output one at a time, up to the first that ends it;
    (how many were appended, the reason it ends or None)."""
    for appended, token in enumerate(tokens, 1):
        req.append_output(token)
        reason = check_stop(req, max_model_len)
        if reason is not None:
            return appended, reason
    return len(tokens), None
