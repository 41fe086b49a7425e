"""OpenTelemetry traces: one disaggregated chat request with tracing on (the standard `OTEL_*`
variables naming an OTLP/HTTP endpoint: a real HTTP server started here, decoding the
protobuf the SDK's exporter sends) is one trace under the client's `traceparent`, from the
front end through admission, routing (workers chosen, prefix hit), the prefill call and the
prefill worker's KV offer to the decode worker's KV pull with its bytes, its first step and
its stream. A migration is a span naming both workers. Off (no endpoint), no span is made."""

from __future__ import annotations

import httpx
import pytest

from cluster.local_server import LocalServeConfig, LocalServer
from tests.otlp_receiver import Receiver
from tests.router.conftest import API_KEY, NUM_BLOCKS
from workers.contract import tracing


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def traced(tiny_model, monkeypatch):
    receiver = Receiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint)
    tracing.set_tracing(None)  # made from the environment above on first use
    srv = LocalServer(LocalServeConfig(
        tiny_model, http_port=0, grpc_port=0, num_prefill_workers=1, num_decode_workers=1,
        router={"api_keys": (API_KEY,), "disagg_threshold_tokens": 8},
        engine={"num_blocks": NUM_BLOCKS})).start()
    try:
        yield srv, receiver
    finally:
        srv.stop()
        tracing.tracing().provider.shutdown()
        tracing.set_tracing(None)
        receiver.shutdown()


