"""The Cleave application on a local Ray: the official clients against the Serve deployment,
greedy outputs equal to the offline engine's, a replica killed mid-stream, autoscaling under a
burst and back (`test_ray_burst.py`), with no failed request anywhere."""

from __future__ import annotations

import threading

import grpc
import openai
import pytest

from tests.cluster.conftest import (
    app_config,
    directory_entries,
    router_status,
    running_replicas,
    wait_for,
)

pytestmark = pytest.mark.timeout(900)

LONG = "the quick brown fox jumps over the lazy dog and keeps running far away "  # > threshold
PROMPTS = ["Hello, my name is", LONG * 3, "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19",
           LONG * 6 + "finally"]
MAX_TOKENS = 24
LONG_MAX_TOKENS = 400  # streams long enough to still run when a replica is killed


def autoscaling(**targets):
    return {"upscale_delay_s": 0.5, "downscale_delay_s": 4.0, "metrics_interval_s": 0.5,
            "drain_timeout_s": 30.0, **targets}


@pytest.fixture(scope="module")
def app(local_ray, tiny_model):
    yield deploy_autoscaled_app(tiny_model)


def deploy_autoscaled_app(tiny_model: str, enable_lora: bool = True, waiting_tokens: int = 256,
                          running_seqs: int = 4):
    """1 prefill + 1 decode replica of the tiny model, each pool autoscaled up to 2."""
    from cluster.config import CleaveConfig
    from cluster.launch import deploy

    pool = {"cpus_per_rank": 0.25, "replicas": {"min": 1, "max": 2}}
    config = CleaveConfig.parse(app_config(tiny_model, pools={
        # a small token budget keeps prompts queued long enough to be seen by the autoscaler
        "prefill": {**pool, "engine": {"num_blocks": 256, "max_num_batched_tokens": 64,
                                       "enable_lora": enable_lora},
                    "autoscaling": autoscaling(target_waiting_tokens=waiting_tokens)},
        "decode": {**pool, "engine": {"num_blocks": 512, "enable_lora": enable_lora},
                   "autoscaling": autoscaling(target_running_seqs=running_seqs,
                                               target_kv_usage=0.9)}}))
    deploy(config)
    return config


@pytest.fixture(scope="module")
def expected(tiny_model):
    """What the offline engine writes for each prompt, greedily."""
    from workers import LLM, SamplingParams

    llm = LLM(tiny_model)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return {p: out.outputs[0].text for p, out in zip(PROMPTS, llm.generate(PROMPTS, params))}


@pytest.fixture(scope="module")
def expected_long(tiny_model):
    from workers import LLM, SamplingParams

    params = SamplingParams(max_tokens=LONG_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return {p: out.outputs[0].text
            for p, out in zip(PROMPTS, LLM(tiny_model).generate(PROMPTS, params))}


def client(config, timeout=60.0):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{config.router.http_port}/v1",
                         api_key="unused", max_retries=0, timeout=timeout)


def complete(c, prompt, stream=False):
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                  extra_body={"ignore_eos": True})
    if not stream:
        return c.completions.create(**kwargs).choices[0].text
    return "".join(chunk.choices[0].text for chunk in c.completions.create(stream=True, **kwargs)
                   if chunk.choices)


def test_the_openai_client_gets_the_offline_engines_greedy_output(app, expected):
    c = client(app)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    for prompt in PROMPTS:
        assert complete(c, prompt) == expected[prompt], prompt
        assert complete(c, prompt, stream=True) == expected[prompt], prompt
    status = router_status()
    # the long prompts went prefill -> decode once; repeated, the decode worker has them cached
    assert status["num_disaggregated"] >= 2
    assert status["aggregated"].get("short_prompt", 0) >= 4
    from cluster.status import cluster_status, format_status

    report = cluster_status()  # what `cleave status` prints
    assert set(report["deployments"]) == {"directory", "pool-prefill", "pool-decode", "router"}
    assert report["prefix_hit_rate"] is not None and report["prefix_hit_rate"] > 0
    text = format_status(report)
    assert "pool-decode" in text and "prefix hit" in text
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    scrape = httpx.get(f"http://127.0.0.1:{app.router.http_port}/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(scrape)}
    pools = {s.labels["pool"]: s.value for s in families["cleave_pool_workers"].samples}
    assert pools["prefill"] >= 1 and pools["decode"] >= 1
    assert sum(s.value for s in families["cleave_requests"].samples
               if s.name == "cleave_requests_total" and s.labels["status"] == "success") > 0
    chat = c.chat.completions.create(model="tiny", max_tokens=4,
                                     messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="x", max_tokens=1)


def test_structured_output_and_a_forced_tool_call_through_the_ray_app(app):
    """The constraint rides in the request record to every engine actor: a JSON schema holds
    whether the prompt is handed off (long) or not (short), and a forced call is a valid one."""
    import json

    import jsonschema

    from tests.schemas import random_schema

    c = client(app)
    for seed, prompt in ((1, "json please"), (2, LONG * 4 + "as json")):
        before = router_status()["num_disaggregated"]
        schema = random_schema(seed)
        out = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=300,
            temperature=0, response_format={"type": "json_schema",
                                            "json_schema": {"name": "s", "schema": schema}})
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    assert router_status()["num_disaggregated"] == before + 1  # the long one was handed off
    params = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}}, "required": ["n"]}
    out = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=60,
        temperature=0, tools=[{"type": "function", "function": {"name": "count",
                                                                "parameters": params}}],
        tool_choice="required")
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "count"
    jsonschema.validate(json.loads(call.function.arguments), params)


