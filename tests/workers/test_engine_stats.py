"""What `Engine.stats()` reports about a worker's load, as a router reading it would notice."""

from __future__ import annotations

import pytest

from workers import LLM, SamplingParams
from workers.contract.protocol import KVCacheFull, WorkerRequest
from workers.serving.connector import Connector

NUM_BLOCKS = 32
BLOCK_SIZE = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def engine(tiny_model):
    return LLM(tiny_model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
               max_num_batched_tokens=32).engine


@pytest.fixture
def connector(engine):
    return Connector(engine)


def handed_off(request_id: str, num_tokens: int = 40) -> WorkerRequest:
    return WorkerRequest(request_id, tuple(range(3, 3 + num_tokens)), PARAMS)


def test_a_handed_off_request_waits_for_its_kv_until_it_lands(engine, connector):
    blocks = connector.decode_from_handoff(handed_off("h"), first_token_id=7)
    stats = engine.stats()
    assert (stats.num_waiting_for_kv, stats.num_waiting, stats.num_running) == (1, 0, 0)
    assert stats.num_free_blocks == NUM_BLOCKS - len(blocks) == NUM_BLOCKS - 3
    assert stats.num_pending_prompt_tokens == 0  # its prompt is computed elsewhere
    assert not engine.has_unfinished()  # nothing to step until the KV is here
    assert engine.step() == []

    connector.kv_landed("h")
    stats = engine.stats()
    assert (stats.num_waiting_for_kv, stats.num_running) == (0, 1)
    assert engine.has_unfinished()
    with pytest.raises(KeyError, match="not waiting for remote KV"):
        connector.kv_landed("h")


def test_abort_while_waiting_for_kv_frees_its_blocks(engine, connector):
    connector.decode_from_handoff(handed_off("h"), first_token_id=7)
    assert engine.abort("h")
    stats = engine.stats()
    assert stats.num_waiting_for_kv == 0 and stats.num_free_blocks == NUM_BLOCKS
    with pytest.raises(KeyError):
        connector.kv_landed("h")


def test_a_handoff_the_cache_cannot_hold_is_refused_and_leaves_nothing(engine, connector):
    connector.decode_from_handoff(handed_off("big", 16 * 30), first_token_id=7)
    with pytest.raises(KVCacheFull):
        connector.decode_from_handoff(handed_off("h", 16 * 3), first_token_id=7)
    assert engine.stats().num_waiting_for_kv == 1
    assert not engine.abort("h")


def test_pending_prompt_tokens_count_queued_and_half_prefilled_prompts(engine):
    engine.generate(WorkerRequest("long", tuple(range(3, 83)), PARAMS))  # 80 tokens
    engine.generate(WorkerRequest("short", tuple(range(100, 120)), PARAMS))  # 20 tokens
    assert engine.stats().num_pending_prompt_tokens == 100
    engine.step()  # a 32-token budget: "long" is a third of the way through its prompt
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.num_pending_prompt_tokens == 100 - 32
    engine.abort("short")
    assert engine.stats().num_pending_prompt_tokens == 80 - 32
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert (stats.num_pending_prompt_tokens, stats.num_running, stats.num_waiting) == (0, 0, 0)
