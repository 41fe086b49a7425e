"""Live KV migration between two workers: the request moves with its KV, its stream goes on with
no token repeated or lost, the target computes no prompt token, and both workers let go."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time

import pytest

from tests.router.conftest import API_KEY, NUM_BLOCKS, slow_steps, start_server, wait_until
from workers.contract.calls import CancelMigration, ExportRunning, Pause
from workers.engine.llm import LLM
from workers.serving.dispatch import dispatch
from workers.contract.messages import Generate, MigratedKV, RequestMoved, Resume, ResumedSample
from workers.contract.protocol import InvalidRequestError, SamplingParams, WorkerRequest
from workers.engine.request import Continuation
from workers.serving.connector import Connector

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tiny_model):
    server = slow_steps(start_server(tiny_model, num_workers=2), 0.005)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def expected(llm):
    return lambda prompt: list(llm.generate([prompt], GREEDY)[0].outputs[0].token_ids)


def _worker(server, i: int):
    return server.clients[i].channel.worker


def _idle(server) -> bool:
    return all(_worker(server, i).resources() == {"leases": 0, "held_requests": 0, "pulls": 0,
                                                  "prefills": 0}
               and server.call(server.clients[i].stats()).num_free_blocks == NUM_BLOCKS
               for i in range(2))


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(5, 500) for _ in range(n))


def _count_prompt_tokens(worker) -> list[int]:
    """Wrap the worker's scheduler: the prompt (non-decode) tokens its steps compute."""
    computed = [0]
    scheduler = worker.engine.scheduler
    real = scheduler.schedule

    def schedule():
        out = real()
        # a verification's chunk is a decode (its last token) and the drafted tokens
        computed[0] += sum(n for c in out.chunks if (n := c.num_tokens - len(c.draft)) > 1)
        return out

    scheduler.schedule = schedule
    return computed


def _move(server, rid: str, prompt: tuple[int, ...], after: int, between: int,
          break_second_pull: bool = False) -> tuple[list[int], list[int], object]:
    """Run `rid` on worker 0; after `after` events export its KV to worker 1, let `between`
    more events pass, pause it, and continue it on worker 1. Returns the tokens each streamed
    and the pause's answer."""
    a, b = _worker(server, 0), _worker(server, 1)
    req = WorkerRequest(rid, prompt, GREEDY)

    async def go():
        on_a, on_b = [], []
        stream = a.stream(Generate(req))
        events = aiter(stream)
        for _ in range(after):
            on_a.extend((await anext(events)).token_ids)
        first = await dispatch(a, ExportRunning(rid, 1))
        landed = await b.prepare_migration(rid, first)
        for _ in range(between):
            on_a.extend((await anext(events)).token_ids)
        (paused,) = (await dispatch(a, Pause(rid, 1))).samples
        with pytest.raises(RequestMoved):  # every token produced there comes first
            async for event in events:
                on_a.extend(event.token_ids)
        if break_second_pull and paused.handoff is not None:
            a.transfer.cancel(rid)  # the source lets go before the target's second pull
        kv = MigratedKV(paused.num_kv_tokens, landed.get(0, 0), paused.handoff)
        async for event in b.stream(Resume.one(req, paused.output_token_ids, kv)):
            on_b.extend(event.token_ids)
        return on_a, on_b, paused

    return server.call(go())


@pytest.mark.parametrize("after,between", [(1, 0), (4, 3), (9, 0)],
                         ids=["after-the-first-token", "mid-stream", "at-a-block-boundary"])
def test_a_moved_stream_goes_on_with_nothing_recomputed(pair, expected, after, between):
    prompt = _prompt(after, 37)  # 2 full blocks and a part: both pulls carry blocks
    computed_on_b = _count_prompt_tokens(_worker(pair, 1))
    on_a, on_b, paused = _move(pair, f"move-{after}-{between}", prompt, after, between)
    assert list(paused.output_token_ids) == on_a  # the target continues after exactly those
    assert on_a + on_b == expected(list(prompt))
    assert len(on_a) >= after + between and on_b
    assert paused.num_kv_tokens == len(prompt) + len(on_a) - 1
    assert computed_on_b[0] == 0  # nothing recomputed: every step on worker 1 was a decode
    assert _worker(pair, 1).migrations.num_moved_in >= 1
    assert wait_until(lambda: _idle(pair))


