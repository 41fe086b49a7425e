"""Two Ray nodes on one machine (`ray.cluster_utils.Cluster`): the prefill pool on one, the
decode pool (two replicas) on the other, so every handoff's KV crosses nodes over the
configured transport; the prefill replica is a TP=2 worker group (its ranks Ray actors in the
replica's placement group, on the prefill node), so the KV is also resharded (2 ranks -> 1).
A burst of 16 streams sent at once spreads over both decode workers (`router.decode_policy`).
Tracing is on (the `OTEL_*` variables every node's processes inherit, an OTLP/HTTP receiver
started here): the first request is one trace under the client's `traceparent`, from the
router through the prefill replica's ranks' KV offer to the other node's pull and decode."""

from __future__ import annotations

import re
import threading

import httpx
import openai
import pytest

from tests.cluster.conftest import app_config, directory_entries, router_status, wait_for
from tests.otlp_receiver import Receiver

pytestmark = pytest.mark.timeout(600)

PROMPT = "a prompt long enough to be prefilled on the prefill pool, " * 6
TRACE_ID, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    receiver = Receiver()
    with pytest.MonkeyPatch.context() as env:  # seen by every process the nodes start
        env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint)
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # ms between a process's exports
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 4, "resources": {"node_prefill": 100}, "include_dashboard": False,
            "object_store_memory": 128 * 1024**2})
        cluster.add_node(num_cpus=4, resources={"node_decode": 100},
                         object_store_memory=128 * 1024**2)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.receiver = receiver
    yield cluster
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()
    receiver.shutdown()


@pytest.mark.parametrize("transport", ["tcp"])
def test_the_kv_crosses_nodes_from_the_prefill_to_the_decode_pool(two_nodes, tiny_model,
                                                                  transport):
    import ray

    from cluster.config import CleaveConfig
    from cluster.launch import deploy
    from workers import LLM, SamplingParams

    pool = {"cpus_per_rank": 0.5, "engine": {"num_blocks": 256}}
    config = CleaveConfig.parse(app_config(
        tiny_model, kv_transfer={"transport": transport},
        pools={"prefill": {**pool, "tp": 2, "resources": {"node_prefill": 1}},
               "decode": {**pool, "resources": {"node_decode": 1},
                          "replicas": {"min": 2, "max": 2}}}))
    # Serve's proxy in front of the router (the Kubernetes mode); test_ray_app covers direct
    config = config.model_copy(update={"router": config.router.model_copy(
        update={"ingress": "serve"})})
    deploy(config, proxy_location="HeadOnly")
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{config.router.http_port}/v1",
                      api_key="unused", max_retries=0, timeout=60)
    out = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.0,
                               extra_body={"ignore_eos": True},
                               extra_headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
    expected = LLM(tiny_model).generate([PROMPT], SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True))[0].outputs[0].text
    assert out.choices[0].text == expected
    wait_for(lambda: sum(w["role"] == "decode" and w["healthy"]
                         for w in router_status()["workers"]) == 2, 120, "two decode workers")
    status = router_status()
    nodes = {w["role"]: w["node_id"] for w in status["workers"]}
    assert nodes["prefill"] != nodes["decode"]
    assert status["num_disaggregated"] == 1 and not status["fallbacks"]
    prefill = next(e for e in directory_entries() if e.pool == "prefill")
    info = ray.get(prefill.actor.ready.remote(), timeout=60)
    ranks = info.ranks  # Ray actors, each in its bundle of the replica's placement group
    assert [r.rank for r in ranks] == [0, 1]
    assert {r.node_id for r in ranks} == {nodes["prefill"]}
    assert len({r.pid for r in ranks} | {info.pid}) == 3
    assert len({r.placement_group_id for r in ranks}) == 1 and ranks[0].placement_group_id
    _one_trace_across_both_nodes(two_nodes.receiver)
    _burst_spreads_over_both_decode_workers(c, f"http://127.0.0.1:{config.router.http_port}")


def _one_trace_across_both_nodes(receiver: Receiver) -> None:
    """The first request's spans, exported by the router's, the prefill replica's and a
    decode replica's processes: one trace under the client's span, the KV offer and pull with
    their bytes, the decode worker's first step and stream."""
    names = {"router.start", "router.route", "router.prefill_call", "worker.prefill",
             "worker.kv_offer", "worker.kv_pull", "worker.first_step", "worker.stream"}

    def traced() -> dict:
        spans = {s.name: s for s in list(receiver.spans) if s.trace_id.hex() == TRACE_ID}
        return spans if names <= set(spans) else {}

    spans = wait_for(traced, 60, "the first request's spans from every process")
    front = [s for s in spans.values() if s.parent_span_id.hex() == CLIENT_SPAN]
    assert len(front) == 1 and front[0].span_id == spans["router.start"].parent_span_id
    attrs = {name: {a.key: a.value for a in s.attributes} for name, s in spans.items()}
    for name in ("worker.kv_offer", "worker.kv_pull"):
        assert attrs[name]["kv.bytes"].int_value > 0, attrs[name]
        assert attrs[name]["kv.transport"].string_value == "tcp"
    assert spans["worker.kv_offer"].parent_span_id == spans["worker.prefill"].span_id
    route = attrs["router.route"]
    assert route["prefill_worker"].string_value != route["decode_worker"].string_value
    assert attrs["worker.stream"]["worker"].string_value == route["decode_worker"].string_value


def _decode_successes(base_url: str) -> dict[str, float]:
    """Requests each decode worker streamed to the end, from the router's /metrics."""
    counts: dict[str, float] = {}
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    for labels, value in re.findall(r"^cleave_requests_total\{(.*)\} (\S+)$", text, re.M):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if fields.get("pool") == "decode" and fields.get("status") == "success":
            counts[fields["worker"]] = counts.get(fields["worker"], 0.0) + float(value)
    return counts


def _burst_spreads_over_both_decode_workers(c: openai.OpenAI, base_url: str) -> None:
    """16 streams sent at once (each choosing its decode worker while the prefills run):
    8 +- 2 on each decode worker, not all on the one that looked idle first."""
    before = _decode_successes(base_url)
    go = threading.Barrier(16)
    errors: list[str] = []

    def one(i: int) -> None:
        go.wait(60)
        try:
            chunks = c.completions.create(model="tiny", prompt=f"stream {i}: {PROMPT}",
                                          max_tokens=8, stream=True,
                                          extra_body={"ignore_eos": True})
            assert sum(len(ch.choices[0].text) > 0 for ch in chunks if ch.choices) > 0
        except Exception as exc:  # reported by the test
            errors.append(repr(exc))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors[:3]
    after = _decode_successes(base_url)
    spread = sorted(after[w] - before.get(w, 0.0) for w in after)
    assert len(spread) == 2 and sum(spread) == 16 and all(6 <= n <= 10 for n in spread), spread
