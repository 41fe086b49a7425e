"""`GET /metrics` on a real server: what a user would check on a dashboard after sending real
requests over HTTP and gRPC (counts by status, TTFT, tokens, worker load, KV handoffs, fallbacks),
and that the Grafana dashboard asks only for metrics the server exposes."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.proto.cleave.v1 import generate_pb2 as pb
from router.proto.cleave.v1 import generate_pb2_grpc as pb_grpc
from cluster.local_server import LocalServer
from tests.router.conftest import API_KEY, start_pools, start_server, wait_until

AUTH = {"Authorization": f"Bearer {API_KEY}"}
DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "cleave-dashboard.json"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
                                                             "_created")}
_words = itertools.count()


def long_prompt() -> str:
    return " ".join(f"q{next(_words)}" for _ in range(30))


def scrape(srv: LocalServer) -> dict[str, dict[tuple, float]]:
    """Sample name -> {sorted label items: value}."""
    text = httpx.get(f"http://127.0.0.1:{srv.http_port}/metrics", headers=AUTH, timeout=10).text
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def total(samples: dict[str, dict[tuple, float]], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for k, v in samples.get(name, {}).items() if want <= set(k))


def client_of(srv: LocalServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key=API_KEY,
                         timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = start_server(tiny_model)
    yield srv
    srv.stop()


def test_requests_ttft_and_tokens_are_counted(server):
    before = scrape(server)
    client = client_of(server)
    chunks = list(client.completions.create(
        model=server.router.model_name, prompt="hello there", max_tokens=5, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert 1 <= len([c for c in chunks if c.choices]) <= 5  # tokens here at once share a chunk
    assert chunks[-1].usage.completion_tokens == 5
    out = client.chat.completions.create(model=server.router.model_name, max_tokens=4,
                                         messages=[{"role": "user", "content": "hi"}],
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.router.model_name, prompt="x", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("cleave_requests_total", status="success", frontend="http", pool="both") == 2
    assert delta("cleave_requests_total", status="error", reason="bad_request") == 1
    assert delta("cleave_requests_total", status="error", reason="not_found") == 1
    assert delta("cleave_time_to_first_token_seconds_count") == 2
    assert delta("cleave_e2e_request_latency_seconds_count") == 2
    assert delta("cleave_time_per_output_token_seconds_count") == 2
    assert delta("cleave_inter_token_latency_seconds_count") == 4 + 3
    assert delta("cleave_generation_tokens_total") == 9
    assert delta("cleave_prompt_tokens_total") == (out.usage.prompt_tokens
                                                  + chunks[-1].usage.prompt_tokens)
    assert after["cleave_pool_workers"] == {(("pool", "both"),): 2.0}
    assert total(after, "cleave_worker_up") == 2
    assert set(after["cleave_worker_kv_usage"]) == {
        (("pool", "both"), ("worker", f"worker-{i}")) for i in range(2)}


def test_grpc_requests_are_counted(server):
    before = scrape(server)
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = pb_grpc.GenerationStub(channel)
        req = pb.GenerateRequest(text="hello", sampling=pb.SamplingParameters(max_tokens=3))
        list(stub.Generate(req, metadata=(("authorization", f"Bearer {API_KEY}"),),
                           timeout=30))
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(pb.GenerateRequest(), metadata=(("authorization",
                                                                 f"Bearer {API_KEY}"),),
                               timeout=30))
    after = scrape(server)
    assert total(after, "cleave_requests_total", frontend="grpc", status="success") \
        - total(before, "cleave_requests_total", frontend="grpc", status="success") == 1
    assert total(after, "cleave_requests_total", frontend="grpc", reason="bad_request") \
        - total(before, "cleave_requests_total", frontend="grpc", reason="bad_request") == 1


def test_a_client_gone_mid_stream_counts_as_cancelled(server):
    before = total(scrape(server), "cleave_requests_total", status="cancelled")
    stream = client_of(server).completions.create(
        model=server.router.model_name, prompt="hello", max_tokens=1000, stream=True,
        extra_body={"ignore_eos": True})
    assert len(list(itertools.islice(stream, 2))) == 2
    stream.close()
    assert wait_until(lambda: total(scrape(server), "cleave_requests_total",
                                    status="cancelled") == before + 1)


def test_handoff_bytes_and_fallbacks_of_a_disaggregated_server(tiny_model):
    srv = start_pools(tiny_model, threshold=24, num_prefill_workers=1, num_decode_workers=1)
    try:
        client = client_of(srv)
        complete = {"model": srv.router.model_name, "max_tokens": 4,
                    "extra_body": {"ignore_eos": True}}
        client.completions.create(prompt=long_prompt(), **complete)
        m = scrape(srv)
        assert total(m, "cleave_kv_handoff_seconds_count", worker="decode-0") == 1
        assert total(m, "cleave_kv_transfer_bytes_total", pool="decode") > 0
        assert total(m, "cleave_disaggregated_requests_total") == 1
        assert total(m, "cleave_time_to_first_token_seconds_count", pool="prefill") == 1
        assert total(m, "cleave_time_per_output_token_seconds_count", pool="decode") == 1

        prefill = next(c for c in srv.clients if c.worker_id == "prefill-0")
        srv.call(prefill.close())  # the prefill worker dies; the decode worker runs it all
        client.completions.create(prompt=long_prompt(), **complete)
        m = scrape(srv)
        assert total(m, "cleave_fallbacks_total", reason="no_prefill_worker") == 1
        assert total(m, "cleave_aggregated_requests_total", reason="no_prefill_worker") == 1
        assert total(m, "cleave_worker_up", worker="prefill-0") == 0
        assert total(m, "cleave_requests_total", status="success", pool="decode") == 2
    finally:
        srv.stop()


def exposed_names(samples: dict[str, dict[tuple, float]], text: str) -> set[str]:
    """Every sample name the server can expose: those it did, and for each declared family
    (even one with no sample yet) the names its type gives."""
    names = set(samples)
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + s for s in SUFFIXES.get(family.type, ()))
    return names


def test_dashboard_asks_only_for_exposed_metrics(server):
    text = httpx.get(f"http://127.0.0.1:{server.http_port}/metrics", headers=AUTH,
                     timeout=10).text
    names = exposed_names(scrape(server), text)
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "pool"} <= variables
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 7
    for expr in exprs:
        used = set(re.findall(r"\bcleave_[a-z0-9_]+", expr))
        assert used, f"a panel queries no Cleave metric: {expr}"
        assert used <= names, f"{sorted(used - names)} in {expr!r} are not exposed"
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("ttft", "tpot", "throughput", "kv", "queue", "failure", "prefix"):
        assert topic in titles, f"no panel about {topic}"
