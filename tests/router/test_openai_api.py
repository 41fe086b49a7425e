"""The OpenAI-compatible HTTP API, driven by the official `openai` client."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.router.conftest import API_KEY, all_blocks_free, wait_until
from workers.contract.prefix_cache import hash_prompt_blocks

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_name_and_context(client, server, tiny_model):
    (entry,) = client.models.list().data
    assert entry.id == server.router.model_name == tiny_model.rstrip("/").split("/")[-1]
    assert entry.max_model_len == 2048


def test_health_and_version(base_url):
    health = httpx.get(f"{base_url}/health")
    assert health.status_code == 200 and len(health.json()["healthy_workers"]) == 2
    assert httpx.get(f"{base_url}/version", headers=AUTH).json()["version"]


def test_an_idle_keep_alive_connection_outlives_the_clients_own_pool_timeouts(server):
    """A connection left idle past uvicorn's default keep-alive (5 s, httpx's own) still takes
    the next request: the client's pool closes it first, never the server while a request is on
    its way (the race aiohttp met as "Server disconnected")."""
    import socket
    import time

    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:
        for pause in (0.0, 6.0):
            time.sleep(pause)
            sock.sendall(request)
            reply = sock.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200"), (pause, reply[:80])


def test_completion(client, model):
    out = client.completions.create(model=model, prompt="hello there", max_tokens=8,
                                    temperature=0, extra_body={"ignore_eos": True})
    (choice,) = out.choices
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens > 0


def test_completion_batch_of_token_id_prompts_and_n(client, model):
    out = client.completions.create(model=model, prompt=[[1, 2, 3], [4, 5, 6, 7]],
                                    max_tokens=4, n=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == 7 and out.usage.completion_tokens == 16


def test_streamed_completion_matches_the_unstreamed_one(client, model):
    args = dict(model=model, prompt="a b c", max_tokens=10, temperature=0,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0].text
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **args))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_return_token_ids_gives_the_prompt_and_output_ids_streamed_or_not(client, model):
    """vLLM's extension: the ids a client needs to continue a conversation exactly."""
    args = dict(model=model, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = client.completions.create(**args).choices[0].model_dump()
    assert whole["prompt_token_ids"] == [5, 6, 7, 8] and len(whole["token_ids"]) == 6
    chunks = [c.choices[0].model_dump() for c in client.completions.create(stream=True, **args)
              if c.choices]
    assert chunks[0]["prompt_token_ids"] == [5, 6, 7, 8]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    plain = client.completions.create(model=model, prompt=[5, 6], max_tokens=2)
    assert "token_ids" not in plain.choices[0].model_dump()


def test_same_seed_same_text(client, model):
    def sample(seed: int) -> list[str]:
        out = client.completions.create(model=model, prompt="once upon", max_tokens=12,
                                        temperature=1.0, seed=seed, n=2,
                                        extra_body={"ignore_eos": True})
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


def test_stop_string_ends_the_text(client, model):
    text = client.completions.create(model=model, prompt="x y z", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    at = next(j for j in range(3, len(text) - 1)
              if text[j:j + 2].isprintable() and " " not in text[j:j + 2]
              and "\ufffd" not in text[j:j + 2] and text.index(text[j:j + 2]) == j)
    stop = text[at:at + 2]
    out = client.completions.create(model=model, prompt="x y z", max_tokens=30, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert out.finish_reason == "stop" and out.text == text[:text.index(stop)]


def test_logprobs_in_the_legacy_format(client, model):
    out = client.completions.create(model=model, prompt="hello", max_tokens=5, logprobs=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # several ids can decode to one string (e.g. partial UTF-8 as U+FFFD): compare values
        assert logprob <= 0 and token in top and logprob in top.values()
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the top token
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_with_logprobs_gives_prompt_logprobs(client, model, server):
    """What lm-eval's local-completions backend sends for loglikelihood requests."""
    prompt = server.router.tokenize("the quick brown fox")
    out = client.completions.create(model=model, prompt=[prompt], max_tokens=1, logprobs=1,
                                    echo=True, temperature=0, seed=1234)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert out.choices[0].text.startswith("the quick brown fox")


def test_chat_completion(client, model):
    out = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": "be brief"},
                               {"role": "user", "content": "hi"}],
        max_completion_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 6


def test_chat_stream_with_logprobs_and_usage(client, model):
    args = dict(model=model, messages=[{"role": "user", "content": "tell me"}], max_tokens=6,
                temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    lps = [e for c in chunks if c.choices and c.choices[0].logprobs
           for e in c.choices[0].logprobs.content]
    assert len(lps) == 6 and all(len(e.top_logprobs) == 2 for e in lps)
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_chat_n_and_default_max_tokens_fills_the_context(client, model):
    out = client.chat.completions.create(model=model, n=3, max_tokens=3,
                                         messages=[{"role": "user", "content": "hi"}])
    assert len(out.choices) == 3


def test_repeated_prompt_hits_the_prefix_cache_where_predicted(client, model, server):
    prompt = list(range(10, 10 + 80))  # 5 full blocks of 16
    client.completions.create(model=model, prompt=prompt, max_tokens=2)
    router = server.router
    assert wait_until(lambda: router.workers.index.match(hash_prompt_blocks(prompt, 16)))
    out = client.completions.create(model=model, prompt=prompt, max_tokens=2)
    details = out.usage.prompt_tokens_details
    assert details.cached_tokens >= 64
    assert details.model_extra["predicted_cached_tokens"] >= 64
    assert router.counters.num_cached_tokens >= 64


def test_client_leaving_a_stream_frees_every_block(client, model, server):
    assert wait_until(lambda: all_blocks_free(server))
    engines = [w.engine for w in server.workers]
    for _ in range(2):
        stream = client.completions.create(model=model, prompt="a long story", max_tokens=1400,
                                           stream=True, extra_body={"ignore_eos": True})
        for i, _chunk in enumerate(stream):
            if i == 3:
                break
        assert any(e.has_unfinished() for e in engines)
        stream.close()  # the client goes away mid-stream, long before 1400 tokens
        assert wait_until(lambda: not any(e.has_unfinished() for e in engines), 3.0), \
            "the request was not aborted"
    assert wait_until(lambda: all_blocks_free(server)), "a request kept its blocks"
    assert wait_until(lambda: server.router.in_flight == 0)


def test_client_leaving_a_non_streamed_request_aborts_it(base_url, model, server):
    engines = [w.engine for w in server.workers]
    body = {"model": model, "prompt": "a long story", "max_tokens": 1400, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=0.5,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert wait_until(lambda: not any(e.has_unfinished() for e in engines), 3.0)
    assert wait_until(lambda: all_blocks_free(server))
