"""Speculative decoding: the scheduler's drafts and blocks, and outputs identical to decoding
without speculation (greedy and seeded, every sampling option, mixed batches, chunked prefill,
preemption, a KV handoff) with n-gram drafts on every family and the real model, and with a
truncated copy of the target as the draft."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from tests.workers.factories import create_request, create_scheduler, hand_off
from workers import LLM, SamplingParams
from workers.contract.protocol import WorkerRequest
from workers.engine.speculative.config import parse_speculative_config
from workers.engine.speculative.drafter import NgramDrafter
from workers.models.kit_archs import KIT_ARCHS

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                    "prompt_lookup_min": 1, "draft_length": "fixed",
                    "disable_by_batch_size": 8})
# token-id prompts with repeats (n-gram drafts find matches from the first step)
PROMPTS = [[5, 6, 7, 8, 9] * 4, list(range(10, 60)), [40, 41, 42, 40, 41, 42, 40, 41],
           [3, 4] * 9]


def pair(model: str, **options: object) -> tuple[LLM, LLM]:
    """Two engines of `model` with `options`: without speculation, and with n-gram drafts."""
    return LLM(model, **options), LLM(model, speculative_config=NGRAM, **options)


def texts(outputs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
             o.outputs[0].stop_reason) for o in outputs]


# ---- the pieces -------------------------------------------------------------------------------

def test_ngram_copies_what_followed_the_latest_match_of_the_longest_suffix():
    drafter = NgramDrafter(min_n=1, max_n=3)
    assert drafter.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]
    assert drafter.propose([1, 2, 3, 9, 1, 2, 3], 4) == [9, 1, 2, 3]
    assert drafter.propose([5, 6, 7], 3) == []  # no earlier occurrence
    assert NgramDrafter(min_n=2, max_n=2).propose([4, 1, 4, 2, 1], 3) == []  # "2 1" unseen
    assert drafter.lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == ([7, 8], 3, 7)  # its match


def _lookup_by_definition(tokens: list[int], k: int, min_n: int, max_n: int,
                          after: int | None = None):
    """The longest suffix of n in [min_n, max_n] tokens occurring earlier: its first occurrence
    continuing at `after` or later, else its latest."""
    if k < 1 or len(tokens) <= min_n:
        return [], 0, 0
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        starts = [i + n for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[-n:]]
        if starts:
            onward = [i for i in starts if after is not None and i >= after]
            start = onward[0] if onward else starts[-1]
            return tokens[start:start + k], n, start
    return [], 0, 0


def test_ngram_lookup_agrees_with_its_definition_on_random_histories():
    rng = random.Random(0)
    for _ in range(3000):
        alphabet = rng.randint(1, 4)  # few tokens: many matches of every length
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(0, 30))]
        min_n = rng.randint(1, 4)
        max_n, k = rng.randint(min_n, 8), rng.randint(0, 6)
        after = rng.choice([None, rng.randint(0, 31)])
        assert NgramDrafter(min_n, max_n).lookup(tokens, k, after) == _lookup_by_definition(
            tokens, k, min_n, max_n, after), (tokens, k, min_n, max_n, after)


def test_ngram_drafts_follow_the_source_a_request_is_copying():
    """A request copying a source that says "def" twice, having edited one token, meets "def"
    again: its draft is the source's second body, onward of where its copy had reached, where
    the latest "def" (its own first one) would draft the first body over again."""
    from workers.engine.speculative.speculator import MatchSpeculator

    config = parse_speculative_config(json.dumps({**json.loads(NGRAM), "draft_length": "fixed",
                                                  "num_speculative_tokens": 3}))
    source = [50, 1, 11, 12, 60, 1, 21, 22, 61]  # "def" = 1, then a body; twice
    speculator, req = MatchSpeculator(config, NgramDrafter(1, 4), 4096), _Decoding()
    req.all_token_ids = source + [50, 1]
    speculator.propose([req])
    assert req.draft_token_ids == [11, 12, 60]  # "50 def": the first body
    req.num_draft_tokens, req.num_accepted_tokens = 3, 2  # 11 12 accepted, 77 for 60
    req.all_token_ids = source + [50, 1, 11, 12, 77]
    speculator.propose([req])
    assert req.draft_token_ids == []  # 77 occurs nowhere earlier
    req.all_token_ids = source + [50, 1, 11, 12, 77, 1]
    speculator.propose([req])
    assert req.draft_token_ids == [21, 22, 61]  # from source position 5 on
    assert NgramDrafter(1, 4).propose(req.all_token_ids, 3) == [11, 12, 77]  # the latest


class _PriorClock:
    """A drafted token at the prior's cost, whatever the stub steps take."""

    token_cost = 0.15

    def lap(self, running):
        pass

    mark = lap


