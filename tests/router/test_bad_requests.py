"""Malformed and refused requests over HTTP: the right status, OpenAI's error shape, and a
server that keeps serving."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.router.conftest import (
    API_KEY,
    MAX_BODY_BYTES,
    all_blocks_free,
    start_server,
    wait_until,
)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


def body(**fields: object) -> bytes:
    return json.dumps({"prompt": "hi", "max_tokens": 2, **fields}).encode()


def chat(**fields: object) -> bytes:
    return json.dumps({"messages": MSGS, "max_tokens": 2, **fields}).encode()


# (name, path, raw body, headers, status, param expected in the error (None: any))
CASES = [
    ("malformed json", CMPL, b"{\"prompt\": ", JSON, 400, None),
    ("json array body", CMPL, b"[1, 2]", JSON, 400, None),
    ("invalid utf-8", CMPL, b'{"prompt": "\xff\xfe"}', JSON, 400, None),
    ("empty body", CMPL, b"", JSON, 400, None),
    ("missing prompt", CMPL, b'{"max_tokens": 2}', JSON, 400, "prompt"),
    ("prompt of wrong type", CMPL, body(prompt=12), JSON, 400, "prompt"),
    ("prompt of mixed lists", CMPL, body(prompt=[1, "a"]), JSON, 400, "prompt"),
    ("empty prompt", CMPL, body(prompt=[]), JSON, 400, "prompt"),
    ("token id out of vocab", CMPL, body(prompt=[1, 10**6]), JSON, 400, "prompt"),
    ("max_tokens not a number", CMPL, body(max_tokens="many"), JSON, 400, "max_tokens"),
    ("max_tokens zero", CMPL, body(max_tokens=0), JSON, 400, "max_tokens"),
    ("negative temperature", CMPL, body(temperature=-1), JSON, 400, "temperature"),
    ("temperature above 2", CMPL, body(temperature=3.5), JSON, 400, "temperature"),
    ("top_p zero", CMPL, body(top_p=0), JSON, 400, "top_p"),
    ("top_k negative", CMPL, body(top_k=-5), JSON, 400, "top_k"),
    ("logprobs too many", CMPL, body(logprobs=50), JSON, 400, "logprobs"),
    ("n zero", CMPL, body(n=0), JSON, 400, "n"),
    ("n too large", CMPL, body(n=17), JSON, 400, "n"),
    ("n fractional", CMPL, body(n=1.5), JSON, 400, "n"),
    ("stop with empty string", CMPL, body(stop=[""]), JSON, 400, "stop"),
    ("min_tokens above max_tokens", CMPL, body(min_tokens=5), JSON, 400, "min_tokens"),
    ("prompt over the context", CMPL, body(prompt=[5] * 2048), JSON, 400, "prompt"),
    ("prompt plus max_tokens over the context", CMPL, body(prompt=[5] * 2000, max_tokens=100),
     JSON, 400, "max_tokens"),
    ("unknown model", CMPL, body(model="gpt-9"), JSON, 404, "model"),
    ("oversized body", CMPL, body(prompt="x" * (MAX_BODY_BYTES + 1)), JSON, 413, None),
    ("no api key", CMPL, body(), {"Content-Type": "application/json"}, 401, None),
    ("bad api key", CMPL, body(), {"Authorization": "Bearer nope"}, 401, None),
    ("chat without messages", CHAT, b'{"max_tokens": 2}', JSON, 400, "messages"),
    ("chat with empty messages", CHAT, chat(messages=[]), JSON, 400, "messages"),
    ("chat with a bad role", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), JSON,
     400, "messages"),
    ("chat top_logprobs without logprobs", CHAT, chat(top_logprobs=2), JSON, 400,
     "top_logprobs"),
    ("chat stream not a bool", CHAT, chat(stream="yes please"), JSON, 400, "stream"),
    ("unknown route", "/v1/audio/speech", body(), JSON, 404, None),
    ("seed past 64 bits", CMPL, body(seed=2**70, temperature=1.0), JSON, 400, "seed"),
    ("seed below int64", CMPL, body(seed=-2**63 - 1), JSON, 400, "seed"),
    ("too many stop strings", CMPL, body(stop=[f"s{i}" for i in range(65)]), JSON, 400,
     "stop"),
    ("too many stop token ids", CMPL, body(stop_token_ids=list(range(1025))), JSON, 400,
     "stop_token_ids"),
    ("lone surrogate in the prompt", CMPL, b'{"prompt": "a\\ud800b", "max_tokens": 2}', JSON,
     400, "prompt"),
    ("lone surrogate in a message", CHAT,
     b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', JSON, 400,
     "messages"),
    ("lone surrogate in the salt", CMPL, b'{"prompt": "a", "cache_salt": "\\ud800"}', JSON,
     400, "cache_salt"),
    ("logit_bias outside the vocabulary", CMPL, body(logit_bias={"999999": 10}), JSON, 400,
     "logit_bias"),
    ("unknown field", CHAT, chat(frobnicate=True), JSON, 400, "frobnicate"),
    ("too many prompts", CMPL, body(prompt=["a"] * 65), JSON, 400, "prompt"),
    ("a deadline that is no number", CMPL, body(), {**JSON, "x-slo-ttft-ms": "soon"}, 400,
     "x-slo-ttft-ms"),
    ("a deadline of zero", CHAT, chat(), {**JSON, "x-slo-ttft-ms": "0"}, 400, "x-slo-ttft-ms"),
]


@pytest.mark.parametrize("name,path,raw,headers,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_an_openai_error(base_url, name, path, raw, headers, status, param):
    response = httpx.post(f"{base_url}{path}", content=raw, headers=headers, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_body_too_large_without_content_length(base_url):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    response = httpx.post(f"{base_url}{CMPL}", content=chunks(), headers=JSON, timeout=30)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_server_is_healthy_after_bad_requests(base_url, server):
    ok = httpx.post(f"{base_url}{CMPL}", content=body(), headers=JSON, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
    assert httpx.get(f"{base_url}/health").status_code == 200
    assert wait_until(lambda: all_blocks_free(server) and server.router.in_flight == 0)


@pytest.fixture(scope="module")
def small_server(tiny_model):
    srv = start_server(tiny_model, num_workers=1, max_in_flight=1, retry_after_s=3)
    yield srv
    srv.stop()


@pytest.mark.parametrize("path,raw", [(CMPL, body()), (CHAT, chat())], ids=["cmpl", "chat"])
def test_a_deadline_no_worker_can_meet_gets_429_and_a_loose_one_is_served(base_url, path,
                                                                          raw):
    # a prompt of 300 tokens: its prefill measures its worker's rate (the other's is taken
    # to be its peer's)
    httpx.post(f"{base_url}{CMPL}", content=body(prompt=[5] * 300), headers=JSON, timeout=30)
    tight = httpx.post(f"{base_url}{path}", content=raw,
                       headers={**JSON, "x-slo-ttft-ms": "0.000001"}, timeout=30)
    assert tight.status_code == 429 and tight.headers["Retry-After"] == "1", tight.text
    assert "x-slo-ttft-ms" in tight.json()["error"]["message"]
    loose = httpx.post(f"{base_url}{path}", content=raw,
                       headers={**JSON, "x-slo-ttft-ms": "60000"}, timeout=30)
    assert loose.status_code == 200, loose.text


def test_each_prompt_takes_a_slot_and_a_refusal_does_no_work(small_server, monkeypatch):
    """A completions body of two prompts holds two slots (it is let in alone past a limit of
    one); a request refused meanwhile is refused before its prompt is tokenized."""
    router = small_server.router
    url = f"http://127.0.0.1:{small_server.http_port}{CMPL}"
    tokenized = []
    real = router.tokenize_async

    async def counting(text):
        tokenized.append(text)
        return await real(text)

    monkeypatch.setattr(router, "tokenize_async", counting)
    gate = threading.Event()
    small_server.workers[0].async_engine._executor.submit(gate.wait, 30)
    with ThreadPoolExecutor(1) as pool:
        two = pool.submit(httpx.post, url, content=body(prompt=["a b", "c d"]), headers=JSON,
                          timeout=30)
        assert wait_until(lambda: router.in_flight == 2)
        refused = httpx.post(url, content=body(prompt="never tokenized"), headers=JSON,
                             timeout=30)
        gate.set()
        assert two.result().status_code == 200 and len(two.result().json()["choices"]) == 2
    assert refused.status_code == 429 and "never tokenized" not in tokenized
    assert wait_until(lambda: router.in_flight == 0)


def test_overload_gets_429_with_retry_after_then_no_worker_gets_503(small_server):
    url = f"http://127.0.0.1:{small_server.http_port}{CMPL}"
    gate = threading.Event()
    # stall the worker's step thread so the first request holds the only slot
    small_server.workers[0].async_engine._executor.submit(gate.wait, 30)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, url, content=body(), headers=JSON, timeout=30)
        assert wait_until(lambda: small_server.router.in_flight == 1)
        refused = httpx.post(url, content=body(), headers=JSON, timeout=30)
        gate.set()
        assert first.result().status_code == 200
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "3"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert wait_until(lambda: small_server.router.in_flight == 0)
    assert httpx.post(url, content=body(), headers=JSON, timeout=30).status_code == 200
    small_server.call(small_server.clients[0].close())  # the only worker goes away
    gone = httpx.post(url, content=body(), headers=JSON, timeout=30)
    assert gone.status_code == 503 and gone.json()["error"]["code"] == "no_healthy_worker"
    health = httpx.get(f"http://127.0.0.1:{small_server.http_port}/health", timeout=30)
    assert health.status_code == 503
