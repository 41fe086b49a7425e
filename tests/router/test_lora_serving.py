"""LoRA adapters through the served API, with the real `openai` client: a request's `model`
naming an adapter selects it, aggregated and across the disaggregated handoff (the greedy
output equal to the offline LLM's under that adapter); `/v1/models` lists them; run-time
loading and unloading (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`) reach every worker,
the errors are OpenAI-shaped and name what is wrong, and every KV block is back after each; the
prefix cache is kept apart per adapter; a name found in `lora_dir` is loaded on demand, once; a
decode worker without the adapter is given it before the handoff; latency per adapter is in
`/metrics`."""

from __future__ import annotations

import itertools
import shutil

import httpx
import openai
import pytest

from cluster.local_server import LocalServeConfig, LocalServer
from tests.router.conftest import API_KEY, NUM_BLOCKS, wait_until
from workers.models.lora.make_adapter import ATTENTION, MLP, make_adapter

THRESHOLD = 24  # prompt tokens from which a request is split between prefill and decode
MAX_RANK = 8
_first = itertools.count(1)


def fresh_prompt(n: int = 40) -> list[int]:
    """Token ids no earlier request sent (a prefix-cache miss), `n` of them."""
    k = next(_first)
    return [1 + (k * 97 + i * 7) % 500 for i in range(n)]


@pytest.fixture(scope="module")
def folders(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"sql": make_adapter(tiny_model, root / "sql", rank=8, seed=1),
            "chat": make_adapter(tiny_model, root / "chat", rank=4, targets=ATTENTION + MLP,
                                 seed=2),
            "big": make_adapter(tiny_model, root / "big", rank=16, seed=3),
            # the `lora_dir`: adapters loaded on demand by name
            "tenant": make_adapter(tiny_model, root / "library" / "tenant", rank=8,
                                   targets=ATTENTION + MLP, seed=4),
            "root": root}


@pytest.fixture(scope="module")
def lora_server(tiny_model, folders):
    """One prefill and one decode worker, each with the adapter `sql` loaded at start, and the
    folder `library` as `lora_dir` (`tenant` there is loaded on demand)."""
    config = LocalServeConfig(
        tiny_model, http_port=0, grpc_port=0, num_prefill_workers=1, num_decode_workers=1,
        router={"api_keys": (API_KEY,), "kv_poll_interval_s": 0.2,
                "disagg_threshold_tokens": THRESHOLD},
        engine={"num_blocks": NUM_BLOCKS, "max_num_batched_tokens": 512, "enable_lora": True,
                "max_loras": 2, "max_lora_rank": MAX_RANK,
                "lora_modules": (f"sql={folders['sql']}",),
                "lora_dir": str(folders["root"] / "library")},
        worker={"lease_s": 10.0, "pull_timeout_s": 10.0})
    srv = LocalServer(config).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(tiny_model, folders):
    """The offline LLM with the adapters: the reference."""
    from workers import LLM

    return LLM(tiny_model, enable_lora=True, max_lora_rank=MAX_RANK,
               lora_modules=(f"sql={folders['sql']}", f"chat={folders['chat']}",
                             f"tenant={folders['tenant']}"))


def client_of(srv: LocalServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key=API_KEY,
                         timeout=60, max_retries=0)


