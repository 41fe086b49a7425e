"""benchmarks/serving.py's load generator against a real local server on the tiny model: a
handful of streamed requests, Poisson and all-at-once, and the report a user reads."""

from __future__ import annotations

import asyncio
import math

import pytest

from cluster.local_server import LocalServeConfig, LocalServer
from tests.benchmarks.conftest import import_benchmark


@pytest.fixture(scope="module")
def serving():
    yield from import_benchmark("serving")


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = LocalServer(LocalServeConfig(
        tiny_model, num_prefill_workers=1, num_decode_workers=1, http_port=0, grpc_port=0,
        router={"disagg_threshold_tokens": 24}, engine={"num_blocks": 96})).start()
    yield srv
    srv.stop()


def test_mixed_workload_puts_long_prompts_among_short_ones(serving):
    specs = serving.make_workload("mixed", 8, 8, 5, 512, long_input_len=40, long_output_len=2,
                                  long_fraction=0.25)
    assert [s.kind for s in specs] == ["short", "short", "short", "long"] * 2
    assert {len(s.prompt) for s in specs if s.kind == "long"} == {40}
    assert all(0 <= t < 512 for s in specs for t in s.prompt)
    with pytest.raises(ValueError, match="workload must be random or mixed, got 'bursty'"):
        serving.make_workload("bursty", 1, 1, 1, 512)


@pytest.mark.parametrize("rate", [math.inf, 20.0])
def test_report_of_a_short_run(serving, server, rate):
    specs = serving.make_workload("mixed", 6, 8, 5, 512, long_input_len=40, long_output_len=3,
                                  long_fraction=0.5)
    results, duration = asyncio.run(serving.run_load(
        f"http://127.0.0.1:{server.http_port}", server.router.model_name, specs, rate,
        max_concurrency=4))
    report = serving.summarize(results, duration, slo_ttft_ms=60_000, slo_tpot_ms=1e-6)
    assert report["completed"] == 6 and report["failed"] == 0, report["errors"]
    assert sum(r.output_tokens for r in results) == 3 * 5 + 3 * 3
    for metric in ("ttft", "tpot", "itl", "e2e"):
        assert set(report[metric]) == {"p50_ms", "p90_ms", "p99_ms", "mean_ms"}
        assert 0 < report[metric]["p50_ms"] <= report[metric]["p99_ms"]
    assert report["ttft"]["p99_ms"] <= report["e2e"]["p99_ms"]
    assert report["request_throughput"] > 0 and report["output_throughput"] > 0
    assert report["goodput"] == 0 and report["slo"]["met_fraction"] == 0  # TPOT SLO unmeetable
    assert server.router.counters.num_disaggregated >= 3  # the long prompts were handed off


def test_failures_are_reported_not_raised(serving, server):
    specs = [serving.RequestSpec([1, 2, 3], 4, "short")]
    results, duration = asyncio.run(serving.run_load(
        f"http://127.0.0.1:{server.http_port}", "no-such-model", specs, math.inf))
    report = serving.summarize(results, duration)
    assert report["failed"] == 1 and "HTTP 404" in report["errors"][0]


def test_plot_is_written(serving, tmp_path):
    result = serving.RequestResult("short", ok=True, ttft_s=0.01, latency_s=0.05,
                                   itl_s=[0.01, 0.02], output_tokens=3)
    path = serving.plot([("run", [result])], tmp_path / "serving.png", "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
