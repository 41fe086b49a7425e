"""Token sampling for one step: penalties, min_tokens, temperature, top-k/top-p/min-p, seeds.

A seeded request's randomness at each output position comes from (seed, position) alone
(`position_seed`), so a seed gives the same tokens whatever else shares the batch, and whichever
worker samples which position: aggregated, handed off after its first token, or migrated. Logprobs are of the model's raw
distribution (before penalties, logit_bias and temperature), as vLLM reports them by default;
for a structured-output request, of that distribution with the grammar's mask applied (tokens it
forbids are -inf, reported as -9999.0 as vLLM does, since JSON has no infinity).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.grammar import MaskBuffer
from workers.protocol import SamplingParams, TokenLogprob
from workers.request import Request


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


_U64 = (1 << 64) - 1
MIN_LOGPROB = -9999.0  # a masked token's logprob as reported


def position_seed(seed: int, position: int) -> int:
    """The generator seed of output position `position` of a request seeded `seed` (any
    int64): splitmix64 of the pair, in [0, 2**64)."""
    z = ((seed & _U64) + (position + 1) * 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of an n > 1 request seeded `seed` (sample 0 keeps it), in
    the int64 range a seed must be in."""
    if index == 0:
        return seed
    z = position_seed(seed, -2 - index)  # positions are >= 0: no overlap with those
    return z - (1 << 64) if z >= 1 << 63 else z


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> list[TokenLogprob]:
    """Chosen token's logprob plus the top `k` alternatives, per row. logprobs: [N, V]."""
    chosen_lp = logprobs.gather(1, chosen[:, None])[:, 0].tolist()  # sampled: never masked
    if k > 0:
        top_v, top_i = logprobs.topk(k, dim=-1)
        top_v = top_v.clamp(min=MIN_LOGPROB)
        tops = [dict(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
    else:
        tops = [{} for _ in chosen_lp]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(chosen.tolist(), chosen_lp, tops)]


def _greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax, the first index of each row's maximum. logits: [N, V] -> [N] int64.

    On the CPU numpy's vectorised argmax is about 5x faster than torch's (0.03 against 0.16 ms
    for 64 rows of 8192, 0.8 against 2.5 ms for 128k): it runs for every row, every step."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def _adjusted(req: Request) -> bool:
    """True when the request's logits change before sampling (penalties, or stop tokens
    masked until min_tokens)."""
    p = req.params
    return (req.num_output_tokens < p.min_tokens or p.repetition_penalty != 1.0
            or bool(p.logit_bias)
            or ((p.presence_penalty or p.frequency_penalty) and bool(req.output_token_ids)))


def _apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    vocab = logits.shape[1]
    for row, req in enumerate(reqs):
        p = req.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(req.all_token_ids, device=logits.device).clamp_(max=vocab - 1)
            vals = logits[row, seen]
            logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                            vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
            out = torch.tensor(req.output_token_ids, device=logits.device).clamp_(max=vocab - 1)
            counts = torch.bincount(out, minlength=vocab).to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if p.logit_bias:  # ids were checked against the vocabulary on arrival
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[row, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device,
                                             dtype=logits.dtype)


def _mask_stops_before_min_tokens(logits: torch.Tensor, reqs: list[Request]) -> None:
    vocab = logits.shape[1]
    for row, req in enumerate(reqs):
        # a grammar decides where a constrained request may end
        if req.num_output_tokens < req.params.min_tokens and req.grammar is None:
            banned = [t for t in (*req.eos_token_ids, *req.params.stop_token_ids) if t < vocab]
            logits[row, banned] = float("-inf")


def _truncate(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k, then top-p, then min-p, by masking with -inf. logits: [N, V], temperature applied."""
    device = logits.device
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k is not None for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        ks = torch.tensor([min(k or vocab, vocab) for k in top_k], device=device)
        ranks = torch.arange(vocab, device=device)[None, :]
        drop = ranks >= ks[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first never drops)
        before = probs.cumsum(dim=-1) - probs
        drop |= before >= torch.tensor(top_p, device=device)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = make_generator(seed, device)  # for requests without a seed
        self._seeded = torch.Generator(device=device)  # reseeded per seeded row and step
        self._masks = MaskBuffer()

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        # logits: [N, V] float32, one row per request that samples this step
        params = [r.params for r in reqs]
        constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if constrained:
            logits = logits.clone()
            self._masks.apply(logits, constrained, [reqs[i].grammar for i in constrained])
        k = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        raw_logprobs = logits.log_softmax(dim=-1) if k is not None else None
        if any(_adjusted(r) for r in reqs):  # else the logits are read as they are
            logits = logits if constrained else logits.clone()
            _mask_stops_before_min_tokens(logits, reqs)
            _apply_penalties(logits, reqs)

        tokens = _greedy_tokens(logits)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=self.device)
            temps = torch.tensor([params[i].temperature for i in random_rows], device=self.device)
            scaled = _truncate(logits[rows] / temps[:, None], [params[i] for i in random_rows])
            probs = scaled.softmax(dim=-1)
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            for j, i in enumerate(random_rows):
                seed = params[i].seed
                if seed is not None:
                    self._seeded.manual_seed(position_seed(seed, reqs[i].num_output_tokens))
                    noise[j].exponential_(generator=self._seeded)
            # Gumbel-max in exponential form: argmax p / E is a draw from p
            tokens[rows] = _greedy_tokens(probs / noise)

        logprobs: list[TokenLogprob | None] = [None] * len(reqs)
        if raw_logprobs is not None:
            computed = top_logprobs(raw_logprobs, tokens, k)
            logprobs = [lp if p.logprobs is not None else None for lp, p in zip(computed, params)]
            logprobs = [None if lp is None else TokenLogprob(lp.token_id, lp.logprob, dict(
                list(lp.top.items())[:p.logprobs])) for lp, p in zip(logprobs, params)]
        return SamplerOutput(tokens.tolist(), logprobs)
