"""Sampling on a worker group's last rank picks exactly the tokens the driver's sampler would.

In one process first: the driver's `SamplingSync` and the rank's `RankSampler` against a plain
`Sampler` over the same logits, step after step, with requests joining, finishing and coming
back under their id (every option: greedy, seeds, top-k/top-p/min-p, penalties, logit bias,
min_tokens, logprobs, a grammar). Then real TP=2 rank processes against the single-process
engine and against the same group sampling on the driver, and the bytes a reply carries.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from tests.schemas import random_schema
from workers import LLM, SamplingParams
from workers.engine.grammar import Grammars
from workers.engine.parallel.messages import SamplingRecord, SamplingRequest, StepMessage
from workers.engine.parallel.sampling import RankSampler, SamplingSync
from workers.engine.request import Request
from workers.engine.sampler import Sampler
from workers.contract.structured_output import StructuredOutput
from workers.tokenizer import Tokenizer

EOS = frozenset({2})
SCHEMA = StructuredOutput.json_schema(random_schema(3))
OPTIONS = [
    dict(temperature=0.0, logprobs=3),
    dict(temperature=0.8, top_p=0.9, top_k=20, seed=11),
    dict(temperature=1.0, min_p=0.05, seed=-5, logprobs=0),
    dict(temperature=0.0, repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.7,
         logit_bias={5: 3.0, 9: -50.0}, min_tokens=4),
    dict(temperature=0.7, seed=3, repetition_penalty=0.8, frequency_penalty=-1.0),
    dict(temperature=1.0),  # unseeded: the sampler's own generator, seeded alike
]


def make_request(rid: str, options: dict, output: tuple[int, ...] = ()) -> Request:
    req = Request(rid, [4, 5, 6, 4], SamplingParams(max_tokens=64, **options), EOS)
    for token in output:
        req.append_output(token)
    return req


def test_the_rank_mirrors_sample_what_the_driver_would_step_after_step(tiny_model):
    torch.manual_seed(0)
    grammars = Grammars(Tokenizer.from_pretrained(tiny_model), 512, EOS)
    vocab = 512
    here, there = Sampler(7, torch.device("cpu")), RankSampler(7, torch.device("cpu"))
    sync = SamplingSync(vocab)
    reqs = [make_request(f"r{i}", o) for i, o in enumerate(OPTIONS)]
    reqs.append(make_request("resumed", OPTIONS[1], output=(8, 9, 10)))  # sent tokens
    constrained = make_request("json", dict(temperature=0.0, structured=SCHEMA))
    constrained.grammar = grammars.matcher(SCHEMA)
    reqs.append(constrained)
    for step in range(12):
        if step == 4:  # r0 finishes; r1 is replaced by a new sample under the same id
            reqs[0].status = reqs[0].status.FINISHED
            reqs[1] = make_request("r1", OPTIONS[2])
        if step == 8:
            reqs[2].status = reqs[2].status.FINISHED
        live = [r for r in reqs if not r.is_finished]
        sampling = live[step % 2:] + live[:step % 2]  # rows in a different order each step
        logits = torch.randn(len(sampling), vocab) * 3
        record = sync.record(sampling)
        gained = tuple((r.output_token_ids[-1],) for r in sampling if r.output_token_ids)
        record = pickle.loads(pickle.dumps(record))  # what crosses the process boundary
        expected = here(logits, sampling)
        got = there(logits, record)
        assert list(got.token_ids) == expected.token_ids, f"step {step}"
        assert list(got.logprobs) == expected.logprobs, f"step {step}"
        for req, token in zip(sampling, got.token_ids):
            req.append_output(token)
            if req.grammar is not None:
                assert req.grammar.accept_token(token)
        if step == 0:  # every request's parameters once, its sent tokens with it
            assert [n.request_id for n in record.new] == [r.request_id for r in sampling]
            assert next(n for n in record.new if n.request_id == "resumed").output_token_ids \
                == (8, 9, 10)
        elif step not in (4, 8):  # then only the token each gained
            assert record.new == () and record.appended == gained
    assert set(there.mirrors) == {r.request_id for r in reqs if not r.is_finished}
    assert sync.num_mirrored == len(there.mirrors)


def test_only_a_repetition_penalty_sends_the_prompt_and_a_schema_stays_on_the_driver():
    sync = SamplingSync(512)
    plain, penalised = make_request("a", {}), make_request("b", dict(repetition_penalty=1.2))
    record = sync.record([plain, penalised])
    assert [n.prompt_token_ids for n in record.new] == [(), (4, 5, 6, 4)]
    spec = SamplingParams(structured=SCHEMA)
    assert sync.record([Request("c", [1], spec, EOS)]).new[0].params.structured is None


def test_a_rank_refuses_a_record_that_does_not_match_its_mirrors():
    there = RankSampler(0, torch.device("cpu"))
    with pytest.raises(ValueError, match="request 'ghost', which this rank has no mirror of"):
        there(torch.zeros(1, 8), SamplingRecord(("ghost",), ((),)))
    new = SamplingRequest("j", SamplingParams(), EOS, (), (), constrained=True)
    with pytest.raises(ValueError, match="'j' came without its grammar mask"):
        there(torch.zeros(1, 8), SamplingRecord(("j",), ((),), (new,)))
    plain = SamplingRequest("k", SamplingParams(), EOS, (), (), constrained=False)
    with pytest.raises(ValueError, match="2 logit rows for 1 sampling rows"):
        there(torch.zeros(2, 8), SamplingRecord(("k",), ((),), (plain,)))


# ---- real rank processes ------------------------------------------------------------------------

PROMPTS = ["the quick brown fox", "hello there", "a b c d e f g", "numbers: 1 2 3", "why",
           "one more", "list three colours"]
PARAMS = [SamplingParams(max_tokens=12, ignore_eos=True, **o) for o in OPTIONS[:5]] + [
    SamplingParams(n=2, temperature=1.0, seed=21, max_tokens=8, ignore_eos=True,
                   prompt_logprobs=2, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=120, structured=SCHEMA)]


@pytest.fixture(scope="module")
def engines(tiny_model):
    single = LLM(tiny_model, num_blocks=128)
    group = LLM(tiny_model, num_blocks=128, tensor_parallel_size=2)
    yield single, group
    group.engine.close()


def outputs(llm: LLM) -> list[tuple]:
    return [(s.token_ids, s.logprobs, o.prompt_logprobs, s.finish_reason)
            for o in llm.generate(PROMPTS, PARAMS) for s in o.outputs]


def close(a: list, b: list) -> bool:
    """Logprob lists equal within fp32 tolerance (TP=2 sums its partial products in another
    order)."""
    flat_a = [(lp.token_id, lp.logprob, sorted(lp.top)) for lp in a if lp is not None]
    flat_b = [(lp.token_id, lp.logprob, sorted(lp.top)) for lp in b if lp is not None]
    return len(a) == len(b) and all(
        x[0] == y[0] and x[2] == y[2] and abs(x[1] - y[1]) < 1e-4
        for x, y in zip(flat_a, flat_b))


def test_a_tp2_group_sampling_on_its_last_rank_matches_one_process_and_driver_sampling(engines):
    single, group = engines
    assert group.engine.runner.sync is not None  # a group samples on its rank
    on_rank, alone = outputs(group), outputs(single)
    assert [o[0] for o in on_rank] == [o[0] for o in alone]
    for (_, lps, prompt_lps, reason), (_, ref_lps, ref_prompt, ref_reason) in zip(on_rank, alone):
        assert reason == ref_reason
        assert (lps is None) == (ref_lps is None) and (lps is None or close(lps, ref_lps))
        assert (prompt_lps is None) == (ref_prompt is None)
        if prompt_lps is not None:
            assert close(prompt_lps[1:], ref_prompt[1:]) and prompt_lps[0] is None
    structured = on_rank[-1]
    assert structured[3].value == "stop" and len(structured[0]) > 3
    assert any(o[2] is not None for o in on_rank)  # prompt logprobs were asked and came back
    runner = group.engine.runner
    sync, runner.sync = runner.sync, None  # the same group, its logits sampled here
    try:
        assert outputs(group) == on_rank  # exactly: tokens, logprobs, prompt logprobs
    finally:
        runner.sync = sync


def test_a_decode_step_replies_with_token_ids_not_logits(engines):
    """8 decodes: the reply carries 8 token ids (a few hundred bytes pickled, the step's
    timing included), where the logits would be 8 x vocab float32."""
    _, group = engines
    vocab = group.engine.model_config.vocab_size
    block = group.engine.config.block_size
    n = 8
    msg = StepMessage(step_id=10_000, input_ids=tuple(range(3, 3 + n)), positions=(0,) * n,
                      slot_mapping=tuple(i * block for i in range(n)),
                      query_start_loc=tuple(range(n + 1)), seq_lens=(1,) * n,
                      block_tables=tuple((i,) for i in range(n)), num_decodes=n,
                      logit_rows=tuple(range(n)))
    rank_group = group.engine.runner.executor.group
    group.engine.reset_prefix_cache()  # no cached prefix points at the blocks written here
    last = rank_group.step(msg)[0]  # TP=2, one stage: rank 0 answers
    assert last.logits is not None and last.logits.shape == (n, vocab)
    logits_bytes = len(pickle.dumps(last))
    new = tuple(SamplingRequest(f"bytes-{i}", SamplingParams(temperature=0.0), EOS, (), (),
                                False) for i in range(n))
    record = SamplingRecord(tuple(r.request_id for r in new), ((),) * n, new)
    sampled = rank_group.step(dataclasses.replace(msg, step_id=10_001, sampling=record))[0]
    assert sampled.logits is None
    assert list(sampled.sampled.token_ids) == last.logits.argmax(-1).tolist()
    tokens_bytes = len(pickle.dumps(sampled))
    assert logits_bytes > n * vocab * 4 and tokens_bytes < 1024, (logits_bytes, tokens_bytes)
    # the next decode step of the same requests sends each one's new token, not its params
    steady = SamplingRecord(record.rows, tuple((t,) for t in sampled.sampled.token_ids))
    assert len(pickle.dumps(steady)) < 400
    print(f"reply bytes for {n} decodes: logits {logits_bytes}, tokens {tokens_bytes}; "
          f"steady record {len(pickle.dumps(steady))}")
