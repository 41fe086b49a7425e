"""The serving benchmarks on the tiny model: the load generator (`benchmarks/loadgen.py`)
against a real local server, a handful of streamed requests, Poisson and all-at-once, and the
report a user reads; and a tiny `serving.py --layers` sweep (offline engine, in-process servers,
transformers; the Ray layer is left to a run by hand: it starts a Ray of its own)."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from cluster.local_server import LocalServeConfig, LocalServer
from tests.benchmarks.conftest import import_benchmark


@pytest.fixture(scope="module")
def loadgen():
    yield from import_benchmark("loadgen")


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


def test_mixed_workload_puts_long_prompts_among_short_ones(loadgen):
    specs = loadgen.make_workload("mixed", 8, 8, 5, 512, long_input_len=40, long_output_len=2,
                                  long_fraction=0.25)
    assert [s.kind for s in specs] == ["short", "short", "short", "long"] * 2
    assert {len(s.prompt) for s in specs if s.kind == "long"} == {40}
    assert all(0 <= t < 512 for s in specs for t in s.prompt)
    with pytest.raises(ValueError, match="workload must be random or mixed, got 'bursty'"):
        loadgen.make_workload("bursty", 1, 1, 1, 512)


@pytest.mark.parametrize("rate", [math.inf, 20.0])
def test_report_of_a_short_run(loadgen, server, rate):
    specs = loadgen.make_workload("mixed", 6, 8, 5, 512, long_input_len=40, long_output_len=3,
                                  long_fraction=0.5)
    results, duration = asyncio.run(loadgen.run_load(
        f"http://127.0.0.1:{server.http_port}", server.router.model_name, specs, rate,
        max_concurrency=4))
    report = loadgen.summarize(results, duration, slo_ttft_ms=60_000, slo_tpot_ms=1e-6)
    assert report["completed"] == 6 and report["failed"] == 0, report["errors"]
    assert sum(r.output_tokens for r in results) == 3 * 5 + 3 * 3
    for metric in ("ttft", "tpot", "itl", "e2e"):
        assert set(report[metric]) == {"p50_ms", "p90_ms", "p99_ms", "mean_ms"}
        assert 0 < report[metric]["p50_ms"] <= report[metric]["p99_ms"]
    assert report["ttft"]["p99_ms"] <= report["e2e"]["p99_ms"]
    assert report["request_throughput"] > 0 and report["output_throughput"] > 0
    assert report["goodput"] == 0 and report["slo"]["met_fraction"] == 0  # TPOT SLO unmeetable
    assert server.router.counters.num_disaggregated >= 3  # the long prompts were handed off


def test_failures_are_reported_not_raised(loadgen, server):
    specs = [loadgen.RequestSpec([1, 2, 3], 4, "short")]
    results, duration = asyncio.run(loadgen.run_load(
        f"http://127.0.0.1:{server.http_port}", "no-such-model", specs, math.inf))
    report = loadgen.summarize(results, duration)
    assert report["failed"] == 1 and "HTTP 404" in report["errors"][0]


def test_plot_is_written(loadgen, tmp_path):
    result = loadgen.RequestResult("short", ok=True, ttft_s=0.01, latency_s=0.05,
                                   itl_s=[0.01, 0.02], output_tokens=3)
    path = loadgen.plot([("run", [result])], tmp_path / "serving.png", "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_request_not_started_within_the_time_limit_is_not_sent(loadgen, server):
    specs = [loadgen.RequestSpec([11, 12, 13], 2) for _ in range(3)]
    results, duration = asyncio.run(loadgen.run_load(
        f"http://127.0.0.1:{server.http_port}", server.router.model_name, specs, math.inf,
        max_concurrency=1, time_limit_s=0.0))
    report = loadgen.summarize(results, duration)
    assert report["completed"] == 0 and report["errors"] == [loadgen.SKIPPED]


def test_layers_sweep_compares_every_layer_on_the_same_requests(serving, tiny_model, tmp_path):
    out = tmp_path / "layers.json"
    result = serving.main(["--layers", "offline,transformers,inprocess_agg,inprocess,inprocess_ppw",
                           "--models", f"tiny={tiny_model}",
                           "--concurrency", "1,2", "--num-prompts", "3", "--input-len", "24",
                           "--output-len", "4", "--disagg-threshold", "16", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    tiny = result["models"]["tiny"]
    assert tiny["errors"] == {}
    for layer, levels in tiny["levels"].items():
        for c, run in levels.items():
            assert run["completed"] == run["requests"] == 3 and run["failed"] == 0, (layer, c)
            assert run["output_throughput"] > 0
    assert set(tiny["levels"]["transformers"]) == {2}  # the largest concurrency only
    assert tiny["levels"]["offline"][2]["output_tokens"] == 3 * 4
    servers = ("inprocess", "inprocess_agg", "inprocess_ppw")
    throughput = {f"tiny_{a}_vs_offline_c{c}_ratio" for a in servers for c in (1, 2)}
    throughput |= {f"tiny_inprocess_ppw_vs_inprocess_c{c}_ratio" for c in (1, 2)}
    throughput |= {f"tiny_{a}_vs_transformers_ratio" for a in ("offline", *servers)}
    assert throughput <= set(result) and all(result[k] > 0 for k in throughput)
    latency = {f"tiny_{a}_{m}_p50_vs_offline_step_ratio" for a in servers
               for m in ("itl", "tpot")}  # may be None: an ITL p50 that rounds to 0 ms
    assert latency <= set(result)
    assert "tiny_ray_vs_inprocess_c1_ratio" not in result  # ray did not run
    measured = 0
    for a in servers:  # each server's CPU per token: its processes' and the load generator's
        for c, run in tiny["levels"][a].items():
            cpu = run["cpu_us_per_token"]
            assert cpu["server"] >= 0 and cpu["loadgen"] >= 0, (a, c, cpu)
            assert cpu["total"] == pytest.approx(sum(cpu.values()) - cpu["total"], abs=0.2)
            # /proc counts 10 ms ticks: a run of 3 tiny requests may read none (no bound then)
            ratio = result[f"tiny_{a}_c{c}_tokens_vs_cpu_bound_ratio"]
            assert (ratio is None) == (cpu["total"] == 0) and (ratio is None or ratio > 0)
            measured += cpu["server"] > 0
    assert measured > 0  # the sweep read its servers' CPU


def test_layers_flag_names_the_unknown_layer(serving, capsys):
    with pytest.raises(SystemExit):
        serving.parse_args(["--layers", "offline,gpu"])
    assert "unknown ['gpu']" in capsys.readouterr().err