class _Decoding:
    """What `Speculator` reads of a decoding request (and its drafts' counters)."""

    def __init__(self) -> None:
        from workers.engine.request import RequestStatus

        self.status, self.hold_kv, self.grammar = RequestStatus.RUNNING, False, None
        self.params = SamplingParams(max_tokens=1000)
        self.num_tokens, self.num_computed_tokens, self.num_output_tokens = 20, 19, 10
        self.request_id = "r"
        self.all_token_ids = list(range(20))
        self.num_draft_tokens = self.num_accepted_tokens = 0
        self.draft_token_ids: list[int] = []


def test_a_draft_is_as_long_as_pays_for_its_acceptance_and_its_tokens_cost():
    """The length with the most expected tokens (1 + p + ... + p^L) per step cost (1 + c L)."""
    from workers.engine.speculative.draft_length import best_length

    assert best_length(0.95, 0.02, 8) == 8  # predictable text, nearly free rows: all
    assert best_length(0.6, 0.21, 8) == 2  # 1.6 / 1.21 < 1.96 / 1.42 > 2.176 / 1.63
    assert best_length(0.1, 0.2, 8) == 0  # one token's 0.1 does not pay its 0.2
    assert [best_length(0.8, c, 8) for c in (0.05, 0.1, 0.2, 0.4)] == sorted(
        (best_length(0.8, c, 8) for c in (0.05, 0.1, 0.2, 0.4)), reverse=True)
    assert best_length(1.0, 0.5, 3) == 3  # capped at what the request may draft


@pytest.mark.parametrize("draft_length", ["cost", "fixed"])
def test_a_request_drafts_long_while_accepted_and_pauses_while_rejected(draft_length):
    """Whole drafts accepted: the most; every draft rejected: drafting pauses, then is tried
    again. With "fixed", always the most."""
    from workers.engine.speculative.speculator import Speculator

    config = parse_speculative_config(json.dumps({
        "method": "ngram", "num_speculative_tokens": 6, "draft_length": draft_length}))
    asked: list[int] = []

    class Drafter:
        name = "stub"

        def propose(self, token_ids, k):
            asked.append(k)
            return [1] * k

    speculator, req = Speculator(config, Drafter(), 4096), _Decoding()
    speculator.clock = _PriorClock()
    lengths = []
    for accepted_all in [True] * 6 + [False] * 10:
        speculator.propose([req])
        drafted = len(req.draft_token_ids)
        lengths.append(drafted)
        req.num_draft_tokens += drafted
        req.num_accepted_tokens += drafted if accepted_all else 0
    if draft_length == "fixed":
        assert lengths == [6] * 16
        return
    assert lengths[0] < 6 and lengths[2:6] == [6] * 4  # from the prior, growing to the most
    rejected = lengths[6:]
    assert rejected[0] == 6 and 0 < rejected[1] < 6  # one rejection shortens the next draft
    assert 0 in rejected  # a run of rejections pauses drafting
    paused = rejected.index(0)
    assert rejected[paused + 1] == 0 and rejected[paused + 2] > 0  # for two steps, then again
    assert asked == [n for n in lengths if n]  # a paused request's drafter is not asked