def test_a_moved_stream_goes_on_speculating_on_its_target(tiny_model, expected):
    """Both workers draft with a checkpoint of their own (the target's: greedy drafts all
    accepted): the moved stream's text is the undisturbed one, the target verifies drafts for
    it from a draft cache it fills itself, and computes no prompt token of its own cache."""
    from cluster.local_server import LocalServeConfig, LocalServer

    draft = json.dumps({"method": "draft_model", "model": tiny_model,
                        "num_speculative_tokens": 3, "draft_length": "fixed"})
    config = LocalServeConfig(tiny_model, num_workers=2, http_port=0, grpc_port=0,
                              router={"api_keys": (API_KEY,)},
                              engine={"num_blocks": NUM_BLOCKS, "speculative_config": draft})
    server = slow_steps(LocalServer(config).start(), 0.005)
    try:
        prompt = _prompt(21, 37)
        computed_on_b = _count_prompt_tokens(_worker(server, 1))
        on_a, on_b, _ = _move(server, "move-speculating", prompt, 2, 1)
        stats = server.call(server.clients[1].stats())
        assert on_a + on_b == expected(list(prompt)) and on_b
        assert computed_on_b[0] == 0
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
        assert wait_until(lambda: _idle(server))
    finally:
        server.stop()


def test_a_failed_second_pull_computes_the_kv_and_the_stream_still_goes_on(pair, expected):
    prompt = _prompt(7, 45)
    recomputed = _worker(pair, 1).migrations.num_recomputed
    on_a, on_b, paused = _move(pair, "move-broken", prompt, 3, 2, break_second_pull=True)
    assert paused.handoff is not None
    assert on_a + on_b == expected(list(prompt))
    assert _worker(pair, 1).migrations.num_recomputed == recomputed + 1
    assert wait_until(lambda: _idle(pair))


def test_only_a_running_request_whose_samples_all_have_output_can_move(pair, llm):
    with pytest.raises(InvalidRequestError, match="not running here"):
        pair.call(dispatch(_worker(pair, 0), Pause("nobody", 1)))
    engine = llm.engine
    engine.generate(WorkerRequest("early", _prompt(9, 20), SamplingParams(n=2, max_tokens=8)))
    try:
        for steps in range(2):  # before its first token; then sample 1 has none yet
            with pytest.raises(InvalidRequestError, match="a sample with no output yet"):
                Connector(engine).export_running("early", lambda i: f"early-hold/{i}")
            engine.step()
    finally:
        engine.abort("early")
    assert engine.kv.ledger.num_held == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_a_request_with_several_samples_moves_whole(pair, llm, seed):
    """n=3: every sample moves with its KV, each goes on from its own output with nothing
    recomputed, and each sample's whole output equals the undisturbed run's."""
    params = SamplingParams(n=3, max_tokens=MAX_TOKENS, ignore_eos=True, seed=seed,
                            temperature=0.0 if seed is None else 1.0)
    prompt = _prompt(21, 37)
    want = sorted(list(o.token_ids) for o in llm.generate([list(prompt)], params)[0].outputs)
    a, b = _worker(pair, 0), _worker(pair, 1)
    computed_on_b = _count_prompt_tokens(b)
    req = WorkerRequest("three", prompt, params)

    async def go():
        got: dict[int, list[int]] = {0: [], 1: [], 2: []}
        events = aiter(a.stream(Generate(req)))
        while not all(got.values()):  # every sample has output
            event = await anext(events)
            got[event.index].extend(event.token_ids)
        landed = await b.prepare_migration("three", await dispatch(a, ExportRunning("three", 1)))
        for _ in range(3):
            event = await anext(events)
            got[event.index].extend(event.token_ids)
        paused = await dispatch(a, Pause("three", 1))
        with pytest.raises(RequestMoved):
            async for event in events:
                got[event.index].extend(event.token_ids)
        assert sorted(p.index for p in paused.samples) == [0, 1, 2]
        assert all(list(p.output_token_ids) == got[p.index] for p in paused.samples)
        samples = [ResumedSample(p.index, p.output_token_ids,
                                 MigratedKV(p.num_kv_tokens, landed.get(p.index, 0), p.handoff))
                   for p in paused.samples]
        async for event in b.stream(Resume(req, tuple(samples))):
            got[event.index].extend(event.token_ids)
        return got

    got = pair.call(go())
    assert sorted(got.values()) == want
    assert computed_on_b[0] == 0
    assert wait_until(lambda: _idle(pair))


