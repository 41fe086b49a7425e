"""The deadlines benchmark (`benchmarks/deadlines.py`) in miniature: one short round of
requests with and without a TTFT target against two in-process servers of the tiny model, one
queueing earliest deadline first and one in arrival order; the summary's keys, and its counts
adding up (every tight request met, late, refused or failed; the prompt tokens the worker
prefilled are exactly the admitted requests'). No timing threshold."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.local_server import LocalServeConfig, LocalServer
from tests.benchmarks.conftest import import_benchmark


@pytest.fixture(scope="module")
def deadlines():
    yield from import_benchmark("deadlines")


def test_a_short_round_on_each_policy_is_summarized_with_counts_that_add_up(deadlines, tiny_model):
    load = deadlines.Load(rate=20.0, seconds=1.0, tight_fraction=0.5, tight_ms=1.0, prompt_len=48,
                          tight_prompt_len=16, output_len=4, seed=0)
    runs = {}
    for policy in deadlines.POLICIES:
        srv = LocalServer(LocalServeConfig(tiny_model, num_workers=1, http_port=0, grpc_port=0,
                                           engine={"scheduling_policy": policy})).start()
        try:
            url = f"http://127.0.0.1:{srv.http_port}"
            runs[policy] = [deadlines.measure(
                url, dataclasses.replace(load, model=srv.router.model_name))]
        finally:
            srv.stop()
    result = deadlines._summary(runs)
    for policy in deadlines.POLICIES:
        r = result[policy]
        assert r["tight_sent"] > 0 and r["background_sent"] > 0, r
        assert r["tight_sent"] == (r["tight_met"] + r["tight_late"] + r["tight_refused"]
                                   + r["tight_failed"]), r
        assert r["tight_failed"] == r["background_failed"] == r["background_refused"] == 0, r
        assert r["met_rate"] == round(r["tight_met"] / r["tight_sent"], 4)
        assert r["admitted_prompt_tokens"] > 0 and r["refused_before_prefill"], r
    assert result["fcfs"]["tight_sent"] == result["deadline"]["tight_sent"]  # same arrivals
    # a 1 ms target is refused (once the worker has measured its prefill rate) or late
    assert sum(result[p]["tight_met"] for p in deadlines.POLICIES) == 0
    assert "deadline_vs_fcfs_met_ratio" in result