def test_an_ngram_draft_is_as_long_as_its_matchs_measured_acceptance_pays():
    """Drafts copied after 6-token matches always accepted, after 2-token ones always rejected:
    once measured, a draft after a long match is drafted whole and one after a short match not
    at all, whatever the request's own average."""
    from workers.engine.speculative.speculator import MatchSpeculator

    config = parse_speculative_config(json.dumps({"method": "ngram",
                                                  "num_speculative_tokens": 8}))

    class Drafter:  # a long match on even calls, a short one on odd
        name, calls = "ngram", 0

        def lookup(self, token_ids, k, after=None):
            self.calls += 1
            return [1] * k, 6 if self.calls % 2 else 2, 0

    speculator, req = MatchSpeculator(config, Drafter(), 4096), _Decoding()
    speculator.clock = _PriorClock()
    lengths = []
    for step in range(40):
        speculator.propose([req])
        drafted = len(req.draft_token_ids)
        lengths.append(drafted)
        req.num_draft_tokens += drafted
        req.num_accepted_tokens += drafted if step % 2 == 0 else 0  # the long match's
    assert lengths[:2] == [2, 2]  # both from the prior
    assert lengths[-2:] == [8, 0]
    assert speculator.matches.acceptance(6) > 0.95 > 0.2 > speculator.matches.acceptance(2)
    for _ in range(200):  # short matches' drafts skipped: their p drifts back, to be tried again
        speculator.matches.skip(2)
    assert 0.45 < speculator.matches.acceptance(2) < 0.6


def test_the_clock_fits_a_drafted_tokens_cost_from_a_lone_requests_steps(monkeypatch):
    """Steps of 1 + L rows taking 10 ms + 2 ms L: a drafted token costs 0.2 of a one-row step;
    steps with another request running, or before the fit has seen widths spread, do not
    count (the prior)."""
    from workers.engine.speculative import draft_length

    now = [0.0]
    monkeypatch.setattr(draft_length, "perf_counter", lambda: now[0])
    clock, req, other = draft_length.StepClock(), _Decoding(), _Decoding()
    req.request_id, other.request_id = "a", "b"
    for step in range(40):
        width = 1 + step % 5
        req.draft_token_ids = [1] * (width - 1)
        clock.lap([req])
        clock.mark([req])
        now[0] += 0.010 + 0.002 * (width - 1)
        if step == 5:
            assert clock.token_cost == draft_length.PRIOR_TOKEN_COST  # too few steps yet
        if step % 7 == 3:  # a step beside another request: 5x as long, not counted
            clock.lap([req, other])
            clock.mark([req, other])
            now[0] += 0.050
    assert clock.token_cost == pytest.approx(0.2, rel=1e-6)


def test_speculative_config_names_what_is_wrong():
    assert parse_speculative_config(None) is None
    assert parse_speculative_config(NGRAM).num_speculative_tokens == 4
    for text, words in [('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
                        ('{"method": "ngram"}', "num_speculative_tokens"),
                        ('{"method": "ngram", "num_speculative_tokens": 0}', ">= 1"),
                        ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "'k'"),
                        ('{"method": "ngram", "num_speculative_tokens": 2, "draft_length": 1}',
                         "draft_length"),
                        ("ngram", "JSON object")]:
        with pytest.raises(ValueError, match=words):
            parse_speculative_config(text)


def test_a_draft_joins_a_decode_chunk_and_rejected_positions_blocks_are_returned():
    sched = create_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=16)
    req = create_request("a", [1, 2, 3, 4, 5, 6], max_tokens=10)
    sched.add(req)
    sched.update(sched.schedule(), {"a": 7})  # the prompt; 7 sampled
    req.draft_token_ids = [8, 9, 10, 11, 12]
    out = sched.schedule()
    (chunk,) = out.chunks
    assert (chunk.start, chunk.num_tokens, chunk.draft) == (6, 6, (8, 9, 10, 11, 12))
    assert len(sched.kv.block_ids("a")) == 3  # positions 6..11
    sched.update(out, {"a": 20}, {"a": [8]})  # 8 accepted, 9 rejected: 20 sampled there
    assert req.output_token_ids == [7, 8, 20]
    assert req.num_computed_tokens == 8  # 7 and 8: the rejected positions' KV is not counted
    assert len(sched.kv.block_ids("a")) == 3  # 9 tokens: the third block holds the last one
    assert (req.num_draft_tokens, req.num_accepted_tokens) == (5, 1)
    req.draft_token_ids = [1]
    out = sched.schedule()
    sched.update(out, {"a": 30}, {"a": []})
    assert req.num_computed_tokens == 9 and len(sched.kv.block_ids("a")) == 3
    # the prefix cache holds the blocks of accepted tokens only
    assert sched.kv.pool.num_cached_blocks == 2