@pytest.fixture
def spans():
    """Tracing on in this process for one test, its finished spans kept in memory."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from workers.contract import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_tracing(tracing.Tracing(provider))
    yield exporter
    tracing.set_tracing(None)


@pytest.mark.parametrize("n", [1, 2])
def test_a_drain_moves_a_served_stream_with_its_kv(pair, llm, n, spans):
    """Through the router's HTTP port: a stream is running when its worker is drained; it
    finishes on the other worker with the undisturbed text of every choice, nothing
    recomputed there. Traced, the move is one span of the request's trace naming both
    workers and the KV blocks the target pulled."""
    import openai

    prompt = list(_prompt(11, 37))
    params = dataclasses.replace(GREEDY, n=n)
    texts = [o.text for o in llm.generate([prompt], params)[0].outputs]
    router = pair.router
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{pair.http_port}/v1", api_key=API_KEY)
    stream = client.completions.create(model=router.model_name, prompt=prompt, n=n,
                                       max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    got = [""] * n
    chunks = iter(stream)
    while not all(got):  # every choice has text
        for c in next(chunks).choices:
            got[c.index] += c.text
    source = next(w for w in ("worker-0", "worker-1") if router.migrations.on(w))
    target = _worker(pair, 1 if source == "worker-0" else 0)
    computed_on_target = _count_prompt_tokens(target)
    moved = router.counters.num_live_migrations
    (gen,) = router.migrations.on(source)
    try:
        assert pair.call(router.drain(source)) == 1
        # the drain returns once the stream has streamed from its target (which has then
        # reported the KV it took: the hand-off after it does not send it again)
        assert gen.resumed.done() and gen.streamed_by == [source, target.worker_id]
        for chunk in chunks:
            for c in chunk.choices:
                got[c.index] += c.text
    finally:
        router.workers.draining.discard(source)
    assert got == texts
    assert router.counters.num_live_migrations == moved + 1
    assert computed_on_target[0] == 0
    assert wait_until(lambda: _idle(pair))
    (move,) = [s for s in spans.get_finished_spans() if s.name == "router.live_migration"]
    (front,) = [s for s in spans.get_finished_spans() if s.name == "router.start"]
    assert move.context.trace_id == front.context.trace_id
    attrs = dict(move.attributes)
    assert (attrs["from_worker"], attrs["to_worker"], attrs["moved"], attrs["with_kv"]) == (
        source, target.worker_id, True, True)
    assert attrs["kv_blocks"] > 0


def test_a_moved_stream_still_stops_at_its_stop_string(pair, llm):
    """A stop string that the text reaches only after the move: the target's detokenizer picks
    up where the source's left off, and the stream ends before the string, as undisturbed."""
    import openai

    prompt = list(_prompt(12, 41))
    text = llm.generate([prompt], GREEDY)[0].outputs[0].text
    at = next(i for i in range(2 * len(text) // 3, len(text) - 2)
              if text.find(text[i:i + 3]) == i)  # its first occurrence, late in the text
    stop = text[at:at + 3]
    router = pair.router
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{pair.http_port}/v1", api_key=API_KEY)
    stream = client.completions.create(model=router.model_name, prompt=prompt,
                                       max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
                                       stop=[stop], extra_body={"ignore_eos": True})
    chunks = iter(stream)
    got = next(chunks).choices[0].text
    source = next(w for w in ("worker-0", "worker-1") if router.migrations.on(w))
    moved = router.counters.num_live_migrations
    finish = None
    try:
        assert pair.call(router.drain(source)) == 1
        for chunk in chunks:
            if chunk.choices:
                got += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
    finally:
        router.workers.draining.discard(source)
    assert router.counters.num_live_migrations == moved + 1
    assert got == text[:at] and finish == "stop"
    assert wait_until(lambda: _idle(pair))


def _slower(server, delay_s: float):
    """Each worker's steps `delay_s` slower until the returned function is called."""
    saved = []
    for i in range(2):
        engine = _worker(server, i).engine
        real = engine.step

        def step(real=real):
            time.sleep(delay_s)
            return real()

        saved.append((engine, real))
        engine.step = step
    return lambda: [setattr(engine, "step", real) for engine, real in saved]


async def _started(server, router, prompt, params=GREEDY):
    """`router.generate` under way, and the worker it runs on (polled until it holds it)."""
    task = asyncio.ensure_future(router.generate(list(prompt), params))
    for _ in range(500):
        for i, client in enumerate(server.clients):
            stats = await client.stats()
            if stats.num_running + stats.num_waiting:
                return task, f"worker-{i}"
        await asyncio.sleep(0.01)
    raise AssertionError("the request never reached a worker")


async def _rest(gen) -> list[int]:
    return [t async for event in gen.events() for t in event.token_ids]


def test_a_request_still_in_its_prefill_when_its_worker_drains_moves_at_its_first_token(
        pair, llm):
    """The drain begins while a long prompt is computed in chunks: it is no stream yet, so it
    moves, KV and all, as soon as its first token arrives, and finishes on the other worker
    with the undisturbed output."""
    router = pair.router
    prompt = _prompt(31, 900)  # two chunks of max_num_batched_tokens=512
    want = list(llm.generate([list(prompt)], GREEDY)[0].outputs[0].token_ids)
    moved = router.counters.num_live_migrations
    restore = _slower(pair, 0.1)

    async def go():
        task, source = await _started(pair, router, prompt)
        assert await router.drain(source, hand_off_prefixes=False) == 0  # nothing to move yet
        gen = await task
        try:
            return source, gen, await _rest(gen)
        finally:
            router.workers.draining.discard(source)

    try:
        source, gen, tokens = pair.call(go())
    finally:
        restore()
    target = "worker-1" if source == "worker-0" else "worker-0"
    assert tokens == want
    assert gen.streamed_by == [source, target]
    assert router.counters.num_live_migrations == moved + 1
    assert wait_until(lambda: _idle(pair))


def test_a_move_whose_first_pull_fails_leaves_the_stream_where_it_is(pair, expected,
                                                                    monkeypatch):
    from kvtransfer import faults

    monkeypatch.setattr(faults, "ENABLED", True)
    router = pair.router
    prompt = _prompt(32, 37)
    failed = router.counters.num_live_migrations_failed

    async def go():
        gen = await router.generate(list(prompt), GREEDY)
        faults.arm("kv.pull", "raise")
        try:
            assert not await router.migrations.move(gen)
        finally:
            faults.disarm()
        return gen, await _rest(gen)

    gen, tokens = pair.call(go())
    assert tokens == expected(list(prompt))
    assert len(gen.streamed_by) == 1
    assert router.counters.num_live_migrations_failed == failed + 1
    assert wait_until(lambda: _idle(pair))


def test_a_stream_whose_target_fails_after_the_move_is_recomputed_on_its_source(pair,
                                                                               expected):
    """The target's first step after taking the stream fails: the stream goes back to its
    source (which did not fail) by recompute, with the undisturbed output."""
    router = pair.router
    prompt = _prompt(33, 37)
    lost = router.counters.fallbacks.get("decode_worker_failed", 0)

    async def go():
        gen = await router.generate(list(prompt), GREEDY)
        source = gen.worker_now
        engine = _worker(pair, 1 if source == "worker-0" else 0).engine
        real = engine.step

        def broken_once():
            engine.step = real
            raise RuntimeError("the target's accelerator fell off the bus")

        engine.step = broken_once
        assert await router.migrations.move(gen)
        return source, gen, await _rest(gen)

    source, gen, tokens = pair.call(go())
    target = "worker-1" if source == "worker-0" else "worker-0"
    assert tokens == expected(list(prompt))
    assert gen.streamed_by == [source, target, source]
    assert router.counters.fallbacks.get("decode_worker_failed", 0) == lost + 1
    assert wait_until(lambda: _idle(pair))


def test_a_continuation_must_bring_the_kv_of_some_but_not_all_of_its_tokens(llm):
    engine = llm.engine
    free = engine.kv.pool.num_free_blocks
    req = WorkerRequest("kv-bounds", _prompt(34, 20), GREEDY)
    for num_kv in (0, 23):  # 20 prompt tokens and 3 sent: 23 is all of them
        with pytest.raises(InvalidRequestError) as err:
            Connector(engine).continue_with_kv(req, [Continuation(0, [7, 8, 9], num_kv)])
        assert err.value.param == "num_kv_tokens"
    assert engine.kv.pool.num_free_blocks == free and not engine.has_unfinished()


def test_a_stale_hold_timer_leaves_a_later_move_of_the_same_request_alone(pair):
    """A move prepared and cancelled, then prepared again: the first one's hold timer, when it
    fires, does not free the blocks the second landed under the same hold ids."""
    a, b = _worker(pair, 0), _worker(pair, 1)
    req = WorkerRequest("again", _prompt(5, 40), GREEDY)

    async def go() -> tuple[int, int]:
        stream = a.stream(Generate(req))
        events = aiter(stream)
        await anext(events)
        exported = await dispatch(a, ExportRunning("again", 1))
        await b.migrations.prepare("again", exported, hold_s=0.2)
        for w in (a, b):
            await dispatch(w, CancelMigration("again"))
        exported = await dispatch(a, ExportRunning("again", 1))
        await b.migrations.prepare("again", exported, hold_s=30)
        await asyncio.sleep(0.5)  # the first prepare's timer has fired
        await b.async_engine.apply(lambda: None)  # and what it queued has run
        held = b.resources()["held_requests"]
        for w in (a, b):
            await dispatch(w, CancelMigration("again"))
        after = b.resources()["held_requests"]
        await stream.aclose()
        return held, after

    assert pair.call(go()) == (1, 0)
    assert wait_until(lambda: _idle(pair))


def test_a_worker_switches_to_prefill_and_back_its_streams_moved_with_their_kv(pair, llm):
    """`Router.switch_role`: an aggregated worker streaming a request becomes a prefill worker
    (the stream moves to the other worker with its KV: the undisturbed text, no prompt token
    computed there), hands a long prompt's KV off while switched, and switches back."""
    import openai

    from workers.contract.protocol import WorkerRole

    prompt = list(_prompt(13, 37))
    want = llm.generate([prompt], GREEDY)[0].outputs[0].text
    router = pair.router
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{pair.http_port}/v1", api_key=API_KEY)
    chunks = iter(client.completions.create(
        model=router.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
        stream=True, extra_body={"ignore_eos": True}))
    got = ""
    while not got:
        got += next(chunks).choices[0].text
    source = next(w for w in ("worker-0", "worker-1") if router.migrations.on(w))
    target = _worker(pair, 1 if source == "worker-0" else 0)
    computed_on_target = _count_prompt_tokens(target)
    switch = pair.call(router.switch_role(source, WorkerRole.PREFILL))
    assert (switch.moved, switch.after) == (1, WorkerRole.PREFILL) and switch.seconds > 0
    assert router.pool(WorkerRole.PREFILL) == [source] and source not in router.draining
    got += "".join(c.choices[0].text for c in chunks)
    assert got == want and computed_on_target[0] == 0
    handed_off = router.counters.num_disaggregated
    long_prompt = list(_prompt(14, 90))  # past the default threshold of 64 uncached tokens
    text = client.completions.create(model=router.model_name, prompt=long_prompt,
                                     max_tokens=8, temperature=0.0).choices[0].text
    assert text == llm.generate([long_prompt], dataclasses.replace(
        GREEDY, max_tokens=8))[0].outputs[0].text
    assert router.counters.num_disaggregated == handed_off + 1
    back = pair.call(router.switch_role(source, WorkerRole.BOTH))
    assert back.moved == 0 and router.pool(WorkerRole.PREFILL) == []
    assert wait_until(lambda: _idle(pair))


@pytest.fixture(scope="module")
def lora_pair(tiny_model, tmp_path_factory):
    """Two aggregated workers with the adapter `sql` loaded at start, and the offline LLM with
    it (the reference)."""
    from cluster.local_server import LocalServeConfig, LocalServer
    from workers.models.lora.make_adapter import ATTENTION, MLP, make_adapter

    folder = make_adapter(tiny_model, tmp_path_factory.mktemp("lora") / "sql", rank=8,
                          targets=ATTENTION + MLP, seed=1)
    lora = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
            "lora_modules": (f"sql={folder}",)}
    config = LocalServeConfig(tiny_model, num_workers=2, http_port=0, grpc_port=0,
                              router={"api_keys": (API_KEY,), "kv_poll_interval_s": 0.2},
                              engine={"num_blocks": NUM_BLOCKS, **lora})
    server = slow_steps(LocalServer(config).start(), 0.005)
    yield server, LLM(tiny_model, num_blocks=NUM_BLOCKS, **lora)
    server.stop()