def test_one_disaggregated_request_is_one_trace_under_the_clients_span(traced):
    srv, receiver = traced
    resp = httpx.post(
        f"http://127.0.0.1:{srv.http_port}/v1/chat/completions", timeout=60,
        headers={"Authorization": f"Bearer {API_KEY}",
                 "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
        json={"messages": [{"role": "user", "content": "tell me a long story " * 4}],
              "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert srv.router.counters.num_disaggregated == 1
    assert tracing.tracing().provider.force_flush(10_000)
    spans = {s.name: s for s in receiver.spans}
    assert {"POST /v1/chat/completions", "router.start", "router.admission", "router.route",
            "router.prefill_call", "worker.prefill", "worker.kv_offer", "worker.kv_pull",
            "worker.first_step", "worker.stream", "router.stream"} <= set(spans)
    assert {s.trace_id.hex() for s in receiver.spans} == {TRACE_ID}
    parent = {name: s.parent_span_id.hex() for name, s in spans.items()}
    ids = {name: s.span_id.hex() for name, s in spans.items()}
    assert parent["POST /v1/chat/completions"] == CLIENT_SPAN
    assert parent["router.start"] == ids["POST /v1/chat/completions"]
    for name in ("router.admission", "router.route", "router.prefill_call"):
        assert parent[name] == ids["router.start"], name
    # the workers' spans continue the context their WorkerRequest carried
    for name in ("worker.prefill", "worker.kv_pull", "worker.first_step", "worker.stream"):
        assert parent[name] == ids["router.start"], name
    assert parent["worker.kv_offer"] == ids["worker.prefill"]
    assert parent["router.stream"] == ids["POST /v1/chat/completions"]
    attrs = {name: {a.key: a.value for a in s.attributes} for name, s in spans.items()}
    for name in ("worker.kv_offer", "worker.kv_pull"):  # the transfer's bytes and transport
        assert attrs[name]["kv.bytes"].int_value > 0 and attrs[name]["kv.transport"].string_value
    pull = spans["worker.kv_pull"]
    assert pull.end_time_unix_nano > pull.start_time_unix_nano  # its duration
    assert attrs["router.route"]["prefill_worker"].string_value == "prefill-0"
    assert attrs["router.route"]["decode_worker"].string_value == "decode-0"
    assert attrs["router.route"]["prefix_hit_tokens"].int_value == 0  # a new prompt
    assert attrs["router.start"]["worker"].string_value == "prefill-0"
    assert attrs["router.start"]["decode_worker"].string_value == "decode-0"
    assert attrs["worker.stream"]["worker"].string_value == "decode-0"
    assert attrs["worker.stream"]["tokens"].int_value == 3  # the first came from prefill
    assert attrs["router.stream"]["tokens"].int_value == 4
    assert attrs["router.stream"]["streamed_by"].string_value == "decode-0"
    # in order: routed, prefilled, transferred, then the decode worker's first step
    assert spans["router.route"].end_time_unix_nano <= \
        spans["worker.prefill"].start_time_unix_nano
    assert spans["worker.kv_offer"].end_time_unix_nano <= pull.end_time_unix_nano <= \
        spans["worker.first_step"].end_time_unix_nano


def test_off_without_an_endpoint(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    off = tracing.from_env()
    assert not off.on and off.traceparent() is None
    with off.span("x") as span:
        assert span is None
    assert not tracing.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318",
                                 "OTEL_SDK_DISABLED": "true"}).on


@pytest.fixture
def in_memory():
    """Tracing on, its finished spans kept in memory (`exporter.get_finished_spans()`)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_tracing(tracing.Tracing(provider))
    try:
        yield exporter
    finally:
        tracing.set_tracing(None)


def _routes(exporter) -> list[dict]:
    return [dict(s.attributes) for s in exporter.get_finished_spans() if s.name == "router.route"]


@pytest.mark.parametrize("num_tokens,split", [(40, True), (4, False)])
def test_routing_is_a_span_on_the_aggregated_path_as_on_the_disaggregated(in_memory, num_tokens,
                                                                          split):
    """Scripted fakes, one prefill and one decode-pool worker: a long prompt is split (one
    `router.route` naming both workers), a short one runs whole on the decode-pool worker (the
    split policy's `router.route`, then the aggregated path's own naming that worker); an
    aggregated deployment routes with one span naming its one worker."""
    from tests.router.fakes import FakeWorker, expected_tokens, orchestrator
    from tests.router.test_orchestrator import collect, request, run
    from workers.contract.protocol import WorkerRole

    async def go(*workers):
        o = await orchestrator(*workers)
        req = request(num_tokens=num_tokens)
        assert await collect(await o.generate(req)) == expected_tokens(req)

    run(go(FakeWorker("p0", WorkerRole.PREFILL), FakeWorker("d0", WorkerRole.DECODE)))
    routes = _routes(in_memory)
    if split:
        assert routes == [{"attempt": 0, "prefill_worker": "p0", "decode_worker": "d0",
                           "prefix_hit_tokens": 0, "run_here": "", "aggregated": False}]
    else:
        assert routes[-1] == {"attempt": 0, "prefill_worker": "d0", "decode_worker": "d0",
                              "prefix_hit_tokens": 0, "run_here": routes[0]["run_here"],
                              "aggregated": True}
        assert len(routes) == 2 and routes[0]["run_here"]
    in_memory.clear()
    run(go(FakeWorker("w0")))  # an aggregated deployment: no split decision at all
    assert _routes(in_memory) == [{"attempt": 0, "prefill_worker": "w0", "decode_worker": "w0",
                                   "prefix_hit_tokens": 0, "run_here": "", "aggregated": True}]


def test_a_migration_is_a_span_naming_both_workers(in_memory):
    """A decode worker lost mid-stream (scripted fakes): the move is one `router.migration`
    span, from the lost worker to the one that continued, with why."""
    from router.errors import WorkerUnavailableError
    from tests.router.fakes import FakeWorker, Script, expected_tokens, orchestrator
    from tests.router.test_orchestrator import collect, request, run
    from workers.contract.protocol import WorkerRole

    async def go():
        lost = WorkerUnavailableError("d0", "the process died")
        flaky = FakeWorker("d0", WorkerRole.DECODE, Script(stream_error=lost, error_after=2))
        other = FakeWorker("d1", WorkerRole.DECODE)
        o = await orchestrator(flaky, other, FakeWorker("p0", WorkerRole.PREFILL),
                               migration_retries=1)
        o.workers.note_routed("d1")  # d0 looks idler: the request starts there
        req = request(max_tokens=8)
        assert await collect(await o.generate(req)) == expected_tokens(req)

    run(go())
    (moved,) = [s for s in in_memory.get_finished_spans() if s.name == "router.migration"]
    assert dict(moved.attributes) == {"from_worker": "d0", "to_worker": "d1", "samples": 1,
                                      "reason": "WorkerUnavailableError"}
