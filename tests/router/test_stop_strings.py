"""Text and stop strings are made by the router, off the engines' step threads: streamed or not,
aggregated or disaggregated, a served request's text, finish reason and stop reason equal the
offline engine's (which detokenizes on its step thread), and a stop string frees the worker."""

from __future__ import annotations

import itertools

import openai
import pytest

from cluster.local_server import LocalServer
from tests.router.conftest import API_KEY, NUM_BLOCKS, start_pools, wait_until
from workers import LLM, SamplingParams

MAX_TOKENS = 40
_words = itertools.count()


@pytest.fixture(scope="module")
def disagg(tiny_model):
    srv = start_pools(tiny_model, threshold=8, num_prefill_workers=1, num_decode_workers=1)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(tiny_model, num_blocks=256)


def prompt() -> str:
    return " ".join(f"s{next(_words)}" for _ in range(20))


def client_of(srv: LocalServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key=API_KEY,
                         timeout=60, max_retries=0)


def stop_inside(text: str, start: int) -> str:
    """A 2-character stop string that first occurs at or after `start` in `text`."""
    return next(text[j:j + 2] for j in range(start, len(text) - 1)
                if text[j:j + 2].isprintable() and "\ufffd" not in text[j:j + 2]
                and text.index(text[j:j + 2]) == j)


def served(srv: LocalServer, text_prompt: str, stream: bool, **kwargs) -> tuple[str, str]:
    c = client_of(srv)
    args = {"model": srv.router.model_name, "prompt": text_prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "extra_body": {"ignore_eos": True}, **kwargs}
    if not stream:
        choice = c.completions.create(**args).choices[0]
        return choice.text, choice.finish_reason
    text, reason = "", None
    for chunk in c.completions.create(stream=True, **args):
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_served_stop_strings_cut_exactly_as_the_offline_engine(disagg, offline, stream, include):
    p = prompt()
    full = offline.generate([p], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                ignore_eos=True))[0].outputs[0].text
    stop = stop_inside(full, 6)
    want = offline.generate([p], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=[stop],
        include_stop_str_in_output=include))[0].outputs[0]
    text, reason = served(disagg, p, stream, stop=[stop],
                          extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
    assert (text, reason) == (want.text, "stop")
    assert text.endswith(stop) == include
    free = [disagg.call(c.stats()).num_free_blocks for c in disagg.clients]
    assert wait_until(lambda: [disagg.call(c.stats()).num_free_blocks
                               for c in disagg.clients] == [NUM_BLOCKS] * 2), free


def test_text_without_stop_strings_equals_the_offline_engines(disagg, offline):
    p = prompt()
    want = offline.generate([p], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                ignore_eos=True))[0].outputs[0].text
    assert served(disagg, p, stream=True) == (want, "length")


def test_a_stop_string_ends_each_sample_of_n_on_its_own(disagg, offline):
    p = prompt()
    full = offline.generate([p], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                ignore_eos=True))[0].outputs[0].text
    stop = stop_inside(full, 4)
    out = client_of(disagg).completions.create(
        model=disagg.router.model_name, prompt=p, max_tokens=MAX_TOKENS, temperature=0, n=2,
        stop=[stop], extra_body={"ignore_eos": True})
    assert [(c.text, c.finish_reason) for c in out.choices] == [
        (full[:full.index(stop)], "stop")] * 2
