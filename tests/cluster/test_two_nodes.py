"""Two Ray nodes on one machine (`ray.cluster_utils.Cluster`): the prefill pool on one, the
decode pool on the other, so every handoff's KV crosses nodes over the configured transport;
the prefill replica is a TP=2 worker group (its ranks Ray actors in the replica's placement
group, on the prefill node), so the KV is also resharded (2 ranks -> 1)."""

from __future__ import annotations

import openai
import pytest

from tests.cluster.conftest import app_config, directory_entries, router_status

pytestmark = pytest.mark.timeout(600)

PROMPT = "a prompt long enough to be prefilled on the prefill pool, " * 6


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "resources": {"node_prefill": 100}, "include_dashboard": False,
        "object_store_memory": 128 * 1024**2})
    cluster.add_node(num_cpus=4, resources={"node_decode": 100},
                     object_store_memory=128 * 1024**2)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


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
               "decode": {**pool, "resources": {"node_decode": 1}}}))
    # Serve's proxy in front of the router (the Kubernetes mode); test_ray_app covers direct
    config = config.model_copy(update={"router": config.router.model_copy(
        update={"ingress": "serve"})})
    deploy(config, proxy_location="HeadOnly")
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{config.router.http_port}/v1",
                      api_key="unused", max_retries=0, timeout=60)
    out = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.0,
                               extra_body={"ignore_eos": True})
    expected = LLM(tiny_model).generate([PROMPT], SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True))[0].outputs[0].text
    assert out.choices[0].text == expected
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
