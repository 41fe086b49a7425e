"""The engine as a user of `LLM` and `Engine` sees it: sampling options, stops, errors, aborts."""

from __future__ import annotations

import pytest

from tests.workers.factories import hand_off, replay_events
from workers import LLM, FinishReason, InvalidRequestError, SamplingParams
from workers.contract.protocol import WorkerRequest
from workers.engine.request import Continuation
from workers.serving.connector import Connector

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, num_blocks=256)


def greedy(llm, prompt=PROMPT, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 24),
                            ignore_eos=True, **kw)
    return llm.generate([prompt], params)[0].outputs[0]


def assert_all_blocks_free(llm) -> None:
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_seed_gives_the_same_tokens_whatever_else_is_in_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPT], seeded)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(["other text", PROMPT, "more"], [noise, seeded, noise])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate([PROMPT], other_seed)[0].outputs[0].token_ids != alone


def test_n_samples_share_the_prompt_blocks(tiny_model):
    llm = LLM(tiny_model, num_blocks=256)
    prompt = list(range(3, 43))  # 40 tokens: two full blocks of 16
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    engine = llm.engine
    engine.generate(WorkerRequest("r", tuple(prompt), params))
    cached = {}
    while engine.has_unfinished():
        engine.step()
        for sid in ("r/1", "r/2"):
            if sid in engine.scheduler.requests:
                cached[sid] = engine.scheduler.requests[sid].num_cached_tokens
    assert cached == {"r/1": 32, "r/2": 32}
    out = llm.generate([prompt], params)[0]
    assert [s.index for s in out.outputs] == [0, 1, 2]
    assert all(len(s.token_ids) == 8 for s in out.outputs)
    assert len({tuple(s.token_ids) for s in out.outputs}) > 1