def test_a_draft_is_dropped_rather_than_preempt_and_cut_to_the_budget():
    sched = create_scheduler(num_blocks=2, block_size=4, max_num_batched_tokens=16)
    a = create_request("a", [1, 2, 3, 4, 5, 6], max_tokens=10)
    sched.add(a)
    sched.update(sched.schedule(), {"a": 7})
    a.draft_token_ids = [8, 9, 10]  # needs a third block: none free
    (chunk,) = sched.schedule().chunks
    assert chunk.num_tokens == 1 and chunk.draft == () and sched.num_preemptions == 0
    tight = create_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=3)
    b = create_request("b", [1, 2], max_tokens=10)
    tight.add(b)
    tight.update(tight.schedule(), {"b": 7})
    b.draft_token_ids = [8, 9, 10, 11]
    (chunk,) = tight.schedule().chunks
    assert chunk.draft == (8, 9) and chunk.num_tokens == 3


def test_a_stop_token_among_accepted_tokens_ends_the_request_there():
    sched = create_scheduler(num_blocks=8, block_size=4)
    req = create_request("a", [1, 2, 3], max_tokens=10, stop_token_ids=[9])
    sched.add(req)
    sched.update(sched.schedule(), {"a": 7})
    req.draft_token_ids = [8, 9, 10]
    sched.update(sched.schedule(), {"a": 11}, {"a": [8, 9, 10]})
    assert req.output_token_ids == [7, 8, 9] and req.is_finished and req.stop_reason == 9
    assert sched.kv.pool.num_free_blocks == 8


# ---- exactness against decoding without speculation --------------------------------------------

# 24 blocks of 4 for 4 requests of up to 60 tokens: preemptions; 32-token steps: the 50-token
# prompt is prefilled in chunks beside the others' verifications
CRAMPED = dict(block_size=4, num_blocks=24, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """arch -> (its tiny checkpoint, its greedy outputs without speculation), made once."""
    from workers.models.make_model import make_model

    made: dict[str, tuple[str, list]] = {}

    def get(arch: str) -> tuple[str, list]:
        if arch not in made:
            model = str(make_model(tmp_path_factory.mktemp(arch), arch=arch, preset="tiny"))
            made[arch] = (model, [o.outputs[0].token_ids for o in LLM(model, **CRAMPED).generate(
                PROMPTS, [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
                          for _ in PROMPTS])])
        return made[arch]
    return get


def exact_with(model: str, want: list, config: str, speculative: list[bool]) -> LLM:
    """The engine of `model` with `config`, having checked its greedy outputs are `want`, that
    it verified drafts, preempted and gave every block back."""
    spec = LLM(model, speculative_config=config, **CRAMPED)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, speculative=s)
              for s in speculative]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params)] == want
    stats = spec.engine.stats()
    assert stats.num_accepted_tokens > 0, "no drafted token was accepted: nothing verified"
    assert spec.engine.scheduler.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_blocks
    return spec


@pytest.mark.parametrize("arch", KIT_ARCHS)  # every family
def test_greedy_is_identical_in_mixed_batches_with_chunked_prefill_and_preemption(arch, family):
    model, want = family(arch)
    exact_with(model, want, NGRAM, [i != 1 for i in range(len(PROMPTS))])


