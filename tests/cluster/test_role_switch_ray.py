"""`cleave role` on the Ray app (issue 51): a worker of the aggregated pool (two replicas) goes
aggregated -> prefill -> aggregated under running streams; every stream completes with the
greedy text of an undisturbed run, its streams move with their KV (no prompt token recomputed), the
prompts sent meanwhile are handed off from it, and every KV block and lease comes back."""

from __future__ import annotations

import threading

import openai
import pytest

from tests.cluster.conftest import app_config, directory_entries, router_status, wait_for

pytestmark = pytest.mark.timeout(600)

# distinct prompts (no shared prefix: what each worker computes is each prompt's own)
STREAMED = [f"stream {i}: " + "the quick brown fox jumps over the lazy dog " * (2 + i % 3)
            for i in range(6)]
HANDED_OFF = [f"while switched {i}: " + "a long prompt to hand off to the other worker " * 4
              for i in range(2)]
STREAM_TOKENS = 1000  # long enough to still run through both switches (tiny: ~10 s)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def app(local_ray, tiny_model):
    from cluster.config import CleaveConfig
    from cluster.launch import deploy

    config = CleaveConfig.parse(app_config(tiny_model, pools={"aggregated": {
        "cpus_per_rank": 0.25, "replicas": {"min": 2, "max": 2},
        "engine": {"num_blocks": 512}}}))  # room for every stream on one
    deploy(config)
    wait_for(lambda: len(router_status()["workers"]) == 2, 120, "both workers routed")
    return config


def _client(config):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{config.router.http_port}/v1",
                         api_key="unused", max_retries=0, timeout=180)


def _stream(config, i, prompt, results, errors, started):
    try:
        text = ""
        for chunk in _client(config).completions.create(
                model="tiny", prompt=prompt, stream=True, max_tokens=STREAM_TOKENS,
                temperature=0.0, extra_body={"ignore_eos": True}):
            piece = chunk.choices[0].text if chunk.choices else ""
            if piece and not text:
                started.wait(120)
            text += piece
        results[i] = text
    except Exception as exc:  # noqa: BLE001 -- reported by the test
        errors.append(f"stream {i}: {exc!r}")
        started.abort()


def _complete(config, i, prompt, results, errors):
    try:
        out = _client(config).completions.create(model="tiny", prompt=prompt,
                                                 max_tokens=MAX_TOKENS, temperature=0.0,
                                                 extra_body={"ignore_eos": True})
        results[i] = (out.choices[0].text, out.usage.prompt_tokens)
    except Exception as exc:  # noqa: BLE001 -- reported by the test
        errors.append(f"handed-off {i}: {exc!r}")


