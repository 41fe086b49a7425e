"""Structured output through the real HTTP and gRPC servers with the `openai` client: JSON
schemas, regexes, choices and grammars constrain what a random-weight model writes, on the
aggregated path, through the prefill->decode handoff and after a migration, with n-gram
speculation on (drafts verified under the grammar's mask); bad constraints are 400s naming the
field, with nothing allocated."""

from __future__ import annotations

import itertools
import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import grpc
import jsonschema
import openai
import pydantic
import pytest

from cluster.local_server import LocalServer
from router.proto.cleave.v1 import generate_pb2 as pb
from router.proto.cleave.v1 import generate_pb2_grpc as pb_grpc
from tests.router.conftest import API_KEY, NUM_BLOCKS, start_pools, wait_until
from tests.router.test_metrics import scrape, total
from tests.schemas import random_schema

THRESHOLD = 24  # prompt tokens: longer prompts are prefilled on the prefill worker
_words = itertools.count()


def long_prompt() -> str:
    """~40 tokens no worker has cached: disaggregated."""
    return " ".join(f"s{next(_words)}" for _ in range(30))


# every worker drafts by prompt lookup: constrained requests verify drafts under their mask
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                    "prompt_lookup_min": 1, "draft_length": "fixed",
                    "disable_by_batch_size": 64})


@pytest.fixture(scope="module")
def srv(tiny_model):
    """One prefill and two decode workers, n-gram speculation on: short prompts run aggregated
    on a decode worker, long ones are handed off."""
    server = start_pools(tiny_model, threshold=THRESHOLD, num_prefill_workers=1,
                         num_decode_workers=2, engine={"speculative_config": NGRAM})
    yield server
    server.stop()


def client_of(srv: LocalServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key=API_KEY,
                         timeout=120, max_retries=0)


def settled(srv: LocalServer) -> bool:
    return wait_until(lambda: all(srv.call(c.stats()).num_free_blocks == NUM_BLOCKS
                                  for c in srv.clients), 10.0)


def _schema_request(srv: LocalServer, seed: int) -> tuple[dict, list[str], list[str]]:
    """Request `seed` of the 50: schema `seed`, and by seed % 4 chat or completions,
    streamed or not, greedy n=1 or seeded n=3, short (aggregated) or long (handed off)."""
    schema = random_schema(seed)
    variant = seed % 4
    stream, n = variant in (1, 3), 3 if variant >= 2 else 1
    args = dict(model=srv.router.model_name, max_tokens=400, n=n, stream=stream,
                temperature=1.0 if n > 1 else 0.0, seed=seed)
    prompt = long_prompt() if seed % 3 == 0 else f"json {seed}"
    client = client_of(srv)
    texts, reasons = [""] * n, [""] * n
    if seed % 2 == 0:
        out = client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], **args,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{seed}", "schema": schema}})
        for chunk in (out if stream else [out]):
            for c in chunk.choices:
                texts[c.index] += (c.delta.content if stream else c.message.content) or ""
                reasons[c.index] = c.finish_reason or reasons[c.index]
    else:
        out = client.completions.create(prompt=prompt, **args,
                                        extra_body={"structured_outputs": {"json": schema}})
        for chunk in (out if stream else [out]):
            for c in chunk.choices:
                texts[c.index] += c.text
                reasons[c.index] = c.finish_reason or reasons[c.index]
    return schema, texts, reasons


def test_fifty_random_schemas_each_constrain_a_request_that_validates(srv):
    """Every schema once (each is compiled and walked by its own request; the 200 requests of
    before sent each schema 4 times, once per variant, for the same schema coverage), the four
    variants 12-13 times each, the long greedy prompts through the handoff."""
    disagg = srv.router.counters.num_disaggregated
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda s: _schema_request(srv, s), range(50)))
    outputs = 0
    for schema, texts, reasons in results:
        for text, reason in zip(texts, reasons):
            jsonschema.validate(json.loads(text), schema)
            assert reason == "stop"
            outputs += 1
    assert outputs == 26 + 24 * 3  # seeds 2, 3, 6, 7, ..., 47 had n=3
    # the long prompts of n=1 requests (n>1 always runs aggregated): 9 of the 50
    assert srv.router.counters.num_disaggregated >= disagg + 8
    assert settled(srv)
    # with speculation: drafts were verified under the grammars' masks, and accepted
    stats = [srv.call(c.stats()) for c in srv.clients]
    assert sum(s.num_accepted_tokens for s in stats) > 0, stats
    # counted on /metrics as vLLM's spec_decode counters: drafted, accepted, drafts verified
    metrics = scrape(srv)
    for name, field in (("draft_tokens", "num_draft_tokens"),
                        ("accepted_tokens", "num_accepted_tokens"), ("drafts", "num_drafts")):
        assert total(metrics, f"cleave_spec_decode_num_{name}_total", method="ngram") == sum(
            getattr(s, field) for s in stats)
    drafts = sum(s.num_drafts for s in stats)
    assert 0 < drafts <= sum(s.num_draft_tokens for s in stats) <= 4 * drafts


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    kind: Literal["cat", "dog", "axolotl"]
    age: int = pydantic.Field(ge=0, le=30)
    tags: list[Literal["calm", "loud"]] = pydantic.Field(max_length=3)