@pytest.mark.parametrize("arch", KIT_ARCHS)
def test_every_draft_model_is_exact_on_every_family(arch, family):
    """A truncated copy, the int4 self-draft, and the checkpoint drafting for itself from a
    cache of its own (its greedy drafts then all accepted: the cache is caught up right after
    every preemption), with their caches' shapes (MLA's latent, sliding windows, sinks)."""
    model, want = family(arch)
    options = {"num_speculative_tokens": 3, "draft_length": "fixed",
               "disable_by_batch_size": 8}
    for method in ({"method": "draft_model", "draft_num_layers": 1},
                   {"method": "quantized_self"}):
        exact_with(model, want, json.dumps({**method, **options}), [True] * len(PROMPTS))
    stats = exact_with(model, want, json.dumps({"method": "draft_model", "model": model,
                                                **options}), [True] * len(PROMPTS)).engine.stats()
    assert stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.fixture(scope="module")
def llama_pair(tiny_model) -> tuple[LLM, LLM]:
    return pair(tiny_model, num_blocks=256)


def test_every_sampling_option_behaves_as_without_speculation(llama_pair):
    base, spec = llama_pair
    plain = base.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=30,
                                                       ignore_eos=True))[0].outputs[0]
    stop_text = plain.text[len(plain.text) // 2:len(plain.text) // 2 + 3]
    eos = plain.token_ids[12]  # a token it emits: as EOS it ends it, after min_tokens
    cases = [dict(logprobs=3), dict(stop=[stop_text]), dict(stop_token_ids=[eos]),
             dict(stop_token_ids=[eos], min_tokens=20), dict(max_tokens=7),
             dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
             dict(logit_bias={plain.token_ids[3]: 5.0, plain.token_ids[5]: -100.0}),
             dict(stop=[stop_text], include_stop_str_in_output=True, logprobs=1)]
    params = [SamplingParams(**{"temperature": 0.0, "max_tokens": 30, "ignore_eos": True,
                                **case}) for case in cases]
    prompts = [PROMPTS[0]] * len(cases)
    want, got = base.generate(prompts, params), spec.generate(prompts, params)
    assert texts(got) == texts(want)
    for w, g in zip(want, got):
        wl, gl = w.outputs[0].logprobs, g.outputs[0].logprobs
        assert (wl is None) == (gl is None)
        for a, b in zip(wl or (), gl or ()):
            assert a.token_id == b.token_id and a.top.keys() == b.top.keys()
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert len(gl or g.outputs[0].token_ids) == len(g.outputs[0].token_ids)
    assert want[1].outputs[0].finish_reason.value == "stop"  # the stop string was met
    assert spec.engine.stats().num_accepted_tokens > 0


def test_seeded_sampling_is_reproducible_and_follows_the_same_positions(llama_pair):
    base, spec = llama_pair
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=40,
                            ignore_eos=True)
    first = spec.generate(PROMPTS, params)
    again = spec.generate(PROMPTS, params)
    assert texts(first) == texts(again)
    # a drafted token is accepted when the target samples it, with the seed of its output
    # position: the very tokens decoding one at a time samples
    assert texts(first) == texts(base.generate(PROMPTS, params))


DRAFT_MODEL = json.dumps({"method": "draft_model", "num_speculative_tokens": 3,
                          "draft_num_layers": 1, "draft_length": "fixed",
                          "disable_by_batch_size": 8})


def test_a_truncated_draft_model_is_exact_in_mixed_batches_with_preemption(tiny_model):
    base = LLM(tiny_model, block_size=4, num_blocks=24, max_num_batched_tokens=32)
    spec = LLM(tiny_model, block_size=4, num_blocks=24, max_num_batched_tokens=32,
               speculative_config=DRAFT_MODEL)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, seed=5, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                             repetition_penalty=1.2),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]
    want, got = base.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    greedy = [0, 2, 3]  # the sampled request drafts too: its text is the target's, not base's
    assert [texts(got)[i] for i in greedy] == [texts(want)[i] for i in greedy]
    assert len(got[1].outputs[0].token_ids) == 40
    stats = spec.engine.stats()
    assert stats.speculative_method == "draft_model" and stats.num_accepted_tokens > 0
    assert spec.engine.scheduler.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_blocks


