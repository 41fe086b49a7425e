"""The logit adjustments before sampling: stop tokens masked until min_tokens, then the
repetition, presence and frequency penalties, then logit_bias (vLLM's order).

Each request's penalty state lives on the device and grows with its tokens: a `seen` mask over
the vocabulary (every prompt and output token, for the repetition penalty) and `counts` of its
output tokens (presence and frequency). A step uploads only the tokens added since the last
step (and a request's bias and stop ids once), for every request in one asynchronous
`host_transfer.upload`; nothing is read back. The state is keyed weakly by the `Request`, so it
goes with it; a request's token lists are taken to grow only by appending (a shorter list
starts the state afresh).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from workers.kernels.host_transfer import upload
from workers.engine.request import Request


def adjusted(req: Request) -> bool:
    """True when the request's logits change before sampling (penalties, or stop tokens
    masked until min_tokens)."""
    p = req.params
    return (req.num_output_tokens < p.min_tokens or p.repetition_penalty != 1.0
            or bool(p.logit_bias)
            or (bool(p.presence_penalty or p.frequency_penalty) and bool(req.output_token_ids)))


@dataclass
class _State:
    vocab: int
    seen: torch.Tensor | None = None  # [V] bool: ids in all_token_ids (clamped to V - 1)
    num_seen: int = 0
    counts: torch.Tensor | None = None  # [V] logits' dtype: output ids (clamped) counted
    num_counted: int = 0
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids [B] int64, values [B])
    banned: torch.Tensor | None = None  # [S] int64: stop ids masked until min_tokens


class LogitAdjuster:
    """Applies each request's adjustments to its row of a step's logits, in place."""

    def __init__(self) -> None:
        self._states: weakref.WeakKeyDictionary[Request, _State] = weakref.WeakKeyDictionary()

    def apply(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """logits: [len(reqs), V] float, modified in place (rows of requests that are not
        `adjusted` are left alone)."""
        vocab, device = logits.shape[1], logits.device
        ints: list[int] = []
        floats: list[float] = []
        plan = []
        for row, req in enumerate(reqs):
            if adjusted(req):
                state = self._state(req, vocab)
                plan.append((row, req, state, self._stage(req, state, vocab, ints, floats)))
        if not plan:
            return
        staged = upload(ints, device)
        values = upload(floats, device, torch.float64).to(logits.dtype) if floats else None
        for row, req, state, spans in plan:
            self._update(state, spans, staged, values, logits)
            _adjust_row(logits, row, req, state)

    def _state(self, req: Request, vocab: int) -> _State:
        state = self._states.get(req)
        if (state is None or state.vocab != vocab or state.num_seen > len(req.all_token_ids)
                or state.num_counted > len(req.output_token_ids)):
            state = self._states[req] = _State(vocab)
        return state

    @staticmethod
    def _stage(req: Request, state: _State, vocab: int, ints: list[int],
               floats: list[float]) -> dict[str, tuple[int, int]]:
        """Appends what `state` lacks to `ints`/`floats`; returns name -> (start, length)."""
        p = req.params
        spans: dict[str, tuple[int, int]] = {}

        def add(name: str, new: list[int]) -> None:
            spans[name] = (len(ints), len(new))
            ints.extend(new)

        if state.banned is None and req.num_output_tokens < p.min_tokens:
            add("banned", [t for t in (*req.eos_token_ids, *p.stop_token_ids) if t < vocab])
        if p.repetition_penalty != 1.0:
            add("seen", req.all_token_ids[state.num_seen:])
            state.num_seen = len(req.all_token_ids)
        if p.presence_penalty or p.frequency_penalty:
            add("counted", req.output_token_ids[state.num_counted:])
            state.num_counted = len(req.output_token_ids)
        if p.logit_bias and state.bias is None:  # ids were checked against the vocabulary
            spans["bias_values"] = (len(floats), len(p.logit_bias))
            floats.extend(p.logit_bias.values())
            add("bias", list(p.logit_bias))
        return spans

    @staticmethod
    def _update(state: _State, spans: dict[str, tuple[int, int]], staged: torch.Tensor,
                values: torch.Tensor | None, logits: torch.Tensor) -> None:
        vocab = state.vocab
        part = {name: staged.narrow(0, start, n) for name, (start, n) in spans.items()
                if name != "bias_values"}
        if "banned" in part:
            state.banned = part["banned"]
        if "seen" in part:
            if state.seen is None:
                state.seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            state.seen.index_fill_(0, part["seen"].clamp(max=vocab - 1), True)
        if "counted" in part:
            if state.counts is None:
                state.counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
            new = part["counted"].clamp(max=vocab - 1)
            state.counts.index_put_((new,), torch.ones_like(new, dtype=logits.dtype),
                                    accumulate=True)
        if "bias" in part and values is not None:
            start, n = spans["bias_values"]
            state.bias = (part["bias"], values.narrow(0, start, n))


def _adjust_row(logits: torch.Tensor, row: int, req: Request, state: _State) -> None:
    p = req.params
    # a grammar decides where a constrained request may end
    if (req.num_output_tokens < p.min_tokens and req.grammar is None
            and state.banned is not None and state.banned.numel()):
        logits[row].index_fill_(0, state.banned, float("-inf"))
    if p.repetition_penalty != 1.0 and state.seen is not None:
        vals = logits[row]
        logits[row] = torch.where(state.seen, torch.where(vals > 0, vals / p.repetition_penalty,
                                                          vals * p.repetition_penalty), vals)
    if ((p.presence_penalty or p.frequency_penalty) and req.output_token_ids
            and state.counts is not None):
        counts = state.counts
        logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    if p.logit_bias and state.bias is not None:
        ids, values = state.bias
        logits[row, ids] += values
