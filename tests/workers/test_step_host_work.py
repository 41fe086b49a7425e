"""The per-step fast paths (issue 17) give the same results as the slow ones they skip."""

from __future__ import annotations

import torch

from tests.workers.factories import create_request, create_scheduler, fake_step
from workers.engine.sampler import Sampler


def test_greedy_picks_the_first_of_tied_maxima_as_torch_argmax_does():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, float("nan"), 5.0,
                                                                         float("nan")]])
    reqs = [create_request(str(i), [1, 2], temperature=0.0) for i in range(3)]
    assert Sampler(0, torch.device("cpu"))(logits, reqs).token_ids == logits.argmax(-1).tolist()


def test_sampling_leaves_the_callers_logits_alone():
    logits = torch.randn(2, 16)
    before = logits.clone()
    reqs = [create_request("plain", [1, 2], temperature=0.0),
            create_request("penalised", [1, 2], temperature=0.0, repetition_penalty=2.0,
                           min_tokens=2)]
    Sampler(0, torch.device("cpu"))(logits, reqs)
    assert torch.equal(logits, before)


def test_a_decoding_request_hands_every_step_the_same_block_table_until_it_grows():
    scheduler = create_scheduler(num_blocks=8, block_size=4)
    scheduler.add(create_request("r", [1, 2, 3], max_tokens=8, ignore_eos=True))
    tables = [fake_step(scheduler).chunks[0].block_ids for _ in range(6)]
    # positions 0-2 (prefill), then 3, 4, 5, 6, 7: a second block from position 4
    assert [len(t) for t in tables] == [1, 1, 2, 2, 2, 2]
    assert tables[0] is tables[1] and tables[2] is tables[5]
    assert list(tables[5]) == scheduler.kv.block_ids("r")