def post(srv: LocalServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{srv.http_port}/v1/{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"})


def complete(srv: LocalServer, model: str, prompt: list[int], max_tokens: int = 12):
    return client_of(srv).completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, extra_body={"ignore_eos": True})


def reference(offline, prompt: list[int], lora: str | None, max_tokens: int = 12) -> str:
    from workers import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return offline.generate([prompt], params, lora_name=lora)[0].outputs[0].text


def settled(srv: LocalServer) -> bool:
    """Every block of every worker free, and no lease left on any agent."""
    def leases() -> int:
        return sum(a.num_leases for w in srv.workers for a in w.transfer.started)

    return wait_until(lambda: all(srv.call(c.stats()).num_free_blocks == NUM_BLOCKS
                                  for c in srv.clients) and leases() == 0, 10.0)


def test_models_lists_the_base_model_and_each_adapter_as_its_child(lora_server):
    models = client_of(lora_server).models.list().data
    base = lora_server.router.model_name
    assert [m.id for m in models] == [base, "sql"]
    assert models[0].parent is None and models[1].parent == base


@pytest.mark.parametrize("length", [40, 8], ids=["disaggregated", "aggregated"])
def test_an_adapter_named_in_model_runs_as_the_offline_llm_runs_it(lora_server, offline,
                                                                   length):
    prompt = fresh_prompt(length)
    split = lora_server.router.counters.num_disaggregated
    got = complete(lora_server, "sql", prompt)
    assert got.model == "sql"
    assert got.choices[0].text == reference(offline, prompt, "sql")
    assert got.choices[0].text != reference(offline, prompt, None)  # the adapter tells
    assert lora_server.router.counters.num_disaggregated == split + (length >= THRESHOLD)
    assert settled(lora_server)


def test_chat_and_responses_select_the_adapter_too(lora_server):
    def chat(model: str) -> str:
        out = client_of(lora_server).chat.completions.create(
            model=model, max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11"}])
        assert out.model == model
        return out.choices[0].message.content

    assert chat("sql") != chat(lora_server.router.model_name)

    def respond(model: str) -> str:
        out = client_of(lora_server).responses.create(model=model, max_output_tokens=8,
                                                      input="w1 w2 w3 w4 w5", temperature=0)
        assert out.model == model
        return out.output_text

    assert respond("sql") != respond(lora_server.router.model_name)


def test_load_serve_unload_at_run_time(lora_server, offline, folders):
    prompt = fresh_prompt()
    ok = post(lora_server, "load_lora_adapter", {"lora_name": "chat",
                                                 "lora_path": str(folders["chat"])})
    assert ok.status_code == 200, ok.text
    assert all("chat" in w.engine.adapters.names() for w in lora_server.workers)
    assert [m.id for m in client_of(lora_server).models.list().data][1:] == ["chat", "sql"]
    assert complete(lora_server, "chat", prompt).choices[0].text == \
        reference(offline, prompt, "chat")
    gone = post(lora_server, "unload_lora_adapter", {"lora_name": "chat"})
    assert gone.status_code == 200, gone.text
    assert not any("chat" in w.engine.adapters.names() for w in lora_server.workers)
    with pytest.raises(openai.NotFoundError, match="`chat` does not exist"):
        complete(lora_server, "chat", prompt)
    assert [m.id for m in client_of(lora_server).models.list().data][1:] == ["sql"]
    assert settled(lora_server)


def _broken_copy(folders, name: str, drop: str):
    folder = folders["root"] / name
    if not folder.exists():
        shutil.copytree(folders["sql"], folder)
        (folder / drop).unlink()
    return folder


def test_errors_are_openai_shaped_and_name_what_is_wrong(lora_server, folders):
    with pytest.raises(openai.NotFoundError, match="`nope` does not exist"):
        complete(lora_server, "nope", fresh_prompt(8))
    cases = [({"lora_name": "x", "lora_path": "/no/such/folder"}, 400, "/no/such/folder"),
             ({"lora_name": "x", "lora_path": str(_broken_copy(folders, "noweights",
                                                               "adapter_model.safetensors"))},
              400, "adapter_model.safetensors is missing"),
             ({"lora_name": "x", "lora_path": str(folders["big"])}, 400,
              f"rank r=16 is over max_lora_rank={MAX_RANK}"),
             ({"lora_name": "sql", "lora_path": str(folders["sql"])}, 400, "already loaded")]
    for body, status, says in cases:
        r = post(lora_server, "load_lora_adapter", body)
        assert r.status_code == status and says in r.json()["error"]["message"], r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = post(lora_server, "unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 404 and "`nope` is not loaded" in r.json()["error"]["message"]
    # nothing half-loaded: every worker serves `sql` alone still
    assert all(w.engine.adapters.names() == ["sql"] for w in lora_server.workers)
    assert settled(lora_server)


def test_loading_on_a_server_without_lora_names_enable_lora(server, folders):
    r = post(server, "load_lora_adapter", {"lora_name": "sql",
                                           "lora_path": str(folders["sql"])})
    assert r.status_code == 400 and "enable_lora" in r.json()["error"]["message"], r.text


def test_prefix_cache_is_kept_apart_per_adapter(lora_server, folders):
    """The same prompt under two adapters and the base model: no hit across them; a repeat
    under the same adapter hits."""
    assert post(lora_server, "load_lora_adapter", {"lora_name": "chat",
                                                   "lora_path": str(folders["chat"])}).is_success
    prompt, base = fresh_prompt(), lora_server.router.model_name

    def cached(model: str) -> int:
        usage = complete(lora_server, model, prompt, max_tokens=2).usage
        return usage.prompt_tokens_details.cached_tokens

    assert [cached(m) for m in ("sql", "chat", base)] == [0, 0, 0]
    assert cached("sql") == 32  # the prompt's two full blocks of 16
    assert post(lora_server, "unload_lora_adapter", {"lora_name": "chat"}).is_success
    assert settled(lora_server)


def test_another_router_replica_sees_loads_and_unloads_made_through_the_first(lora_server,
                                                                              folders):
    """A second router over the same workers (another replica's view): it finds an adapter
    loaded through the first when a request names it, and once it is unloaded through the
    first, a request for it gets 404 there too and the name leaves its list."""
    from router.app import Router
    from router.channel import ChannelClient
    from router.errors import NotFoundError

    other = Router(lora_server.router.config,
                   [ChannelClient(c.channel, "router-b") for c in lora_server.clients])
    lora_server.call(other.start())
    try:
        assert other.adapters.names == ["sql"]
        load = {"lora_name": "chat", "lora_path": str(folders["chat"])}
        assert post(lora_server, "load_lora_adapter", load).is_success
        assert lora_server.call(other.adapters.resolve("chat")) == "chat"
        assert post(lora_server, "unload_lora_adapter", {"lora_name": "chat"}).is_success
        assert "chat" in other.adapters.names  # not told: it finds out when asked
        from workers import SamplingParams

        with pytest.raises(NotFoundError, match="`chat` does not exist"):
            lora_server.call(other.generate(fresh_prompt(8), SamplingParams(max_tokens=2),
                                            lora_name="chat"))
        assert other.adapters.names == ["sql"]
    finally:
        lora_server.call(other.stop())
    assert settled(lora_server)


def test_a_worker_joining_later_is_given_the_adapters_loaded_at_run_time(lora_server, folders):
    """A router replica over the prefill worker loads `chat` at run time (only that worker
    has it); the decode worker then joins it, as an autoscaled replica would: it is given
    `chat` from the folder the other read it from before it is routed to, so the adapter is
    still served by every worker and stays listed."""
    from router.app import Router
    from router.channel import ChannelClient
    from workers.contract.calls import LoraAdapters

    first, joining_worker = lora_server.clients
    other = Router(lora_server.router.config, [ChannelClient(first.channel, "router-c")])
    joining = ChannelClient(joining_worker.channel, "router-c")
    lora_server.call(other.start())
    try:
        lora_server.call(other.adapters.load("chat", str(folders["chat"])))
        assert "chat" not in lora_server.call(joining.call(LoraAdapters()))
        lora_server.call(other.add_worker(joining))
        assert lora_server.call(joining.call(LoraAdapters())) == {
            "sql": str(folders["sql"]), "chat": str(folders["chat"])}
        lora_server.call(other.adapters.refresh())
        assert other.adapters.names == ["chat", "sql"]  # served by both: still listed
    finally:
        lora_server.call(other.stop())
    assert post(lora_server, "unload_lora_adapter", {"lora_name": "chat"}).is_success
    assert settled(lora_server)


def test_an_unload_refused_on_one_worker_leaves_the_adapter_on_every_worker(lora_server,
                                                                           folders):
    """While a stream runs under `chat` on one worker, its unload is refused there (400): the
    worker that had dropped it loads it again, so `chat` stays served everywhere and a request
    for it still answers; once the stream is gone the unload goes through."""
    from workers.contract.calls import LoraAdapters

    load = {"lora_name": "chat", "lora_path": str(folders["chat"])}
    assert post(lora_server, "load_lora_adapter", load).is_success
    stream = client_of(lora_server).completions.create(
        model="chat", prompt=fresh_prompt(8), max_tokens=1500, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    next(iter(stream))  # running on one worker now
    r = post(lora_server, "unload_lora_adapter", {"lora_name": "chat"})
    stream.close()
    assert r.status_code == 400 and "chat" in r.json()["error"]["message"], r.text
    assert all("chat" in lora_server.call(c.call(LoraAdapters())) for c in lora_server.clients)
    assert complete(lora_server, "chat", fresh_prompt(8)).usage.completion_tokens == 12
    assert wait_until(lambda: post(lora_server, "unload_lora_adapter",
                                   {"lora_name": "chat"}).is_success, 10.0)
    assert settled(lora_server)


def test_a_decode_worker_without_the_adapter_loads_it_before_continuing(lora_server, offline):
    """The decode worker lost `sql` (unloaded around the router, as a restart would): a request
    split between the workers still runs under `sql` after the handoff, its KV pulled (no
    fallback), because the decode worker is given `sql` from the prefill worker's folder
    before the handoff reaches it."""
    from workers.contract.calls import LoraAdapters, UnloadLoraAdapter
    from workers.contract.protocol import WorkerRole

    router = lora_server.router
    decode = next(c for c in lora_server.clients
                  if router.worker_infos[c.worker_id].role == WorkerRole.DECODE)
    lora_server.call(decode.call(UnloadLoraAdapter("sql")))
    prompt, split = fresh_prompt(), router.counters.num_disaggregated
    fallbacks = dict(router.counters.fallbacks)
    assert complete(lora_server, "sql", prompt).choices[0].text == \
        reference(offline, prompt, "sql")
    assert router.counters.num_disaggregated == split + 1
    assert router.counters.fallbacks == fallbacks  # the handoff's KV was used
    assert "sql" in lora_server.call(decode.call(LoraAdapters()))
    assert settled(lora_server)


def test_a_name_in_lora_dir_is_loaded_on_demand_once(lora_server, offline, folders,
                                                      monkeypatch):
    """Four requests at once naming `tenant`, a folder in `lora_dir` no worker has loaded: each
    worker reads it once, and the output is the offline LLM's under `tenant`; a folder that is
    not an adapter is a 400 naming it, loaded nowhere; a name with no folder stays a 404."""
    reads: list[str] = []
    for w in lora_server.workers:
        store = w.engine.adapters.store
        monkeypatch.setattr(store, "load_adapter", lambda name, path, real=store.load_adapter:
                            (reads.append(name), real(name, path))[1])

    async def at_once() -> list[str | None]:
        import asyncio

        return await asyncio.gather(*(lora_server.router.adapters.resolve("tenant")
                                      for _ in range(4)))

    assert lora_server.call(at_once()) == ["tenant"] * 4
    assert reads == ["tenant", "tenant"]  # once per worker
    prompt = fresh_prompt()
    assert complete(lora_server, "tenant", prompt).choices[0].text == \
        reference(offline, prompt, "tenant")
    assert "tenant" in [m.id for m in client_of(lora_server).models.list().data]
    broken = _broken_copy(folders, "library/noweights", "adapter_model.safetensors")
    with pytest.raises(openai.BadRequestError, match=f"on demand from {broken}"):
        complete(lora_server, "noweights", fresh_prompt(8))
    for name in ("nowhere", ".."):
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            complete(lora_server, name, fresh_prompt(8))
    assert all(w.engine.adapters.names() == ["sql", "tenant"] for w in lora_server.workers)
    assert post(lora_server, "unload_lora_adapter", {"lora_name": "tenant"}).is_success
    assert settled(lora_server)


def test_latency_per_adapter_is_scraped_from_metrics(lora_server):
    """TTFT and end-to-end latency histograms by adapter: a request under `sql` and one under
    `tenant` (loaded on demand) each add one observation to their own adapter's series; the
    workers' counts of adapters copied into their slots grow by the on-demand one's."""
    from tests.router.test_metrics import scrape, total

    loads = "cleave_worker_lora_adapter_loads_total"
    if post(lora_server, "unload_lora_adapter", {"lora_name": "tenant"}).is_success:
        assert settled(lora_server)  # an earlier test's copy gone: its next use copies it

    names = ("cleave_lora_time_to_first_token_seconds_count",
             "cleave_lora_e2e_request_latency_seconds_count")
    before = scrape(lora_server)
    for model in ("sql", "tenant", lora_server.router.model_name):
        complete(lora_server, model, fresh_prompt(8), max_tokens=3)
    after = scrape(lora_server)
    for name in names:
        for adapter in ("sql", "tenant"):
            assert total(after, name, adapter=adapter) == \
                total(before, name, adapter=adapter) + 1, (name, adapter)
        assert total(after, name) == total(before, name) + 2  # the base model's not counted
    assert total(after, "cleave_lora_time_to_first_token_seconds_sum", adapter="tenant") > 0
    assert total(before, loads) >= 1  # `sql`, loaded at start, served by earlier tests
    assert wait_until(lambda: total(scrape(lora_server), loads) > total(before, loads))
    assert post(lora_server, "unload_lora_adapter", {"lora_name": "tenant"}).is_success
    assert settled(lora_server)
