"""The sampler on hand-made logits: which tokens each option allows."""

from __future__ import annotations

import math

import pytest
import torch

from tests.workers.factories import EOS, create_request
from workers.engine.sampler import Sampler

PROBS = [0.5, 0.3, 0.2, 0.0]  # token 3 impossible


def logits_for(probs, rows=1):
    row = torch.tensor([math.log(p) if p > 0 else -1e9 for p in probs], dtype=torch.float32)
    return row.repeat(rows, 1)


def sampled_set(draws: int = 300, **params) -> set[int]:
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    reqs = [create_request(f"r{i}", [1, 2], **params) for i in range(draws)]
    return set(sampler(logits_for(PROBS, draws), reqs).token_ids)


def test_truncation_options_limit_the_candidates():
    assert sampled_set(temperature=1.0) == {0, 1, 2}
    assert sampled_set(temperature=1.0, top_k=2) == {0, 1}
    assert sampled_set(temperature=1.0, top_p=0.6) == {0, 1}
    assert sampled_set(temperature=1.0, top_p=0.5) == {0}
    assert sampled_set(temperature=1.0, min_p=0.5) == {0, 1}  # keeps p >= 0.25
    assert sampled_set(temperature=0.0) == {0}


def test_sampling_follows_the_distribution():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    n = 4000
    reqs = [create_request(f"r{i}", [1], temperature=1.0) for i in range(n)]
    tokens = sampler(logits_for(PROBS, n), reqs).token_ids
    for token, p in enumerate(PROBS):
        assert abs(tokens.count(token) / n - p) < 0.04


def test_repetition_and_frequency_penalties_push_seen_tokens_down():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    flat = torch.full((1, 4), 0.5)
    flat[0, 0] = 1.0  # token 0 wins greedily ...
    rep = create_request("a", [0, 1], temperature=0.0, repetition_penalty=4.0)
    assert sampler(flat.clone(), [rep]).token_ids[0] == 2  # ... unless seen (1.0 / 4 < 0.5)
    freq = create_request("b", [1], temperature=0.0, frequency_penalty=2.0)
    freq.append_output(0)
    assert sampler(flat.clone(), [freq]).token_ids[0] == 1  # 1.0 - 2.0 < 0.5


def test_min_tokens_forbids_eos_and_stop_ids_until_reached():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.zeros(1, 4)
    logits[0, EOS] = 5.0
    logits[0, 1] = 4.0
    req = create_request("a", [2], temperature=0.0, min_tokens=2, stop_token_ids=[1])
    assert sampler(logits.clone(), [req]).token_ids == [2]
    req.append_output(2)
    req.append_output(2)
    assert sampler(logits.clone(), [req]).token_ids == [EOS]


def test_logprobs_are_of_the_raw_distribution():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    req = create_request("a", [1], temperature=0.5, top_k=1, logprobs=2)
    out = sampler(logits_for(PROBS), [req])
    lp = out.logprobs[0]
    assert lp.token_id == 0 and abs(lp.logprob - math.log(0.5)) < 1e-5
    assert list(lp.top) == [0, 1] and abs(lp.top[1] - math.log(0.3)) < 1e-5


def test_seeds_are_64_bit_and_samples_of_n_derive_their_own():
    from workers.contract.protocol import InvalidRequestError, SamplingParams
    from workers.engine.sampler import position_seed, sample_seed

    for bad in (2**63, -2**63 - 1, 2**70):
        with pytest.raises(InvalidRequestError, match="seed"):
            SamplingParams(seed=bad)
    top = 2**63 - 1
    derived = [sample_seed(top, i) for i in range(4)]
    assert derived[0] == top and len(set(derived)) == 4
    assert all(-2**63 <= s < 2**63 for s in derived)  # each sample's params validate
    assert all(0 <= position_seed(s, p) < 2**64 for s in derived for p in (0, 1, 10**6))
    assert position_seed(7, 0) != position_seed(7, 1) != position_seed(8, 1)
