"""Speculative decoding under a grammar's mask: structured-output requests draft (n-gram, a
draft model), their verified positions are masked at the matcher's state after the drafted
tokens before them, greedy output equals decoding without speculation, outputs stay valid, and
the matcher ends each step at the accepted tokens' state."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.schemas import random_schema
from tests.workers.test_speculative import DRAFT_MODEL, INT4_SELF, pair
from workers import LLM, SamplingParams
from workers.contract.protocol import WorkerRequest
from workers.contract.structured_output import StructuredOutput
from workers.engine.speculative.grammar_draft import cut_draft, draft_masks

FOX = "the quick brown fox jumps over the lazy dog"
CHOICES = [FOX, "the quick brown cat"]
REGEX = "(ab|cd|ef){4,16}x{3}[0-9]{24}"
SCHEMAS = [random_schema(0), random_schema(1)]
# text that repeats (prompt lookup finds matches), with the choice's words and JSON in it
PROMPT = f"{FOX}. " * 3 + '{"alpha": 1, "beta": [1, 2, 3]}' * 2
SPECS = [*(StructuredOutput.json_schema(s) for s in SCHEMAS),
         StructuredOutput("regex", REGEX), StructuredOutput.choice(CHOICES)]


def valid(spec: StructuredOutput, text: str) -> bool:
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), json.loads(spec.value))
        return True
    if spec.kind == "regex":
        return re.fullmatch(spec.value, text) is not None
    return text in spec.choices


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]], each_step=None) -> dict:
    """Step `engine` over `requests` (id -> (prompt ids, params)); per id its tokens, text and
    last event. `each_step(engine)` after every step."""
    for rid, (prompt, params) in requests.items():
        engine.generate(WorkerRequest(rid, tuple(prompt), params))
    out = {rid: {"tokens": [], "text": "", "last": None} for rid in requests}
    while engine.has_unfinished():
        for event in engine.step():
            got = out[event.request_id]
            got["tokens"] += event.token_ids
            got["text"] += event.text
            got["last"] = event
        if each_step is not None:
            each_step(engine)
    return out


@pytest.fixture(scope="module")
def ngram_pair(tiny_model) -> tuple[LLM, LLM]:
    return pair(tiny_model, num_blocks=256)


def test_greedy_constrained_requests_draft_and_match_decoding_without_speculation(ngram_pair):
    base, spec = ngram_pair
    prompt = base.engine.tokenize(PROMPT)
    requests = {f"c{i}": (prompt, SamplingParams(temperature=0.0, max_tokens=200, structured=s))
                for i, s in enumerate(SPECS)}
    want, got = run(base.engine, requests), run(spec.engine, requests)
    for i, s in enumerate(SPECS):
        w, g = want[f"c{i}"], got[f"c{i}"]
        assert g["tokens"] == w["tokens"] and g["text"] == w["text"]
        assert valid(s, g["text"]) and g["last"].finish_reason.value == "stop"
    drafted = {rid: (g["last"].num_draft_tokens, g["last"].num_accepted_tokens)
               for rid, g in got.items()}
    # each kind of grammar drafted, and its drafts were accepted (the choice: once "the quick
    # brown" is written, the mask admits one continuation, which prompt lookup proposes)
    assert all(d > 0 and a > 0 for d, a in drafted.values()), drafted
    assert all(w["last"].num_draft_tokens == 0 for w in want.values())


def test_a_mixed_batch_with_chunked_prefill_matches_decoding_without_speculation(tiny_model):
    """Constrained and free requests in one batch, a long prompt prefilled in chunks beside
    the others' verifications, on a small cache (preemptions)."""
    base, spec = pair(tiny_model, block_size=4, num_blocks=80, max_num_batched_tokens=32)
    tok = base.engine.tokenize
    long_prompt = tok(PROMPT * 2)  # ~120 tokens: several 32-token chunks
    requests = {
        "json": (tok(PROMPT), SamplingParams(temperature=0.0, max_tokens=120,
                                             structured=SPECS[0])),
        "regex": (long_prompt, SamplingParams(temperature=0.0, max_tokens=80,
                                              structured=SPECS[2])),
        "free": (tok(f"{FOX} {FOX} {FOX}"), SamplingParams(temperature=0.0, max_tokens=40,
                                                           ignore_eos=True)),
        "choice": (tok(PROMPT), SamplingParams(temperature=0.0, max_tokens=40,
                                               structured=SPECS[3])),
    }
    want, got = run(base.engine, requests), run(spec.engine, requests)
    assert {r: g["tokens"] for r, g in got.items()} == {r: w["tokens"] for r, w in want.items()}
    assert valid(SPECS[0], got["json"]["text"]) and valid(SPECS[2], got["regex"]["text"])
    assert valid(SPECS[3], got["choice"]["text"])
    assert got["regex"]["last"].num_accepted_tokens > 0
    assert got["free"]["last"].num_accepted_tokens > 0
    stats = spec.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_the_matcher_ends_a_partly_rejected_step_at_the_accepted_tokens_state(ngram_pair):
    """After every step the request's matcher is where one fed only its output tokens is; a
    step whose draft was partly rejected happened (a matcher not rolled back after the
    masks, or fed the rejected tokens, would be ahead of its output)."""
    _, spec = ngram_pair
    engine = spec.engine
    spec_json = SPECS[1]
    partial = []
    seen = {"drafted": 0, "accepted": 0}

    def check(engine) -> None:
        req = engine.scheduler.requests.get("m")
        if req is None or req.is_finished:
            return
        drafted = req.num_draft_tokens - seen["drafted"]
        accepted = req.num_accepted_tokens - seen["accepted"]
        seen.update(drafted=req.num_draft_tokens, accepted=req.num_accepted_tokens)
        if drafted > 0 and accepted < drafted:
            partial.append((drafted, accepted))
        fresh = engine.grammars.matcher(spec_json, req.output_token_ids)
        assert (req.grammar._debug_print_internal_state()
                == fresh._debug_print_internal_state()), req.output_token_ids

    out = run(engine, {"m": (engine.tokenize(PROMPT), SamplingParams(
        temperature=0.0, max_tokens=200, structured=spec_json))}, check)
    assert valid(spec_json, out["m"]["text"])
    assert partial, "no step verified a draft that was partly rejected"


