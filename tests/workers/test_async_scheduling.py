"""Async scheduling (`workers.engine.async_step`): the same tokens and events as the synchronous engine,
no block leaked, and step N+1 planned and launched before step N's tokens are waited for."""

from __future__ import annotations

import dataclasses

import pytest

from workers.engine.config import EngineConfig
from workers.engine.core import Engine
from workers.contract.protocol import SamplingParams, WorkerRequest
from workers.engine.runner import ModelRunner
from workers.contract.structured_output import StructuredOutput

BASE = dict(num_blocks=64, block_size=16, max_num_batched_tokens=64, max_num_seqs=8)


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def _run(model: str, script: list, async_scheduling: bool, **options) -> tuple[dict, Engine]:
    """Drive an engine through `script`: (call number, "add", request id, prompt ids, params)
    and (call number, "abort", request id, tokens seen first). Returns each sample's events
    (as tuples, in order), by request id and index, and the engine (the samples of an n > 1
    request may interleave differently: its siblings join after sample 0's first token)."""
    config = EngineConfig(model=model, async_scheduling=async_scheduling, **{**BASE, **options})
    engine = Engine(config)
    events: dict[str, list] = {}
    seen: dict[str, int] = {}
    pending = list(script)
    call = 0
    while pending or engine.has_unfinished():
        for item in [i for i in pending if i[0] <= call]:
            if item[1] == "add":
                engine.generate(WorkerRequest(item[2], tuple(item[3]), item[4]))
                pending.remove(item)
            elif seen.get(item[2], 0) >= item[3]:  # abort once that many tokens came out
                engine.abort(item[2])
                pending.remove(item)
        for e in engine.step():
            events.setdefault((e.request_id, e.index), []).append(dataclasses.astuple(e))
            seen[e.request_id] = seen.get(e.request_id, 0) + len(e.token_ids)
        call += 1
        assert call < 500, "the engine did not finish"
    return events, engine


def _assert_no_block_leaked(engine: Engine) -> None:
    pool = engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not engine.scheduler.placeholders


def _compare(model: str, script: list, **options) -> tuple[dict, Engine]:
    sync, sync_engine = _run(model, script, False, **options)
    events, engine = _run(model, script, True, **options)
    assert events == sync
    _assert_no_block_leaked(sync_engine)
    _assert_no_block_leaked(engine)
    return events, engine


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 250 + 3 for i in range(n)]


def _stop_token(model: str, prompt: list[int], at: int) -> int:
    """The token a greedy run of `prompt` samples at output position `at` (a stop token that
    ends it there, unknown to the scheduler in advance)."""
    events, _ = _run(model, [(0, "add", "x", prompt, _greedy(at + 1, ignore_eos=True))], False)
    return [t for e in events["x", 0] for t in e[2]][at]


def test_mixed_batch_gives_the_synchronous_events(tiny_model):
    shared = _prompt(1, 40)  # two full blocks shared: prefix-cache hits for the later ones
    stop_at = _stop_token(tiny_model, _prompt(4, 9), 3)
    script = [
        (0, "add", "short", _prompt(2, 5), _greedy(1, ignore_eos=True)),
        (0, "add", "long", shared + _prompt(3, 30), _greedy(17, ignore_eos=True)),
        (0, "add", "stop_token", _prompt(4, 9), _greedy(12, stop_token_ids=[stop_at])),
        (0, "add", "eos", _prompt(5, 7), _greedy(9)),
        (1, "add", "logprobs", _prompt(6, 20), _greedy(6, ignore_eos=True, logprobs=3,
                                                       prompt_logprobs=2)),
        (1, "add", "plp_once", _prompt(12, 10), _greedy(1, prompt_logprobs=1)),
        (2, "add", "hit", shared + _prompt(7, 3), _greedy(8, ignore_eos=True)),
        (3, "add", "aborted", _prompt(8, 12), _greedy(20, ignore_eos=True)),
        (3, "abort", "aborted", 3),
        (4, "add", "stop_str", _prompt(9, 6), _greedy(10, ignore_eos=True, stop=["e", "a"])),
        (5, "add", "two", _prompt(10, 8), SamplingParams(n=2, temperature=0.0, max_tokens=5,
                                                        ignore_eos=True)),
        (6, "add", "hit2", shared + _prompt(11, 20), _greedy(4, ignore_eos=True)),
    ]
    events, engine = _compare(tiny_model, script)
    assert engine.async_steps.num_overlapped > 0
    assert events["stop_token", 0][-1][6] == stop_at  # ended by the token, not max_tokens
    assert len(events["stop_token", 0]) == 4
    aborted = events["aborted", 0]
    assert 3 <= len(aborted) < 20 and aborted[-1][5] is None
    assert any(e[8] > 0 for e in events["hit", 0])  # the prefix cache served it
    assert ("two", 1) in events
    assert events["plp_once", 0][0][9][1] is not None  # prompt logprobs of a one-step request