def test_the_openai_clients_parse_helper_returns_parsed_objects(srv):
    for prompt in ("a pet please", long_prompt()):
        out = client_of(srv).chat.completions.parse(
            model=srv.router.model_name, messages=[{"role": "user", "content": prompt}],
            response_format=Pet, max_tokens=200, temperature=0)
        pet = out.choices[0].message.parsed
        assert isinstance(pet, Pet) and 0 <= pet.age <= 30


@pytest.mark.parametrize("body,check", [
    ({"structured_outputs": {"regex": r"[a-z]{3}-\d{2}"}},
     lambda t: re.fullmatch(r"[a-z]{3}-\d{2}", t)),
    ({"guided_regex": r"(yes|no)!"}, lambda t: t in ("yes!", "no!")),
    ({"structured_outputs": {"choice": ["red alert", "all \"clear\"", "über"]}},
     lambda t: t in ("red alert", "all \"clear\"", "über")),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]? "y"'}},
     lambda t: re.fullmatch(r"x\d\d?y", t)),
    # any JSON object; the bias on "}" makes a random model close it at once
    ({"response_format": {"type": "json_object"}, "logit_bias": "close"},
     lambda t: isinstance(json.loads(t), dict)),
], ids=["regex", "guided_regex", "choice", "guided_choice", "grammar", "json_object"])
def test_regex_choice_grammar_and_json_object_constrain_the_text(srv, body, check):
    client = client_of(srv)
    if body.get("logit_bias") == "close":
        close = srv.router.tokenizer.encode("}", add_special_tokens=False)
        body = {**body, "logit_bias": {str(close[0]): 100}}
    for prompt, stream in (("go", False), (long_prompt(), True), ("seeded", False)):
        extra = dict(body)
        fmt = extra.pop("response_format", None)
        args = dict(model=srv.router.model_name, max_tokens=64, stream=stream,
                    temperature=0.9 if prompt == "seeded" else 0, seed=7, extra_body=extra,
                    messages=[{"role": "user", "content": prompt}])
        if fmt is not None:
            args["response_format"] = fmt
        out = client.chat.completions.create(**args)
        text = "".join(c.choices[0].delta.content or "" for c in out) if stream \
            else out.choices[0].message.content
        assert check(text), text
    assert settled(srv)


def test_logprobs_are_of_the_masked_distribution(srv):
    out = client_of(srv).chat.completions.create(
        model=srv.router.model_name, messages=[{"role": "user", "content": "pick"}],
        max_tokens=4, temperature=0, logprobs=True, top_logprobs=8,
        extra_body={"structured_outputs": {"regex": "[ab]"}})
    first = out.choices[0].logprobs.content[0]
    allowed = [t for t in first.top_logprobs if t.logprob > -9999.0]
    assert {t.token for t in allowed} <= {"a", "b"} and allowed
    assert math.isclose(sum(math.exp(t.logprob) for t in allowed), 1.0, rel_tol=1e-3)
    assert all(t.logprob == -9999.0 for t in first.top_logprobs if t not in allowed)


def test_a_structured_request_gives_the_same_output_handed_off_and_aggregated(srv):
    """The first run hands the prompt off; the second finds it cached on that decode worker
    and runs there aggregated: the same greedy text."""
    schema = random_schema(7)
    prompt = long_prompt()
    outs, handed_off = [], []
    for _ in range(2):
        before = srv.router.counters.num_disaggregated
        out = client_of(srv).completions.create(
            model=srv.router.model_name, prompt=prompt, max_tokens=300, temperature=0,
            extra_body={"structured_outputs": {"json": schema}})
        outs.append(out.choices[0].text)
        handed_off.append(srv.router.counters.num_disaggregated - before)
    assert handed_off == [1, 0]
    assert outs[0] == outs[1]
    jsonschema.validate(json.loads(outs[0]), schema)