def test_a_seeded_request_drafted_by_a_draft_model_is_reproducible(tiny_model):
    """Drafts drawn and verified with randomness from (seed, position): the same text on every
    run; another seed, another text."""
    spec = LLM(tiny_model, num_blocks=64, speculative_config=DRAFT_MODEL)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True)
    first = spec.generate(PROMPTS[:2], params)
    assert texts(spec.generate(PROMPTS[:2], params)) == texts(first)
    assert spec.engine.stats().num_accepted_tokens > 0
    other = spec.generate(PROMPTS[:2], dataclasses.replace(params, seed=12))
    assert texts(other) != texts(first)


GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
SEEDED_32 = SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=32, ignore_eos=True)


INT4_SELF = json.dumps({"method": "quantized_self", "num_speculative_tokens": 3,
                        "draft_length": "fixed", "disable_by_batch_size": 8})


@pytest.mark.parametrize("config,params", [(NGRAM, GREEDY_32), (DRAFT_MODEL, GREEDY_32),
                                           (DRAFT_MODEL, SEEDED_32), (INT4_SELF, GREEDY_32)],
                         ids=["ngram", "draft_model", "draft_model-seeded", "quantized_self"])
def test_a_request_handed_off_decodes_speculatively_on_the_decode_worker(tiny_model, config,
                                                                          params):
    """Greedy: the text without speculation; seeded: the text of the same speculation
    aggregated (its draws come from (seed, position), whichever worker makes them)."""
    prompt = PROMPTS[0] * 2
    want = LLM(tiny_model, num_blocks=64, speculative_config=None if params.greedy else config
               ).generate([prompt], params)[0].outputs[0].token_ids
    # the draft model's KV for the prompt is the target's first layers': it came with the pull;
    # a quantized self-draft's cache of its own is recomputed on the decode worker
    decode = LLM(tiny_model, num_blocks=64, speculative_config=config).engine
    prefill = LLM(tiny_model, num_blocks=64).engine
    assert hand_off(prefill, decode, WorkerRequest("x", tuple(prompt), params)) == want
    assert decode.stats().num_accepted_tokens > 0


def test_the_batch_size_back_off_stops_drafting(tiny_model):
    config = json.dumps({**json.loads(NGRAM), "disable_by_batch_size": 2})
    llm = LLM(tiny_model, num_blocks=256, speculative_config=config)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate(PROMPTS[:3], params)
    assert llm.engine.stats().num_draft_tokens == 0
    llm.generate(PROMPTS[:1], params)
    assert llm.engine.stats().num_draft_tokens > 0


def test_usage_counts_drafted_and_accepted_tokens_per_sample(llama_pair):
    _, spec = llama_pair
    events = []
    spec.engine.generate(WorkerRequest("u", tuple(PROMPTS[0]), SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True)))
    while spec.engine.has_unfinished():
        events += spec.engine.step()
    last = events[-1]
    assert last.finish_reason is not None
    assert 0 < last.num_accepted_tokens <= last.num_draft_tokens
    assert sum(len(e.token_ids) for e in events) == 24
    assert len(events) < 24  # several tokens an event: fewer steps than tokens


def test_the_real_model_greedy_is_identical(tmp_path_factory):
    from tests.workers.smollm2 import smollm2_gguf

    path = str(smollm2_gguf())
    options = dict(block_size=16, num_blocks=64, max_num_batched_tokens=64)
    # the default draft lengths (each request's, by its acceptance and the measured cost)
    base, spec = LLM(path, **options), LLM(path, speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "disable_by_batch_size": 8}), **options)
    tok = base.tokenizer
    text = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    prompts = [tok.encode(f"Repeat this code exactly:\n{text}\nHere it is:\n"),
               tok.encode("The capital of France is"), tok.encode("List the numbers 1 to 20:")]
    params = [SamplingParams(temperature=0.0, max_tokens=40, speculative=i != 1)
              for i in range(3)]
    want, got = base.generate(prompts, params), spec.generate(prompts, params)
    assert texts(got) == texts(want)
    assert spec.engine.stats().num_accepted_tokens > 10