def _adapter_stream(pair, prompt: list[int]):
    """A streamed completion under the adapter `sql`, read up to its first text: (the client,
    the rest of its chunks, the text so far, the worker streaming it)."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{pair.http_port}/v1", api_key=API_KEY,
                           max_retries=0)
    chunks = iter(client.completions.create(
        model="sql", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True}))
    got = ""
    while not got:
        got += next(chunks).choices[0].text
    source = next(w for w in ("worker-0", "worker-1") if pair.router.migrations.on(w))
    return client, chunks, got, source


def test_a_drain_moves_a_stream_under_an_adapter_with_its_kv_kept_apart_by_adapter(lora_pair):
    """A stream under a LoRA adapter moves with its KV when its worker drains: the adapter's
    undisturbed text (not the base model's), no prompt token computed on the target. The
    blocks the target took stay the adapter's: while the source still drains, the same prompt
    finds them cached under the adapter and not under the base model, whose text is the base
    model's."""
    pair, llm = lora_pair
    prompt = list(_prompt(21, 37))
    want = llm.generate([prompt], GREEDY, lora_name="sql")[0].outputs[0].text
    base_text = llm.generate([prompt], GREEDY)[0].outputs[0].text
    assert want != base_text  # the adapter changes the text: a dropped adapter would show
    router = pair.router
    client, chunks, got, source = _adapter_stream(pair, prompt)
    target = _worker(pair, 1 if source == "worker-0" else 0)
    computed_on_target = _count_prompt_tokens(target)
    try:
        assert pair.call(router.drain(source)) == 1
        got += "".join(c.choices[0].text for c in chunks)
        assert got == want and computed_on_target[0] == 0

        def cached(model: str) -> tuple[str, int]:
            out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0.0, extra_body={"ignore_eos": True})
            return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens

        assert cached("sql") == (want, 32)  # both full blocks of 16 of the prompt, on the target
        assert cached(router.model_name) == (base_text, 0)
    finally:
        router.workers.draining.discard(source)
    assert wait_until(lambda: _idle(pair))


def test_a_stream_under_an_adapter_whose_worker_dies_goes_on_under_it(lora_pair):
    """Its worker gone mid-stream (closed), a stream under an adapter is recomputed on the
    other worker under the same adapter: the adapter's undisturbed text. (The module's last
    test: it leaves one worker.)"""
    pair, llm = lora_pair
    prompt = list(_prompt(22, 30))
    want = llm.generate([prompt], GREEDY, lora_name="sql")[0].outputs[0].text
    router = pair.router
    _, chunks, got, source = _adapter_stream(pair, prompt)
    victim = pair.clients[0 if source == "worker-0" else 1]
    failed = router.counters.fallbacks.get("decode_worker_failed", 0)
    pair.call(victim.close())
    got += "".join(c.choices[0].text for c in chunks)
    assert got == want
    assert router.counters.fallbacks.get("decode_worker_failed", 0) == failed + 1