def _undisturbed(config) -> list[str]:
    """The streams' texts with no switch (what the offline engine writes greedily: the
    other Ray app tests show it; 1,000 tokens each take it ~90 s on 2 cores, the app ~10 s)."""
    results: dict[int, str] = {}
    errors: list[str] = []
    started = threading.Barrier(len(STREAMED))
    threads = [threading.Thread(target=_stream, args=(config, i, p, results, errors, started))
               for i, p in enumerate(STREAMED)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors
    return [results[i] for i in range(len(STREAMED))]


def _computed(entry) -> int:
    import ray

    return ray.get(entry.actor.stats.remote(), timeout=30).num_prompt_tokens_computed


def _everything_back(entry) -> bool:
    import ray

    stats = ray.get(entry.actor.stats.remote(), timeout=30)
    held = ray.get(entry.actor.resources.remote(), timeout=30)
    return (ray.get(entry.actor.num_in_flight.remote(), timeout=30) == 0
            and not any(held.values()) and stats.num_free_blocks == stats.num_blocks)


def _role(main, capsys, *argv):
    import json

    assert main(["role", *argv, "--timeout", "120"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_worker_switches_to_prefill_and_back_under_streams_losing_and_recomputing_none(
        app, capsys):
    from cluster.cli import main

    want_streamed = _undisturbed(app)
    entries = {e.worker_id: e for e in directory_entries()}
    assert main(["role", "no-such-worker", "prefill"]) == 2
    assert "no worker 'no-such-worker'" in capsys.readouterr().err
    # what the router replica refuses reaches the caller as a ValueError (the CLI's one line)
    from ray import serve

    with pytest.raises(ValueError, match="'nope' is not a valid WorkerRole"):
        serve.get_deployment_handle("router", app_name="cleave").switch_role.remote(
            next(iter(entries)), "nope").result(timeout_s=30)
    results: dict[int, str] = {}
    errors: list[str] = []
    started = threading.Barrier(len(STREAMED) + 1)  # every stream has its first token
    threads = [threading.Thread(target=_stream, args=(app, i, p, results, errors, started))
               for i, p in enumerate(STREAMED)]
    for t in threads:
        t.start()
    started.wait(180)
    running = {w["worker_id"]: w["num_running"] or 0 for w in router_status()["workers"]}
    switched = max(running, key=lambda wid: running[wid])
    (other,) = set(entries) - {switched}
    computed = {wid: _computed(e) for wid, e in entries.items()}

    to_prefill = _role(main, capsys, switched, "prefill")
    assert (to_prefill["before"], to_prefill["after"]) == ("aggregated", "prefill")
    assert to_prefill["streams_moved"] == running[switched] >= 1
    assert to_prefill["seconds"] > 0
    status = router_status()
    assert {w["worker_id"]: w["routed_as"] for w in status["workers"]} == {
        switched: "prefill", other: "both"}
    # its streams moved with their KV: neither worker computed a prompt token for them
    assert {wid: _computed(e) for wid, e in entries.items()} == computed
    # prompts sent while it prefills are handed off from it to the other worker
    handed: dict[int, tuple[str, int]] = {}
    extra = [threading.Thread(target=_complete, args=(app, i, p, handed, errors))
             for i, p in enumerate(HANDED_OFF)]
    for t in extra:
        t.start()
    for t in extra:
        t.join(180)
    assert router_status()["num_disaggregated"] >= len(HANDED_OFF)

    back = _role(main, capsys, switched, "aggregated")
    assert (back["before"], back["after"], back["streams_moved"]) == ("prefill", "aggregated", 0)
    for t in threads:
        t.join(300)
    assert not errors
    assert [results[i] for i in range(len(STREAMED))] == want_streamed
    # nothing recomputed: the other worker computed no prompt token from the first switch on
    # (the moved streams and the handed-off prompts came with their KV); the switched one only
    # the handed-off prompts (at most: what its cache held it did not compute)
    assert _computed(entries[other]) == computed[other]
    assert 0 < _computed(entries[switched]) - computed[switched] <= sum(
        n for _, n in handed.values())
    status = router_status()
    assert status["num_live_migrations"] >= to_prefill["streams_moved"]
    assert status["num_live_migrations_failed"] == 0
    assert {w["routed_as"] for w in status["workers"]} == {"both"}
    for e in entries.values():  # every block and lease back on both workers
        wait_for(lambda e=e: _everything_back(e), 60, f"{e.worker_id} to hold nothing")
    # the prompts handed off while it prefilled read as they do aggregated, undisturbed
    again: dict[int, tuple[str, int]] = {}
    for i, p in enumerate(HANDED_OFF):
        _complete(app, i, p, again, errors)
    assert not errors and {i: t for i, (t, _) in handed.items()} == {
        i: t for i, (t, _) in again.items()}


def test_a_manual_switch_is_refused_while_the_slo_planner_owns_the_roles():
    import asyncio
    from types import SimpleNamespace

    from cluster.ingress import RouterIngress

    ingress = SimpleNamespace(router=SimpleNamespace(slo=object(), clients={"w": None}),
                              subscriber="router-1")
    with pytest.raises(ValueError, match=r"the SLO planner .* owns the roles"):
        asyncio.run(RouterIngress.switch_role(ingress, "w", "prefill"))
