"""Grammar-constrained decoding in the engine: matchers rebuilt from tokens already sent, grammars
compiled off the step thread, refusals before anything is allocated, and the schema keywords
and strings the compiler would get wrong."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from tests.schemas import random_schema
from workers import LLM, AsyncEngine, InvalidRequestError, SamplingParams
from workers.engine.grammar import Grammars, compilable_schema
from workers.contract.protocol import WorkerRequest
from workers.engine.request import Continuation
from workers.serving.connector import Connector
from workers.contract.structured_output import StructuredOutput

SCHEMA = random_schema(5)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, num_blocks=128)


def params(**kw: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 300,
                             "structured": StructuredOutput.json_schema(SCHEMA), **kw})


def test_a_resumed_request_rebuilds_its_matcher_from_the_tokens_sent(llm):
    whole = llm.generate(["resume me"], params())[0].outputs[0]
    assert whole.finish_reason.value == "stop" and len(whole.token_ids) > 6
    prompt = llm.engine.tokenize("resume me")
    engine = llm.engine
    for cut in (1, 5):  # after the first token (a handoff), and mid-way (a migration)
        rid = f"resume-{cut}"
        Connector(engine).resume(WorkerRequest(rid, tuple(prompt), params()),
                                 [Continuation(0, whole.token_ids[:cut])])
        rest = []
        while engine.has_unfinished():
            for event in engine.step():
                rest += event.token_ids
        assert whole.token_ids[:cut] + rest == whole.token_ids


def test_sent_tokens_outside_the_grammar_are_refused_with_nothing_held(llm):
    engine = llm.engine
    free = engine.kv.pool.num_free_blocks
    junk = engine.tokenize("not json")  # a JSON object starts with "{"
    with pytest.raises(InvalidRequestError) as err:
        Connector(engine).resume(WorkerRequest("junk", tuple(junk), params()),
                                 [Continuation(0, junk)])
    assert err.value.param == "sent_token_ids"
    assert engine.kv.pool.num_free_blocks == free and not engine.has_unfinished()


def test_grammars_compile_off_the_step_thread_and_a_failure_allocates_nothing(llm):
    threads = []
    real = llm.engine.grammars._compile

    def spy(spec):
        threads.append(threading.current_thread().name)
        return real(spec)

    llm.engine.grammars._compile = spy

    async def run():
        engine = AsyncEngine(llm.engine)
        try:
            spec = StructuredOutput("regex", "[0-9]{4}")
            text = "".join([e.text async for e in engine.generate_stream(
                "digits", SamplingParams(temperature=0, max_tokens=10, structured=spec))])
            assert len(text) == 4 and text.isdigit()
            with pytest.raises(InvalidRequestError) as err:
                async for _ in engine.generate_stream("x", SamplingParams(
                        structured=StructuredOutput("regex", "a(", param="guided_regex"))):
                    pass
            assert err.value.param == "guided_regex" and "parenthesis" in err.value.message
            # aborted while its grammar compiles: never added
            stream = engine.stream(lambda sink: engine.generate(WorkerRequest(
                "gone", (1, 2, 3), SamplingParams(structured=StructuredOutput(
                    "regex", "[a-z]{9}"))), sink), "gone")
            await stream.aclose()
            await asyncio.sleep(0.3)
            assert "gone" not in llm.engine._samples and not llm.engine.has_unfinished()
        finally:
            await engine.shutdown()

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        llm.engine.grammars._compile = real
    assert threads and all(name.startswith("cleave-grammar") for name in threads)
    assert llm.engine.kv.pool.num_free_blocks == 128


def test_n_samples_each_follow_the_grammar(llm):
    out = llm.generate(["three"], params(n=3, temperature=1.0, seed=4))[0]
    texts = [json.loads(o.text) for o in out.outputs]
    assert len(texts) == 3 and all(isinstance(t, dict) for t in texts)


@pytest.mark.parametrize("schema,words", [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not' (at /properties/a/not)"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
    ({"type": "number", "multipleOf": 3}, "'multipleOf'"),
    ({"$ref": "http://example.com/schema"}, "must point inside the schema"),
    ({"type": "object", "properties": []}, "must be an object"),
    ([1, 2], "must be an object, got list"),
    ("{not json", "not JSON"),
])
def test_schemas_the_compiler_would_not_enforce_are_refused(schema, words):
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutput.json_schema(schema, "response_format")
    assert words in err.value.message and err.value.param == "response_format"


def test_bounded_strings_compile_to_exact_utf8_without_control_characters(tiny_model):
    """xgrammar's own bounded strings admit raw control characters, and a negated class in a
    pattern admits overlong UTF-8: the rewritten schema admits neither."""
    import xgrammar as xgr

    schema = {"type": "string", "minLength": 1, "maxLength": 3}
    rewritten = json.loads(compilable_schema(json.dumps(schema)))
    assert "maxLength" not in rewritten and rewritten["pattern"].endswith("{1,3}$")
    grammars = Grammars(LLM(tiny_model, num_blocks=16).engine.tokenizer, 512, frozenset({0}))
    compiled = grammars.compile(StructuredOutput.json_schema(schema))

    def accepts(raw: bytes) -> bool:
        return xgr.GrammarMatcher(compiled).accept_string(b'"' + raw + b'"')

    assert accepts("aé€".encode()) and accepts("😀".encode())
    assert not accepts(b"a\x1ab") and not accepts(b"\xe0\x89\x89") and not accepts(b"\xed\xa0\x80")
    assert not accepts(b"abcd")


def test_logit_bias_is_checked(llm):
    for bias, words in (({-1: 1.0}, "non-negative"), ({3: 101.0}, "[-100, 100]")):
        with pytest.raises(InvalidRequestError, match="logit_bias") as err:
            SamplingParams(logit_bias=bias)
        assert words in err.value.message
    with pytest.raises(InvalidRequestError, match="outside") as err:
        llm.generate(["x"], SamplingParams(logit_bias={10**6: 1.0}))
    assert err.value.param == "logit_bias"


def test_with_a_reasoning_parser_the_grammar_constrains_only_the_answer(llm):
    """The reasoning before `reasoning_end` is free text; the JSON must follow it. With a
    `reasoning_start`, the block is optional: the output may be JSON from the start."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    def follows(spec: StructuredOutput, text: str) -> bool:  # the whole text, then a stop
        ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
        try:
            matcher = llm.engine.grammars.matcher(spec, ids)
        except InvalidRequestError:
            return False
        return matcher.accept_token(llm.engine.tokenizer.eos_token_id)

    inside = StructuredOutput.json_schema(schema)
    r1 = StructuredOutput(inside.kind, inside.value, reasoning_end="</think>")
    assert follows(r1, 'no {JSON} here, a </thi and a <</think>\n{"a": 1}')
    assert not follows(r1, '{"a": 1}')  # the reasoning must end first
    assert not follows(r1, 'done</think>not json')
    qwen = StructuredOutput(inside.kind, inside.value, reasoning_start="<think>",
                            reasoning_end="</think>")
    assert follows(qwen, '{"a": 1}') and follows(qwen, '<think>hm</think>{"a": 1}')
    assert not follows(qwen, 'hm</think>{"a": 1}')
    with pytest.raises(InvalidRequestError):
        StructuredOutput("json_object", reasoning_start="<think>")
