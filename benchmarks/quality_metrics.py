"""What `quality.py` measures, given next-token distributions: a capture of the engine's prompt
rows (every position's full distribution, as the engine computed it for prompt logprobs) and the
summaries of a variant against the reference.

The KL divergence KL(reference || variant) is taken over the reference's top `k` tokens plus one
bucket for the rest of the vocabulary (the distributions coarse-grained the same way): a lower
bound of the full KL that the tail's mass (`reference_tail_mass`, reported) bounds the gap of.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch


@dataclass
class Rows:
    """Per prediction position p (predicting token p + 1) of one passage: the argmax, the top-1
    minus top-2 log-probability margin, and (the reference) the top-k ids and log-probabilities
    or (a variant) its log-probabilities at the reference's top-k ids."""

    top1: torch.Tensor  # [P - 1] int64
    margin: torch.Tensor  # [P - 1] float32
    top_ids: torch.Tensor | None  # [P - 1, k] int64: the reference only
    top_logprobs: torch.Tensor  # [P - 1, k] float32: at the reference's top-k ids

    @staticmethod
    def empty(num_tokens: int, k: int, reference: bool) -> Rows:
        n = num_tokens - 1
        return Rows(torch.zeros(n, dtype=torch.int64), torch.zeros(n),
                    torch.zeros(n, k, dtype=torch.int64) if reference else None,
                    torch.zeros(n, k))

    def fill(self, first: int, logprobs: torch.Tensor, ref_ids: torch.Tensor | None) -> None:
        """Rows first.. from `logprobs` [count, vocab] (log-softmaxed, fp32)."""
        count = logprobs.shape[0]
        top2 = logprobs.topk(2, dim=-1)
        self.top1[first:first + count] = top2.indices[:, 0]
        self.margin[first:first + count] = top2.values[:, 0] - top2.values[:, 1]
        if ref_ids is None:  # the reference: its own top k
            if self.top_ids is None:
                raise ValueError("only the reference's rows hold their own top-k ids")
            top = logprobs.topk(self.top_logprobs.shape[1], dim=-1)
            self.top_ids[first:first + count] = top.indices
            self.top_logprobs[first:first + count] = top.values
        else:
            self.top_logprobs[first:first + count] = logprobs.gather(
                1, ref_ids[first:first + count])


def rows_of(logits: torch.Tensor, k: int, ref: Rows | None) -> Rows:
    """The rows of a whole passage's logits [P, vocab] (the last row predicts nothing)."""
    rows = Rows.empty(logits.shape[0], k, ref is None)
    rows.fill(0, logits[:-1].float().log_softmax(-1), None if ref is None else ref.top_ids)
    return rows


def capture_prompt_rows(llm: Any, passages: list[list[int]], k: int,
                        reference: list[Rows] | None) -> list[Rows]:
    """Has `llm`'s engine record, for each passage's prompt rows it computes (its requests with
    prompt logprobs), the `Rows` of the full distribution; returns them, filled as the engine
    runs. Requests are matched to passages by their prompt token ids."""
    index = {tuple(ids): i for i, ids in enumerate(passages)}
    captured = [Rows.empty(len(ids), k, reference is None) for ids in passages]
    runner = llm.engine.runner
    original: Callable[..., None] = runner._prompt_logprobs

    def prompt_logprobs(result: Any, batch: Any, logits: torch.Tensor) -> None:
        original(result, batch, logits)
        row = len(batch.sampling)  # the sampling rows come first
        for chunk, _, count in batch.prompt_rows:
            i = index[tuple(chunk.request.prompt_token_ids)]
            logprobs = logits[row:row + count].float().log_softmax(-1)
            captured[i].fill(chunk.start, logprobs,
                             None if reference is None else reference[i].top_ids)
            row += count

    runner._prompt_logprobs = prompt_logprobs
    return captured


def coarse_kl(ref: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """KL(ref || var) per row over the k tracked tokens plus one bucket for the rest. ref, var:
    [N, k] log-probabilities at the same (the reference's top-k) ids."""
    p, q = ref.double().exp(), var.double().exp()
    p_tail = (1 - p.sum(-1)).clamp(min=1e-12)
    q_tail = (1 - q.sum(-1)).clamp(min=1e-12)
    return (p * (ref.double() - var.double())).sum(-1) + p_tail * (p_tail.log() - q_tail.log())


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def teacher_forced(ref: list[Rows], var: list[Rows], first: int, near_tie: float) -> dict:
    """A variant's next-token distributions against the reference's at the same prefixes, over
    prediction positions `first`..: top-1 agreement, the reference's margins where the argmax
    differs (below `near_tie`: a near-tie), and the mean KL."""
    top1_ref = torch.cat([r.top1[first:] for r in ref])
    top1_var = torch.cat([v.top1[first:] for v in var])
    margins = torch.cat([r.margin[first:] for r in ref])
    kl = coarse_kl(torch.cat([r.top_logprobs[first:] for r in ref]),
                   torch.cat([v.top_logprobs[first:] for v in var]))
    differ = top1_ref != top1_var
    at_diff = margins[differ]
    return {
        "positions": int(top1_ref.numel()),
        "top1_agreement": float(1 - differ.float().mean()),
        "top1_differences": int(differ.sum()),
        "near_tie_differences": int((at_diff < near_tie).sum()),
        "reference_margin_at_differences": _quantiles(at_diff),
        "mean_kl": float(kl.mean()),
        "p99_kl": float(kl.quantile(0.99)) if kl.numel() else 0.0,
        "max_kl": float(kl.max()) if kl.numel() else 0.0,
    }


def reference_tail_mass(ref: list[Rows], first: int) -> float:
    """The reference's mean probability outside its tracked top k (the KL's coarse bucket)."""
    lp = torch.cat([r.top_logprobs[first:] for r in ref]).double()
    return float((1 - lp.exp().sum(-1)).mean())


@dataclass(frozen=True)
class Greedy:
    """One greedy continuation: its tokens and, per step, the top-1 minus top-2 margin."""

    tokens: list[int]
    margins: list[float]


def greedy(ref: list[Greedy], var: list[Greedy], near_tie: float) -> dict:
    """How many continuations are identical; for the others, the first differing step and the
    reference's margin there (the same prefix up to it): below `near_tie`, a near-tie."""
    first_diff, margins, own = [], [], []
    for r, v in zip(ref, var):
        step = next((i for i, (a, b) in enumerate(zip(r.tokens, v.tokens)) if a != b), None)
        if step is None:
            continue
        first_diff.append(step)
        margins.append(round(r.margins[step], 4))
        own.append(round(v.margins[step], 4))
    return {
        "prompts": len(ref),
        "identical": len(ref) - len(first_diff),
        "first_differing_steps": first_diff,
        "reference_margin_at_first_difference": margins,
        "variant_margin_at_first_difference": own,
        "near_tie_first_differences": sum(m < near_tie for m in margins),
    }


def _quantiles(x: torch.Tensor) -> dict:
    if not x.numel():
        return {}
    q = x.float().quantile(torch.tensor([0.0, 0.5, 0.9, 1.0]))
    return {name: round(float(v), 4) for name, v in zip(("min", "median", "p90", "max"), q)}
