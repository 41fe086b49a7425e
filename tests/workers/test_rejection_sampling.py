"""The draft-with-probabilities acceptance rule: the tokens it produces follow the target's
distribution (a chi-square goodness-of-fit test at a fixed seed), and the same test rejects
deliberately wrong rules."""

from __future__ import annotations

import torch

from workers.engine.speculative.rejection import rejection_sample

TARGET = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.10, 0.05], dtype=torch.float64)
DRAFT = torch.tensor([0.05, 0.10, 0.10, 0.20, 0.25, 0.30], dtype=torch.float64)
N, K = 40000, 2


def p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of `tokens` to `probs`: the probability of a worse fit."""
    counts = torch.bincount(tokens, minlength=len(probs)).to(torch.float64)
    expected = probs * len(tokens)
    chi2 = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor((len(probs) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, chi2 / 2))


def speculate(rule_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts drawn from DRAFT, verified against TARGET with `rule_q` as the draft's claimed
    probabilities; (first tokens, second tokens where the first draft was accepted)."""
    gen = torch.Generator().manual_seed(1234)
    drafts = torch.multinomial(DRAFT.expand(N * K, -1), 1, generator=gen).view(N, K)
    out = rejection_sample(drafts, rule_q.expand(N, K, -1), TARGET.expand(N, K + 1, -1), gen)
    return out.tokens[:, 0], out.tokens[out.num_accepted >= 1, 1]


def test_accepted_and_resampled_tokens_follow_the_target_distribution():
    first, second = speculate(DRAFT)
    assert p_value(first, TARGET) > 1e-3
    assert p_value(second, TARGET) > 1e-3
    assert 0 < len(second) < N  # some drafts accepted, some rejected


def test_the_same_test_rejects_wrong_rules():
    # accepting every draft (the draft's probabilities taken as zero): tokens follow the draft
    first, _ = speculate(torch.zeros_like(DRAFT))
    assert p_value(first, TARGET) < 1e-6
    # accepting with probability p(d) alone and redrawing from p: a mix of both distributions
    first, _ = speculate(torch.ones_like(DRAFT))
    assert p_value(first, TARGET) < 1e-6


def test_greedy_rows_accept_exactly_the_targets_argmax():
    target = torch.zeros(1, 3, 4, dtype=torch.float64)
    target[0, 0, 2] = target[0, 1, 1] = target[0, 2, 3] = 1.0  # one-hot: greedy
    draft = torch.zeros(1, 2, 4, dtype=torch.float64)
    draft[0, 0, 2] = draft[0, 1, 0] = 1.0
    out = rejection_sample(torch.tensor([[2, 0]]), draft, target)
    assert out.num_accepted.tolist() == [1] and out.tokens[0, :2].tolist() == [2, 1]
