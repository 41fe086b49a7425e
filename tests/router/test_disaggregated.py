"""Disaggregated serving through the real HTTP server: prefill workers hand each prompt's KV to a
decode worker over TCP on 127.0.0.1; the client sees exactly what aggregated serving gives."""

from __future__ import annotations

import itertools

import openai
import pytest

from cluster.local_server import LocalServer
from tests.router.conftest import API_KEY, NUM_BLOCKS, start_pools, wait_until
from workers.contract.messages import PrefillResult

THRESHOLD = 24  # tokens; the prompts below are longer, unless meant to be short
_words = itertools.count()


def long_prompt() -> str:
    """A prompt no worker has cached (so the policy's first choice is prefill-0), ~40 tokens."""
    return " ".join(f"w{next(_words)}" for _ in range(30))


def start(model: str, **serve: object) -> LocalServer:
    return start_pools(model, threshold=THRESHOLD,
                       worker={"lease_s": 10.0, "pull_timeout_s": 10.0}, **serve)


@pytest.fixture(scope="module")
def disagg(tiny_model):
    srv = start(tiny_model, num_prefill_workers=2, num_decode_workers=1)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def aggregated(tiny_model):
    srv = start(tiny_model, num_workers=1)
    yield srv
    srv.stop()


def client_of(srv: LocalServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key=API_KEY,
                         timeout=60, max_retries=0)


def complete(srv: LocalServer, prompt: str, stream: bool = False, max_tokens: int = 12) -> str:
    args = dict(model=srv.router.model_name, prompt=prompt, max_tokens=max_tokens,
                temperature=0, extra_body={"ignore_eos": True})
    if stream:
        return "".join(c.choices[0].text for c in
                       client_of(srv).completions.create(stream=True, **args))
    return client_of(srv).completions.create(**args).choices[0].text


def settled(srv: LocalServer) -> bool:
    """Every block of every worker free, and no lease left on any agent."""
    def leases() -> int:
        return sum(a.num_leases for w in srv.workers for a in w.transfer.started)

    return wait_until(lambda: all(srv.call(c.stats()).num_free_blocks == NUM_BLOCKS
                                  for c in srv.clients) and leases() == 0, 10.0)


def worker(srv: LocalServer, worker_id: str):
    return next(w for w in srv.workers if w.worker_id == worker_id)


@pytest.mark.parametrize("stream", [False, True])
def test_disaggregated_greedy_output_equals_aggregated(disagg, aggregated, stream):
    prompt = long_prompt()
    before = dict(disagg.router.counters.first_tokens_by_worker)
    got = complete(disagg, prompt, stream)
    assert got == complete(aggregated, prompt, stream) and got
    c = disagg.router.counters
    first_on = {w: n - before.get(w, 0) for w, n in c.first_tokens_by_worker.items()}
    assert first_on.get("prefill-0", 0) + first_on.get("prefill-1", 0) == 1
    assert c.decodes_by_worker["decode-0"] >= 1 and c.num_disaggregated >= 1
    assert "kv_pull_failed" not in c.fallbacks
    assert settled(disagg)


def test_chat_through_the_handoff_equals_aggregated(disagg, aggregated):
    content = long_prompt()

    def chat(srv: LocalServer) -> str:
        out = client_of(srv).chat.completions.create(
            model=srv.router.model_name, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": content}], extra_body={"ignore_eos": True})
        return out.choices[0].message.content

    n = disagg.router.counters.num_disaggregated
    assert chat(disagg) == chat(aggregated)
    assert disagg.router.counters.num_disaggregated == n + 1


def test_short_prompt_runs_aggregated_on_the_decode_worker(disagg):
    c = disagg.router.counters
    short_before = c.aggregated.get("short_prompt", 0)
    decode_first = c.first_tokens_by_worker.get("decode-0", 0)
    assert complete(disagg, "hi there", max_tokens=4)
    assert c.aggregated["short_prompt"] == short_before + 1
    assert c.first_tokens_by_worker["decode-0"] == decode_first + 1
    assert settled(disagg)


def test_kv_pull_failure_falls_back_to_prefill_on_the_decode_worker(disagg, aggregated,
                                                                   monkeypatch):
    prefill = worker(disagg, "prefill-0")
    real_prefill = prefill.prefill

    async def prefill_then_drop_the_lease(req, *args, **kwargs) -> PrefillResult:
        result = await real_prefill(req, *args, **kwargs)
        prefill.abort(req.request_id)  # the blocks are gone before the decode worker pulls
        return result

    monkeypatch.setattr(prefill, "prefill", prefill_then_drop_the_lease)
    failed = disagg.router.counters.fallbacks.get("kv_pull_failed", 0)
    for stream in (False, True):
        prompt = long_prompt()
        assert complete(disagg, prompt, stream) == complete(aggregated, prompt, stream)
    assert disagg.router.counters.fallbacks["kv_pull_failed"] == failed + 2
    assert settled(disagg)


def test_failing_prefill_worker_is_retried_then_bypassed(disagg, aggregated, monkeypatch):
    async def broken(*args, **kwargs) -> PrefillResult:
        raise RuntimeError("prefill worker crashed")

    c = disagg.router.counters
    monkeypatch.setattr(worker(disagg, "prefill-0"), "prefill", broken)
    errors = c.fallbacks.get("prefill_error", 0)
    prompt = long_prompt()
    assert complete(disagg, prompt) == complete(aggregated, prompt)
    assert c.fallbacks["prefill_error"] == errors + 1  # then prefill-1 served it

    monkeypatch.setattr(worker(disagg, "prefill-1"), "prefill", broken)
    failed = c.aggregated.get("prefill_failed", 0)
    prompt = long_prompt()
    assert complete(disagg, prompt) == complete(aggregated, prompt)
    assert c.fallbacks["prefill_error"] == errors + 3
    assert c.aggregated["prefill_failed"] == failed + 1  # ran whole on decode-0
    assert settled(disagg)


def test_client_gone_mid_stream_frees_both_workers_blocks(disagg):
    stream = client_of(disagg).completions.create(
        model=disagg.router.model_name, prompt=long_prompt(), max_tokens=1200, stream=True,
        temperature=0, extra_body={"ignore_eos": True})
    assert len(list(itertools.islice(stream, 3))) == 3  # the decode worker is streaming
    assert any(disagg.call(c.stats()).num_free_blocks < NUM_BLOCKS for c in disagg.clients)
    stream.close()
    assert settled(disagg)


def test_n_above_one_runs_aggregated(disagg):
    c = disagg.router.counters
    before = c.aggregated.get("unsupported_params", 0)
    out = client_of(disagg).completions.create(
        model=disagg.router.model_name, prompt=long_prompt(), max_tokens=3, n=2,
        extra_body={"ignore_eos": True})
    assert len(out.choices) == 2
    assert c.aggregated["unsupported_params"] == before + 1
    assert settled(disagg)