def test_stop_string_ends_the_text_before_it(llm):
    full = greedy(llm)
    stop = full.text[6:9]
    cut = full.text.index(stop)
    out = greedy(llm, stop=[stop])
    assert out.text == full.text[:cut]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop
    kept = greedy(llm, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == full.text[:cut + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    tokens = greedy(llm).token_ids
    stop_id = tokens[4]
    out = greedy(llm, stop_token_ids=[stop_id])
    assert out.token_ids == tokens[:tokens.index(stop_id) + 1]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop_id
    late = greedy(llm, stop_token_ids=[tokens[0]], min_tokens=3)
    assert len(late.token_ids) >= 3


def test_max_tokens_ends_with_length(llm):
    out = greedy(llm, max_tokens=5)
    assert len(out.token_ids) == 5 and out.finish_reason is FinishReason.LENGTH


def test_top_k_one_is_greedy_and_logprobs_rank_alternatives(llm):
    want = greedy(llm).token_ids
    sampled = llm.generate([PROMPT], SamplingParams(temperature=0.8, top_k=1, max_tokens=24,
                                                    ignore_eos=True))[0].outputs[0]
    assert sampled.token_ids == want
    out = greedy(llm, logprobs=3)
    for lp in out.logprobs:
        assert len(lp.top) == 3
        assert lp.logprob == pytest.approx(max(lp.top.values()))


def test_penalties_and_top_p_min_p_change_nothing_when_neutral(llm):
    want = greedy(llm).token_ids
    neutral = greedy(llm, repetition_penalty=1.0, presence_penalty=0.0, top_p=1.0, min_p=0.0)
    assert neutral.token_ids == want
    penalised = greedy(llm, repetition_penalty=2.0, frequency_penalty=1.5)
    assert len(penalised.token_ids) == 24  # runs and stays well-formed


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("n", 0), ("max_tokens", 0),
    ("top_k", -3), ("min_p", 2.0), ("logprobs", 50), ("repetition_penalty", 0.0),
])
def test_invalid_sampling_parameter_names_the_field(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field
    assert field in str(err.value) and str(value) in str(err.value)


def test_prompt_longer_than_the_context_is_refused_and_nothing_is_held(tiny_model):
    llm = LLM(tiny_model, num_blocks=256, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
        llm.generate([list(range(1, 80))], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([[1, 2, 10**6]], SamplingParams())
    assert err.value.param == "prompt"
    assert not llm.engine.has_unfinished()
    assert_all_blocks_free(llm)


def test_abort_at_any_moment_frees_the_blocks(tiny_model):
    llm = LLM(tiny_model, num_blocks=64, max_num_batched_tokens=16, enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    engine.generate(WorkerRequest("a", tuple(range(1, 50)), params))
    engine.generate(WorkerRequest("b", tuple(range(1, 20)), params))
    engine.step()  # "a" is mid-prefill (49 tokens, budget 16)
    assert engine.abort("a")
    for _ in range(3):
        engine.step()
    assert engine.abort("b") and not engine.abort("b")
    assert not engine.has_unfinished()
    assert_all_blocks_free(llm)


def test_kv_events_track_the_prefix_cache(tiny_model):
    llm = LLM(tiny_model, num_blocks=8)  # small: later prompts evict earlier blocks
    for i in range(6):
        llm.generate([[i + 1] * 40], SamplingParams(max_tokens=2))
    events = llm.engine.drain_kv_events()
    assert [e.seq for e in events] == list(range(len(events)))
    assert replay_events(events) == set(llm.engine.kv.pool.cached_hashes())
    assert any(type(e).__name__ == "BlockRemoved" for e in events)
    assert LLM(tiny_model, num_blocks=8).engine.kv.events.epoch != events[0].epoch


def test_kv_handed_off_to_another_engine_continues_identically(tiny_model):
    prompt = list(range(5, 45))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    source = LLM(tiny_model, num_blocks=64)
    want = source.generate([prompt], params)[0].outputs[0].token_ids

    decode = LLM(tiny_model, num_blocks=64).engine
    assert hand_off(source.engine, decode, WorkerRequest("x", tuple(prompt), params)) == want


@pytest.mark.parametrize("dtype,kv_dtype", [("bfloat16", "auto"), ("float16", "auto"),
                                            ("float32", "bfloat16")])
def test_half_precision_weights_and_kv_cache(tiny_model, dtype, kv_dtype):
    llm = LLM(tiny_model, dtype=dtype, kv_cache_dtype=kv_dtype, num_blocks=64)
    import torch

    assert llm.engine.kv_caches[0].dtype == getattr(torch, dtype if kv_dtype == "auto" else kv_dtype)
    out = greedy(llm, max_tokens=8)
    assert len(out.token_ids) == 8


def test_chat_uses_the_models_template(llm):
    messages = [{"role": "user", "content": "hi"}]
    want = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    out = llm.chat(messages, SamplingParams(max_tokens=3))
    assert out.prompt_token_ids == want and len(out.outputs[0].token_ids) <= 3


def test_request_larger_than_the_whole_cache_is_refused(tiny_model):
    llm = LLM(tiny_model, num_blocks=4, block_size=16)  # 64 tokens in all
    with pytest.raises(InvalidRequestError, match="need 5 KV blocks; the cache has only 4"):
        llm.generate([list(range(1, 40))], SamplingParams(max_tokens=30))
    assert_all_blocks_free(llm)


def test_resumed_request_recomputes_the_sent_tokens_and_continues_identically(tiny_model):
    prompt = list(range(5, 45))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(tiny_model, num_blocks=64)
    want = llm.generate([prompt], params)[0].outputs[0]
    engine = llm.engine
    Connector(engine).resume(WorkerRequest("y", tuple(prompt), params),
                             [Continuation(0, want.token_ids[:3])])
    tokens, text = [], ""
    while engine.has_unfinished():
        for event in engine.step():
            tokens += event.token_ids
            text += event.text
    assert tokens == want.token_ids[3:]
    assert want.text.endswith(text) and text
    assert_all_blocks_free(llm)