def test_chunked_prefill_and_preemption_under_a_small_cache(tiny_model):
    script = [(i % 3, "add", f"r{i}", _prompt(20 + i, 20 + 9 * i), _greedy(24, ignore_eos=True))
              for i in range(6)]
    events, engine = _compare(tiny_model, script, num_blocks=14, max_num_batched_tokens=24)
    assert all(len(events[f"r{i}", 0]) == 24 for i in range(6))
    assert engine.scheduler.num_preemptions > 0
    assert engine.async_steps.num_overlapped > 0


def test_requests_that_need_host_tokens_fall_back_to_synchronous_steps(tiny_model):
    script = [
        (0, "add", "penalty", _prompt(30, 10), _greedy(8, ignore_eos=True,
                                                       repetition_penalty=1.3)),
        (0, "add", "seeded", _prompt(31, 10), SamplingParams(temperature=1.0, seed=5,
                                                            max_tokens=8, ignore_eos=True)),
        (0, "add", "min", _prompt(32, 10), _greedy(8, min_tokens=5)),
        (0, "add", "regex", _prompt(34, 6), _greedy(10, structured=StructuredOutput(
            "regex", "[0-9]{4}"))),
    ]
    _, engine = _compare(tiny_model, script)
    assert engine.async_steps.num_overlapped == 0  # every step had such a request in flight
    # once they finish, the plain ones overlap again
    script.append((0, "add", "plain", _prompt(33, 4), _greedy(20, ignore_eos=True)))
    _, engine = _compare(tiny_model, script)
    assert engine.async_steps.num_overlapped > 0


def test_next_step_is_launched_before_the_previous_tokens_are_waited_for(tiny_model,
                                                                          monkeypatch):
    log: list[tuple[str, int]] = []
    alive: list[object] = []  # every step kept, so no id is reused by a later step
    launch, collect = ModelRunner.launch, ModelRunner.collect

    def logged_launch(self, out, prev):
        alive.append(out)
        log.append(("launch", id(out)))
        return launch(self, out, prev)

    def logged_collect(launched):
        log.append(("wait", id(launched.out)))
        return collect(launched)

    monkeypatch.setattr(ModelRunner, "launch", logged_launch)
    monkeypatch.setattr(ModelRunner, "collect", staticmethod(logged_collect))
    script = [(0, "add", f"r{i}", _prompt(40 + i, 6), _greedy(6, ignore_eos=True))
              for i in range(3)]
    _run(tiny_model, script, True)
    launched = [k for op, k in log if op == "launch"]
    # every step but the first is launched before the step before it is waited for
    for prev, nxt in zip(launched, launched[1:-1]):
        assert log.index(("launch", nxt)) < log.index(("wait", prev))
    assert [k for op, k in log if op == "wait"] == launched  # each waited for once, in order


def test_drain_returns_the_in_flight_events_from_the_next_step(tiny_model):
    engine = Engine(EngineConfig(model=tiny_model, async_scheduling=True, **BASE))
    engine.generate(WorkerRequest("r", tuple(_prompt(50, 8)), _greedy(3, ignore_eos=True)))
    assert engine.step() == []  # the first step is in flight
    engine.async_steps.drain()
    assert engine.has_unfinished()
    tokens = []
    while engine.has_unfinished():
        tokens += [t for e in engine.step() for t in e.token_ids]
    assert len(tokens) == 3
    _assert_no_block_leaked(engine)


def test_async_scheduling_needs_one_rank():
    with pytest.raises(ValueError, match="world_size=2"):
        EngineConfig(model="m", async_scheduling=True, tensor_parallel_size=2)
