"""The Cleave application on a local Ray with a TP=2 prefill replica and a TP=2 decode replica:
every rank an actor of its replica's placement group, each handing off (or pulling) its own
shard of the KV cache through its own agent. A long prompt goes prefill -> decode and the
OpenAI client gets the offline engine's greedy text; afterwards no worker holds a lease or a
handed-off request."""

from __future__ import annotations

import openai
import pytest

from tests.cluster.conftest import app_config, directory_entries, router_status, wait_for

pytestmark = pytest.mark.timeout(600)

PROMPT = "the quick brown fox jumps over the lazy dog and keeps running far away " * 3
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def app(local_ray, tiny_model):
    from cluster.config import CleaveConfig
    from cluster.launch import deploy

    pool = {"tp": 2, "cpus_per_rank": 0.25, "engine": {"num_blocks": 128}}
    config = CleaveConfig.parse(app_config(tiny_model, pools={"prefill": pool,
                                                              "decode": dict(pool)}))
    deploy(config)
    yield config


def test_tp2_prefill_and_decode_replicas_hand_off_from_every_rank(app, tiny_model):
    import ray

    from workers import LLM, SamplingParams

    want = LLM(tiny_model).generate([PROMPT], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0].outputs[0].text
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{app.router.http_port}/v1", api_key="unused",
                      max_retries=0, timeout=120)
    for stream in (False, True):
        kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                      extra_body={"ignore_eos": True})
        if stream:
            text = "".join(chunk.choices[0].text for chunk in
                           c.completions.create(stream=True, **kwargs) if chunk.choices)
        else:
            text = c.completions.create(**kwargs).choices[0].text
        assert text == want
    assert router_status()["num_disaggregated"] >= 1

    def idle() -> bool:
        entries = directory_entries()
        assert {e.pool for e in entries} == {"prefill", "decode"}
        return all(not any(ray.get(e.actor.resources.remote(), timeout=30).values())
                   for e in entries)

    wait_for(idle, 30, "every lease and held request to end")
