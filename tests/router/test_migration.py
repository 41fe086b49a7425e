"""A worker lost mid-stream: the request migrates to another decode-capable worker, and the
client's stream goes on with no token repeated or missing (greedy: exactly the undisturbed
output)."""

from __future__ import annotations

import itertools
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from cluster.local_server import LocalServer
from tests.router.conftest import API_KEY, NUM_BLOCKS, slow_steps, start_pools, wait_until
from tests.schemas import random_schema

STEP_DELAY_S = 0.01  # slows every engine step, so a stream is still running when its worker dies
MAX_TOKENS = 40
_words = itertools.count()


def fresh_prompt() -> str:
    """~40 tokens no worker has cached."""
    return " ".join(f"m{next(_words)}" for _ in range(30))


def start(model: str, **serve: object) -> LocalServer:
    return slow_steps(start_pools(model, threshold=24, **serve), STEP_DELAY_S)


@pytest.fixture(params=["aggregated", "disaggregated"])
def srv(request, tiny_model):
    layout = ({"num_workers": 2} if request.param == "aggregated"
              else {"num_prefill_workers": 1, "num_decode_workers": 2})
    server = start(tiny_model, **layout)
    yield server
    server.stop()


def stream_chunks(srv: LocalServer, prompt: str):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key=API_KEY,
                           timeout=60, max_retries=0)
    return client.completions.create(model=srv.router.model_name, prompt=prompt,
                                     max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})


def complete(srv: LocalServer, prompt: str) -> str:
    return "".join(c.choices[0].text for c in stream_chunks(srv, prompt))


def streaming_worker(srv: LocalServer):
    """The decode-capable client with the most requests running."""
    clients = [c for c in srv.clients if c.channel.worker.role != "prefill"]
    return max(clients, key=lambda c: srv.call(c.stats()).num_running)


def failures(srv: LocalServer) -> int:
    return srv.router.counters.fallbacks.get("decode_worker_failed", 0)


def break_engine(client) -> None:
    """The worker's next step raises (it stays reachable; every request on it fails)."""
    def broken():
        raise RuntimeError("the GPU fell off the bus")

    client.channel.worker.engine.step = broken


@pytest.mark.parametrize("kill", ["close", "engine_error"])
def test_stream_migrates_when_its_worker_dies(srv, kill):
    prompt = fresh_prompt()
    expected = complete(srv, prompt)
    chunks = stream_chunks(srv, prompt)
    text = "".join(c.choices[0].text for c in itertools.islice(chunks, 3))
    victim = streaming_worker(srv)
    assert srv.call(victim.stats()).num_running == 1  # the stream is mid-way there
    if kill == "close":
        srv.call(victim.close())
    else:
        break_engine(victim)
    text += "".join(c.choices[0].text for c in chunks)
    assert text == expected and text
    assert failures(srv) == 1
    survivors = [c for c in srv.clients if c is not victim]
    assert wait_until(lambda: all(srv.call(c.stats()).num_free_blocks == NUM_BLOCKS
                                  for c in survivors), 10.0)


def test_concurrent_streams_all_finish_identically_after_a_worker_dies(srv):
    prompts = [fresh_prompt() for _ in range(32)]  # the 32 concurrent streams
    with ThreadPoolExecutor(len(prompts)) as pool:
        expected = list(pool.map(lambda p: complete(srv, p), prompts))
    started = threading.Semaphore(0)

    def run(prompt: str) -> str:
        chunks = stream_chunks(srv, prompt)
        text = "".join(c.choices[0].text for c in itertools.islice(chunks, 2))
        started.release()
        return text + "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(run, p) for p in prompts]
        for _ in prompts:
            assert started.acquire(timeout=30)
        victim = streaming_worker(srv)
        stats = srv.call(victim.stats())
        on_victim = stats.num_running + stats.num_waiting  # queued ones move too
        assert stats.num_running >= 1
        srv.call(victim.close())
        got = [f.result(timeout=60) for f in futures]
    assert got == expected
    assert 1 <= failures(srv) <= on_victim


def test_stream_ends_with_an_error_when_no_worker_is_left(tiny_model):
    server = start(tiny_model, num_workers=2)
    try:
        chunks = stream_chunks(server, fresh_prompt())
        assert len(list(itertools.islice(chunks, 3))) == 3
        for client in server.clients:  # the streaming worker, and the one it would move to
            break_engine(client)
        with pytest.raises(openai.APIError):
            list(chunks)
        assert failures(server) == 1  # moved once; the second failure left nowhere to go
    finally:
        server.stop()


def test_a_structured_stream_migrates_and_stays_valid(srv):
    """A JSON-schema stream whose worker dies goes on elsewhere with its grammar's state rebuilt
    from the tokens sent: the same text as undisturbed, valid against the schema."""
    schema = random_schema(11)
    prompt = fresh_prompt()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key=API_KEY,
                           timeout=60, max_retries=0)

    def chunks():
        return client.completions.create(
            model=srv.router.model_name, prompt=prompt, max_tokens=300, temperature=0,
            stream=True, extra_body={"structured_outputs": {"json": schema}})

    expected = "".join(c.choices[0].text for c in chunks())
    stream = chunks()
    text = "".join(c.choices[0].text for c in itertools.islice(stream, 3))
    victim = streaming_worker(srv)
    assert srv.call(victim.stats()).num_running == 1
    srv.call(victim.close())
    text += "".join(c.choices[0].text for c in stream)
    assert text == expected
    jsonschema.validate(json.loads(text), schema)
    assert failures(srv) == 1


def test_a_stream_of_several_seeded_samples_migrates_with_each_sample_unchanged(tiny_model):
    """n=3 seeded: the worker dies once every choice has text; each choice goes on from its own
    sent tokens on the survivor, with the undisturbed run's text (a seeded draw depends only on
    the seed, the sample and the position)."""
    server = start(tiny_model, num_workers=2)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                           api_key=API_KEY, timeout=60, max_retries=0)
    prompt = fresh_prompt()

    def chunks():
        return client.completions.create(
            model=server.router.model_name, prompt=prompt, max_tokens=MAX_TOKENS, n=3,
            temperature=1.0, seed=5, stream=True, extra_body={"ignore_eos": True})

    def add(texts: list[str], chunk) -> None:
        for c in chunk.choices:
            texts[c.index] += c.text

    try:
        expected = [""] * 3
        for chunk in chunks():
            add(expected, chunk)
        assert len(set(expected)) == 3  # sampled: three different choices
        got = [""] * 3
        stream = iter(chunks())
        while not all(got):
            add(got, next(stream))
        victim = streaming_worker(server)
        assert server.call(victim.stats()).num_running == 3
        server.call(victim.close())
        for chunk in stream:
            add(got, chunk)
        assert got == expected
        assert failures(server) == 1
    finally:
        server.stop()
