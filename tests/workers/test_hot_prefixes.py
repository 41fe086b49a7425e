"""What a worker's cache is worth lately, and its hottest prefixes: what a scale-down removes
last and what a leaving worker hands to the others."""

from __future__ import annotations

import pytest

from tests.workers.factories import create_request, create_scheduler, fake_step
from workers.engine.kv_cache.hot_prefixes import HotPrefixes
from workers.engine.llm import LLM
from workers.contract.protocol import SamplingParams
from workers.contract.prefix_cache import hash_prompt_blocks
from workers.serving.connector import Connector


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _tracker(**kw) -> tuple[HotPrefixes, Clock]:
    clock = Clock()
    return HotPrefixes(clock=clock, **kw), clock


def test_worth_is_the_hit_blocks_halved_every_half_life():
    hot, clock = _tracker(half_life_s=10.0)
    hot.record((1, 2, 3, 4), tuple(range(16)))
    hot.record((1, 2, 3, 4), tuple(range(16)))
    assert hot.recent_hit_blocks() == pytest.approx(8.0)
    clock.now = 10.0
    assert hot.recent_hit_blocks() == pytest.approx(4.0)
    hot.record((1, 2), tuple(range(8)))
    clock.now = 20.0
    assert hot.recent_hit_blocks() == pytest.approx(3.0)  # (4 + 2) halved


def test_the_hottest_cached_prefixes_come_first_within_the_budget():
    hot, clock = _tracker(half_life_s=10.0)
    for _ in range(3):
        hot.record((1, 2), (10, 11))  # 3 hits x 2 blocks = 6
    hot.record((5, 6, 7), (50, 60, 70))  # 3
    hot.record((8,), (80,))  # 1, then evicted from the device pool
    cached = {1, 2, 5, 6, 7}.__contains__
    top = hot.top(10, cached)
    assert [p.block_hashes for p in top] == [(1, 2), (5, 6, 7)]
    assert top[0].token_ids == (10, 11) and top[0].worth == pytest.approx(6.0)
    assert [p.block_hashes for p in hot.top(4, cached)] == [(1, 2)]  # (5, 6, 7) does not fit
    assert hot.top(0, cached) == []


def test_a_prefix_that_a_chosen_one_extends_is_not_sent_twice():
    hot, _ = _tracker()
    for _ in range(2):
        hot.record((1, 2, 3), (1, 2, 3))
    hot.record((1,), (1,))  # a shorter hit on the same chain
    hot.record((1, 2, 3, 4), (1, 2, 3, 4))
    top = hot.top(100, lambda h: True)
    assert [p.block_hashes for p in top] == [(1, 2, 3, 4)]  # it brings (1, 2, 3) and (1,)


def test_the_least_worth_is_forgotten_when_full():
    hot, clock = _tracker(capacity=2)
    hot.record((1,), (1,))
    hot.record((1,), (1,))
    hot.record((2,), (2,))
    hot.record((3,), (3,))  # (2,) is worth least: forgotten
    assert {p.block_hashes for p in hot.top(10, lambda h: True)} == {(1,), (3,)}


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="half_life_s"):
        HotPrefixes(half_life_s=0.0)


def test_the_scheduler_records_each_prefix_hit_with_its_tokens():
    scheduler = create_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(1, 11))  # two full blocks, then two tokens
    for rid in ("a", "b"):
        scheduler.add(create_request(rid, prompt, max_tokens=1))
        while scheduler.has_unfinished():
            fake_step(scheduler)
    top = scheduler.kv.hot.top(16, lambda h: scheduler.kv.pool.lookup(h) is not None)
    assert len(top) == 1
    assert top[0].block_hashes == tuple(hash_prompt_blocks(prompt, 4))
    assert top[0].token_ids == tuple(prompt[:8]) and top[0].worth == pytest.approx(2.0, rel=0.01)


def test_an_engine_reports_its_hit_worth_and_hands_out_its_hot_prefix(tiny_model):
    llm = LLM(tiny_model, num_blocks=64)
    shared = [7 + i % 50 for i in range(48)]  # three blocks of 16
    params = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate([shared + [3]], params)
    engine = llm.engine
    assert engine.stats().recent_hit_blocks == 0.0
    llm.generate([shared + [4], shared + [5]], params)
    assert engine.stats().recent_hit_blocks == pytest.approx(6.0, rel=0.01)
    connector = Connector(engine)
    (prefix,) = connector.hot_prefixes(64)
    assert prefix.block_hashes == tuple(hash_prompt_blocks(shared, 16))
    assert prefix.token_ids == tuple(shared)
    assert connector.hot_prefixes(2) == []  # it does not fit
    engine.reset_prefix_cache()
    assert connector.hot_prefixes(64) == []