def test_logit_bias_moves_the_choice(srv):
    token = srv.router.tokenizer.encode(" zebra", add_special_tokens=False)[0]
    out = client_of(srv).completions.create(
        model=srv.router.model_name, prompt="anything", max_tokens=5, temperature=0,
        logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert out.choices[0].text == srv.router.tokenizer.decode([token] * 5)


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format", "objectx"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"not": {}}}}}}},
     "response_format", "'not'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex", "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs.grammar", "foo"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "at most one"),
    ({"logit_bias": {"999999": 5}}, "logit_bias", "outside"),
    ({"logit_bias": {"abc": 5}}, "logit_bias", "token ids"),
    ({"logit_bias": {"3": 500}}, "logit_bias", "[-100, 100]"),
    ({"structured_outputs": {"json": {}, "whitespace": 1}}, "structured_outputs",
     "structured_outputs.whitespace: unknown field"),
], ids=["schema-type", "unsupported-keyword", "no-schema", "regex", "grammar", "empty-choice",
        "two-constraints", "bias-vocab", "bias-key", "bias-value", "unknown-field"])
def test_bad_constraints_are_400s_naming_the_field_and_allocate_nothing(srv, body, param,
                                                                       words):
    for prompt in ("short", long_prompt()):
        with pytest.raises(openai.BadRequestError) as err:
            client_of(srv).chat.completions.create(
                model=srv.router.model_name, messages=[{"role": "user", "content": prompt}],
                max_tokens=8, extra_body=body)
        error = err.value.body
        assert error["param"] == param and words in error["message"], error
    assert settled(srv)


def test_tokenize_and_detokenize_as_vllm_serves_them(srv):
    import httpx

    base = f"http://127.0.0.1:{srv.http_port}"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    got = httpx.post(f"{base}/tokenize", json={"prompt": "hello world"}, headers=auth).json()
    assert got["tokens"] == srv.router.tokenizer.encode("hello world")
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == srv.router.max_model_len
    text = httpx.post(f"{base}/detokenize", json={"tokens": got["tokens"]}, headers=auth).json()
    assert text["prompt"] == srv.router.tokenizer.decode(got["tokens"])
    messages = [{"role": "user", "content": "hi there"}]
    chat = httpx.post(f"{base}/tokenize", json={"messages": messages, "return_token_strs": True},
                      headers=auth).json()
    usage = client_of(srv).chat.completions.create(
        model=srv.router.model_name, messages=messages, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens == len(chat["token_strs"])
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [10**9]}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{base}/tokenize", json={"prompt": "x"}).status_code == 401


def test_grpc_carries_the_constraint(srv):
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}"))
    auth = (("authorization", f"Bearer {API_KEY}"),)

    def generate(constraint: pb.OutputConstraint) -> str:
        req = pb.GenerateRequest(text=long_prompt(), sampling=pb.SamplingParameters(
            temperature=0.0, max_tokens=200, constraint=constraint))
        return "".join(e.text for e in stub.Generate(req, metadata=auth, timeout=60))

    schema = random_schema(3)
    jsonschema.validate(json.loads(generate(pb.OutputConstraint(
        json_schema=json.dumps(schema)))), schema)
    assert generate(pb.OutputConstraint(choice=pb.ChoiceList(choices=["up", "down"]))) in (
        "up", "down")
    with pytest.raises(grpc.RpcError) as err:
        generate(pb.OutputConstraint(regex="a("))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.constraint" in err.value.details()


def test_a_stream_holding_unicode_line_breaks_reads_line_by_line(srv):
    """U+0085, U+2028 and U+2029 are valid raw in JSON, but `str.splitlines` (httpx's
    `iter_lines`, which guidellm and the load generator read SSE with) breaks lines on them: the
    events carry them escaped."""
    import httpx

    body = {"model": srv.router.model_name, "prompt": "breaks", "max_tokens": 32, "stream": True,
            "temperature": 0, "structured_outputs": {"regex": "a\u2028b\u0085c\u2029d"}}
    text = ""
    with httpx.stream("POST", f"http://127.0.0.1:{srv.http_port}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == "a\u2028b\u0085c\u2029d"