def test_a_lora_adapter_loaded_served_and_unloaded_through_the_ray_app(app, tiny_model,
                                                                       tmp_path):
    """Through the router replica, on the prefill and the decode worker both: the long prompt
    is split between them and decodes under the adapter as the offline LLM does."""
    import httpx

    from workers import LLM, SamplingParams
    from workers.models.lora.make_adapter import make_adapter

    folder = make_adapter(tiny_model, tmp_path / "sql", rank=8, seed=1)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = LLM(tiny_model, enable_lora=True, lora_modules=(f"sql={folder}",)).generate(
        [PROMPTS[1]], params, lora_name="sql")[0].outputs[0].text
    url, c = f"http://127.0.0.1:{app.router.http_port}/v1", client(app)
    load = httpx.post(f"{url}/load_lora_adapter", timeout=60,
                      json={"lora_name": "sql", "lora_path": str(folder)})
    assert load.status_code == 200, load.text
    assert [(m.id, m.parent) for m in c.models.list().data] == [("tiny", None), ("sql", "tiny")]
    split = router_status()["num_disaggregated"]
    got = c.completions.create(model="sql", prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                               temperature=0.0, extra_body={"ignore_eos": True})
    assert got.choices[0].text == want
    assert router_status()["num_disaggregated"] == split + 1
    gone = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "sql"}, timeout=60)
    assert gone.status_code == 200, gone.text
    with pytest.raises(openai.NotFoundError, match="`sql` does not exist"):
        c.completions.create(model="sql", prompt=PROMPTS[1], max_tokens=1)
    assert [m.id for m in c.models.list().data] == ["tiny"]


def test_responses_and_embeddings_through_the_ray_app(app):
    """`/v1/responses` handed off prefill -> decode, streamed as typed events, continued by
    `previous_response_id`, with a forced function call and a JSON schema format; `/v1/embeddings` answered by an engine actor (the `Embed` record
    and its vectors cross the actor's socket)."""
    c = client(app)
    before = router_status()["num_disaggregated"]
    first = c.responses.create(model="tiny", input=LONG * 3, max_output_tokens=6,
                               temperature=0, instructions="Be brief.")
    assert router_status()["num_disaggregated"] == before + 1
    events = list(c.responses.create(model="tiny", input=LONG * 3, max_output_tokens=6,
                                     temperature=0, instructions="Be brief.", stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        first.output_text
    second = c.responses.create(model="tiny", input="and then?", max_output_tokens=4,
                                previous_response_id=first.id)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert c.responses.retrieve(first.id).output_text == first.output_text
    import json

    import jsonschema

    params = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}}, "required": ["n"]}
    before = router_status()["num_disaggregated"]
    called = c.responses.create(
        model="tiny", input=LONG * 3 + "count", max_output_tokens=60, temperature=0,
        tools=[{"type": "function", "name": "count", "parameters": params}],
        tool_choice={"type": "function", "name": "count"})
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "count"
    jsonschema.validate(json.loads(call.arguments), params)
    shaped = c.responses.create(
        model="tiny", input=LONG * 3 + "as json", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "n", "schema": params}})
    jsonschema.validate(json.loads(shaped.output_text), params)
    assert router_status()["num_disaggregated"] == before + 2  # both handed off
    out = c.embeddings.create(model="tiny", input=["hello", LONG])
    norms = [sum(x * x for x in d.embedding) for d in out.data]
    assert len(out.data) == 2 and norms == pytest.approx([1.0, 1.0], abs=1e-4)