def test_drafts_are_cut_where_the_grammar_refuses_and_masks_follow_the_draft(ngram_pair):
    _, spec = ngram_pair
    engine = spec.engine
    choice = StructuredOutput.choice(CHOICES)
    matcher = engine.grammars.matcher(choice)
    ids = engine.tokenizer.encode(FOX, add_special_tokens=False)[:4]
    before = matcher._debug_print_internal_state()
    bad = ids[0]  # "the" again after "the": refused
    assert cut_draft(matcher, [*ids[:2], bad, ids[3]], keep_refused=False) == ids[:2]
    assert cut_draft(matcher, [*ids[:2], bad, ids[3]], keep_refused=True) == [*ids[:2], bad]
    masks = draft_masks(matcher, [*ids[:2], bad], engine.grammars.vocab_size)
    assert matcher._debug_print_internal_state() == before  # rolled back each time
    walk = engine.grammars.matcher(choice)
    for j, token in enumerate(ids[:2]):
        walk.accept_token(token)
        allowed = _allowed(masks[j])
        assert ids[j + 1] in allowed and bad not in allowed
    assert _allowed(masks[2]) == _allowed(masks[1])  # past the refused token: the mask before


def _allowed(mask) -> set[int]:
    return {w * 32 + b for w, word in enumerate(mask.tolist()) for b in range(32)
            if (word >> b) & 1}


@pytest.fixture(scope="module")
def base(ngram_pair) -> LLM:
    return ngram_pair[0]


def test_sampled_constrained_requests_drafted_by_a_draft_model_stay_valid(tiny_model, base):
    """Rejection sampling over the masked target: seeded outputs valid and reproducible, the
    greedy one equal to decoding without speculation."""
    spec = LLM(tiny_model, num_blocks=128, speculative_config=DRAFT_MODEL)
    prompt = spec.engine.tokenize(PROMPT)
    requests = {f"s{i}": (prompt, SamplingParams(temperature=0.9, seed=i, max_tokens=200,
                                                 structured=SPECS[i])) for i in range(3)}
    requests["g"] = (prompt, SamplingParams(temperature=0.0, max_tokens=200,
                                            structured=SPECS[0]))
    first, again = run(spec.engine, requests), run(spec.engine, requests)
    assert {r: o["tokens"] for r, o in first.items()} == {r: o["tokens"] for r, o in again.items()}
    for i in range(3):
        assert valid(SPECS[i], first[f"s{i}"]["text"])
    assert first["g"]["tokens"] == run(base.engine, {"g": requests["g"]})["g"]["tokens"]
    # the draft drafts under the mask: its drafts are accepted, the greedy one's too
    assert all(o["last"].num_accepted_tokens > 0 for o in first.values()), {
        r: (o["last"].num_draft_tokens, o["last"].num_accepted_tokens) for r, o in first.items()}


def test_the_int4_self_draft_drafts_under_the_grammar(tiny_model, base):
    spec = LLM(tiny_model, num_blocks=128, speculative_config=INT4_SELF)
    prompt = spec.engine.tokenize(PROMPT)
    requests = {f"q{i}": (prompt, SamplingParams(temperature=0.0, max_tokens=200, structured=s))
                for i, s in enumerate(SPECS[1:])}
    want, got = run(base.engine, requests), run(spec.engine, requests)
    assert {r: g["tokens"] for r, g in got.items()} == {r: w["tokens"] for r, w in want.items()}
    for i, s in enumerate(SPECS[1:]):
        assert valid(s, got[f"q{i}"]["text"])
    assert sum(g["last"].num_accepted_tokens for g in got.values()) > 0


def test_a_refused_drafted_token_kept_and_rejected_leaves_the_masked_target_distribution():
    """Rejection sampling over the masked target (tokens 4 and 5 forbidden; the draft gives
    them 0.55): keeping the refused drafted token (rejected there, the residual of the masked
    target drawn) gives the masked target's distribution and never a forbidden token; cutting
    the draft before it (the target's draw there instead) does not, and the same test says
    so."""
    import torch

    from tests.workers.test_rejection_sampling import DRAFT, TARGET, p_value
    from workers.engine.speculative.rejection import rejection_sample

    n = 40000
    masked = TARGET.clone()
    masked[4:] = 0
    masked /= masked.sum()
    gen = torch.Generator().manual_seed(4321)
    drafts = torch.multinomial(DRAFT.expand(n, -1), 1, generator=gen)  # [n, 1]
    kept = rejection_sample(drafts, DRAFT.expand(n, 1, -1), masked.expand(n, 2, -1), gen)
    first = kept.tokens[:, 0]
    assert not (first >= 4).any() and p_value(first, masked[:4]) > 1e-3
    refused = drafts[:, 0] >= 4
    cut = first.clone()  # the wrong rule: a refused draft cut, the target's own draw there
    cut[refused] = torch.multinomial(masked.expand(int(refused.sum()), -1), 1,
                                     generator=gen)[:, 0]
    assert p_value(cut, masked[:4]) < 1e-6
