"""The draft-with-probabilities acceptance rule: the tokens it produces follow the target's
distribution (a chi-square goodness-of-fit test at a fixed seed), and the same test rejects
deliberately wrong rules; in the engine, a draft model's sampled drafts leave a sampled
request's tokens distributed as the target's."""

from __future__ import annotations

import json

import torch

from workers import LLM, SamplingParams
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



# ---- in the engine: sampled requests drafted by a draft model ---------------------------------

PROMPT = [5, 6, 7, 8, 9] * 2
TOP_K, SAMPLES = 4, 400
DRAFT_MODEL = json.dumps({"method": "draft_model", "num_speculative_tokens": 2,
                          "draft_num_layers": 1, "draft_length": "fixed",
                          "disable_by_batch_size": SAMPLES})


def target_joint(llm: LLM, depth: int) -> dict[tuple[int, ...], float]:
    """The target's probability of each sequence of its first `depth` tokens after PROMPT when
    sampling at temperature 1 among its top TOP_K (from its reported top logprobs)."""
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(depth):
        prefixes = list(joint)
        outs = llm.generate([PROMPT + list(p) for p in prefixes], SamplingParams(
            temperature=0.0, max_tokens=1, logprobs=TOP_K))
        joint_next = {}
        for prefix, out in zip(prefixes, outs):
            top = out.outputs[0].logprobs[0].top
            probs = torch.tensor(list(top.values()), dtype=torch.float64).softmax(0)
            for token, p in zip(top, probs.tolist()):
                joint_next[(*prefix, token)] = joint[prefix] * p
        joint = joint_next
    return joint


def pooled_p_value(samples: list[tuple[int, ...]], joint: dict[tuple[int, ...], float]) -> float:
    """`p_value` of `samples` against `joint`, the outcomes expected fewer than 5 times pooled
    into one (the chi-square approximation needs expected counts of 5 or more)."""
    big = [o for o in joint if joint[o] * len(samples) >= 5]
    index = {o: i for i, o in enumerate(big)}
    if any(s not in joint for s in samples):
        raise AssertionError("a sampled sequence the target gives no probability")
    probs = torch.tensor([joint[o] for o in big] + [1.0 - sum(joint[o] for o in big)],
                         dtype=torch.float64)
    return p_value(torch.tensor([index.get(s, len(big)) for s in samples]), probs)


def first_tokens(llm: LLM, depth: int) -> list[tuple[int, ...]]:
    """The first `depth` tokens of SAMPLES requests for PROMPT, seeds 0, 1, ..., batched."""
    outs = llm.generate([PROMPT] * SAMPLES, [SamplingParams(
        temperature=1.0, top_k=TOP_K, seed=seed, max_tokens=depth + 1, ignore_eos=True)
        for seed in range(SAMPLES)])
    return [tuple(o.outputs[0].token_ids[:depth]) for o in outs]


def test_a_draft_models_sampled_drafts_leave_the_targets_distribution(tiny_model, monkeypatch):
    """The first 3 tokens (the 2nd and 3rd drafted and verified in one step) of 400 seeded
    requests follow the target's distribution, and the same test fails on a wrong rule."""
    import workers.engine.sampler as sampler

    joint = target_joint(LLM(tiny_model, num_blocks=64), depth=3)
    spec = LLM(tiny_model, num_blocks=4 * SAMPLES, max_num_seqs=SAMPLES,
               max_num_batched_tokens=16 * SAMPLES, speculative_config=DRAFT_MODEL)
    assert pooled_p_value(first_tokens(spec, 3), joint) > 1e-3
    stats = spec.engine.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepted and rejected
    rule = sampler.rejection_sample  # a wrong rule: every drafted token accepted
    monkeypatch.setattr(sampler, "rejection_sample",
                        lambda d, q, p, g: rule(d, torch.zeros_like(q), p, g))
    assert pooled_p_value(first_tokens(spec, 3), joint) < 1e-6