def test_grpc_generate_runs_through_serves_grpc_proxy(app, expected):
    from router.proto.cleave.v1 import generate_pb2 as pb
    from router.proto.cleave.v1 import generate_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{app.router.grpc_port}") as channel:
        stub = pb_grpc.GenerationStub(channel)
        metadata = (("application", "cleave"),)
        request = pb.GenerateRequest(model="tiny", text=PROMPTS[1], sampling=pb.SamplingParameters(
            max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        text = "".join(r.text for r in stub.Generate(request, metadata=metadata, timeout=60))
        assert text == expected[PROMPTS[1]]
        models = stub.Models(pb.ModelsRequest(), metadata=metadata, timeout=30)
        assert [m.id for m in models.models] == ["tiny"]
        embedded = stub.Embed(pb.EmbedRequest(model="tiny", inputs=[pb.EmbedInput(text="hi")]),
                              metadata=metadata, timeout=60)
        assert sum(x * x for x in embedded.embeddings[0].values) == pytest.approx(1.0, abs=1e-4)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(model="nope", text="x"), metadata=metadata,
                               timeout=30))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def _streams(config, prompts, results, errors, started: threading.Barrier | None = None,
             max_tokens: int = MAX_TOKENS):
    def one(i, prompt):
        try:
            c = client(config, timeout=120)
            text = ""
            for chunk in c.completions.create(model="tiny", prompt=prompt, stream=True,
                                              max_tokens=max_tokens, temperature=0.0,
                                              extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].text and not text and started:
                    started.wait(60)
                text += chunk.choices[0].text if chunk.choices else ""
            results[i] = text
        except Exception as exc:  # reported by the test
            errors.append(f"stream {i}: {exc!r}")
            if started:
                started.abort()

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    return threads


def test_a_replica_killed_during_16_streams_loses_no_stream_and_the_pool_recovers(
        app, expected, expected_long):
    import ray

    prompts = [PROMPTS[1] if i % 2 else PROMPTS[3] for i in range(16)]  # disaggregated ones
    results: dict[int, str] = {}
    errors: list[str] = []
    started = threading.Barrier(17)  # every stream has its first token, then the kill
    threads = _streams(app, prompts, results, errors, started, LONG_MAX_TOKENS)
    started.wait(120)
    before = {e.worker_id for e in directory_entries() if e.pool == "decode"}
    victim = next(name for name in _replica_actor_names() if "#pool-decode#" in name)
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    for t in threads:
        t.join(180)
    assert not errors
    assert all(results[i] == expected_long[p] for i, p in enumerate(prompts))
    assert router_status()["fallbacks"].get("decode_worker_failed", 0) >= 1
    # Serve replaces the replica; the routers pick its worker up from the directory
    wait_for(lambda: {e.worker_id for e in directory_entries()
                      if e.pool == "decode"} - before, 120, "a new decode worker")
    wait_for(lambda: running_replicas("pool-decode") >= 1, 120, "pool-decode running")
    assert complete(client(app), PROMPTS[3]) == expected[PROMPTS[3]]


def test_cleave_drain_restarts_a_decode_worker_under_running_streams_losing_none(
        app, expected, expected_long, capsys):
    from cluster.cli import main

    assert main(["drain", "no-such-worker"]) == 2
    assert "no worker 'no-such-worker'" in capsys.readouterr().err
    prompts = [PROMPTS[1], PROMPTS[3]] * 2
    results: dict[int, str] = {}
    errors: list[str] = []
    started = threading.Barrier(len(prompts) + 1)
    threads = _streams(app, prompts, results, errors, started, LONG_MAX_TOKENS)
    started.wait(120)
    from cluster.drain import _stats

    # a worker whose replica an earlier test killed stays listed until its entry expires
    decode = [e for e in directory_entries() if e.pool == "decode" and not e.draining]
    victim = next(e.worker_id for e in decode if _stats(e) is not None)
    for dead in (e.worker_id for e in decode if _stats(e) is None):
        assert main(["drain", dead]) == 2
        # a clear error either way: its entry may expire between the listing and the drain
        err = capsys.readouterr().err
        assert "does not answer: its replica died" in err or f"no worker {dead!r}" in err
    assert main(["drain", victim, "--timeout", "120"]) == 0
    assert f'"worker_id": "{victim}"' in capsys.readouterr().out
    for t in threads:
        t.join(180)
    assert not errors
    assert all(results[i] == expected_long[p] for i, p in enumerate(prompts))
    # Serve replaces the replica it drained (a planned restart); the pool serves on
    wait_for(lambda: victim not in {e.worker_id for e in directory_entries()}, 120,
             "the drained worker to be replaced")
    wait_for(lambda: any(w["role"] == "decode" and w["healthy"] and not w["draining"]
                         for w in router_status()["workers"]), 120,
             "the router to route to a new decode worker")
    assert complete(client(app), PROMPTS[3]) == expected[PROMPTS[3]]


def _replica_actor_names() -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::cleave#")]


def test_a_broken_engine_fails_its_health_check_and_is_replaced(app, expected):
    victim = next(e for e in directory_entries() if e.pool == "prefill")
    victim.actor.mark_broken.remote("test: the engine is broken")
    wait_for(lambda: victim.worker_id not in {e.worker_id for e in directory_entries()},
             120, "the broken prefill worker to be replaced")
    wait_for(lambda: running_replicas("pool-prefill") >= 1, 120, "pool-prefill running")
    assert complete(client(app), PROMPTS[1]) == expected[PROMPTS[1]]
