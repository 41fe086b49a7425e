"""The asyncio engine: token events as they come, cancellation that frees blocks."""

from __future__ import annotations

import asyncio

import pytest

from workers import LLM, AsyncEngine, InvalidRequestError, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def test_streams_the_same_tokens_as_the_offline_api(tiny_model):
    llm = LLM(tiny_model, num_blocks=128)
    want = [o.outputs[0] for o in llm.generate(["hello there", "a b c"], PARAMS)]

    async def run():
        engine = AsyncEngine(llm.engine)

        async def collect(prompt):
            tokens, text, events = [], "", 0
            async for event in engine.generate_stream(prompt, PARAMS):
                tokens += event.token_ids
                text += event.text
                events += 1
            return tokens, text, events

        try:
            return await asyncio.wait_for(
                asyncio.gather(collect("hello there"), collect("a b c")), 60)
        finally:
            await engine.shutdown()

    results = asyncio.run(run())
    for (tokens, text, events), ref in zip(results, want):
        assert tokens == ref.token_ids and text == ref.text
        assert events == 20  # one event per token


def test_leaving_the_stream_aborts_and_frees_blocks(tiny_model):
    llm = LLM(tiny_model, num_blocks=128)

    async def run():
        engine = AsyncEngine(llm.engine)
        try:
            params = SamplingParams(max_tokens=500, ignore_eos=True)
            async for _ in engine.generate_stream("a long one", params):
                break  # the client went away after the first token
            for _ in range(200):
                if not llm.engine.has_unfinished():
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(InvalidRequestError):
                async for _ in engine.generate_stream("x", SamplingParams(max_tokens=10**6)):
                    pass
            task = asyncio.ensure_future(_drain(engine.generate_stream("y", params)))
            await asyncio.sleep(0.2)
            task.cancel()  # a cancelled handler
            await asyncio.gather(task, return_exceptions=True)
            for _ in range(200):
                if not llm.engine.has_unfinished():
                    break
                await asyncio.sleep(0.01)
        finally:
            await engine.shutdown()

    asyncio.run(run())
    assert not llm.engine.has_unfinished()
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_a_step_past_its_bound_or_a_lost_rank_makes_the_engine_unhealthy(tiny_model,
                                                                          monkeypatch):
    """The watchdog: a hung step shows in the published stats (read on a timer by the output
    channel's heartbeat) while it lasts; a step that lost a rank makes it unhealthy for good."""
    from kvtransfer import faults
    from workers.engine.parallel.group import RankGroupError

    llm = LLM(tiny_model, num_blocks=128)
    monkeypatch.setattr(faults, "ENABLED", True)

    async def run():
        engine = AsyncEngine(llm.engine, step_timeout_s=0.3)
        try:
            assert engine.is_healthy and engine.stats.healthy
            faults.arm("engine.step", "stall", seconds=1.2)
            task = asyncio.ensure_future(_drain(engine.generate_stream("hung", PARAMS)))
            await asyncio.sleep(0.7)
            assert not engine.is_healthy and not engine.stats.healthy
            assert "step_timeout_s 0.3" in engine.unhealthy_reason
            await asyncio.wait_for(task, 30)  # the step returned: the request finishes
            assert engine.is_healthy and engine.stats.healthy

            def lost_rank():
                raise RankGroupError("rank 1 exited with code -9 during step 7")

            monkeypatch.setattr(llm.engine, "step", lost_rank)
            with pytest.raises(RankGroupError):
                await _drain(engine.generate_stream("x", PARAMS))
            assert not engine.stats.healthy and "rank 1 exited" in engine.unhealthy_reason
        finally:
            faults.disarm()
            await engine.shutdown()

    asyncio.run(run())


def test_the_engine_is_built_on_the_thread_its_steps_run_on(tiny_model, monkeypatch):
    """One thread starts every parallel region of the engine (loading, profiling, steps): a
    second thread with an OpenMP pool makes libgomp park idle workers, and each region of a
    step then waits for a wake-up (`AsyncEngine.from_config`)."""
    import threading

    from workers import EngineConfig
    from workers.engine import step_thread as module  # where `from_config` builds it

    seen: dict[str, set[int]] = {"init": set(), "step": set()}

    class Recording(module.Engine):
        def __init__(self, *args, **kwargs):
            seen["init"].add(threading.get_ident())
            super().__init__(*args, **kwargs)

        def step(self):
            seen["step"].add(threading.get_ident())
            return super().step()

    monkeypatch.setattr(module, "Engine", Recording)

    async def run():
        engine = AsyncEngine.from_config(EngineConfig(model=tiny_model, num_blocks=64))
        try:
            async for _ in engine.generate_stream("hello", PARAMS):
                pass
        finally:
            await engine.shutdown()

    asyncio.run(run())
    assert len(seen["init"]) == 1 and seen["step"] == seen["init"]
    assert threading.get_ident() not in seen["init"]


def test_shutdown_stops_a_running_request_at_once(tiny_model):
    """The step thread steps on its own between commands; shutdown stops it after its step, so
    a long request in flight fails with EngineShutDown instead of running to its end first."""
    from workers.contract.protocol import EngineShutDown

    llm = LLM(tiny_model, num_blocks=256)
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    steps = 0
    step = llm.engine.step

    def counted():
        nonlocal steps
        steps += 1
        return step()

    llm.engine.step = counted

    async def run():
        engine = AsyncEngine(llm.engine)
        tokens = 0
        stream = engine.generate_stream("a long one", long)
        try:
            async for event in stream:
                tokens += len(event.token_ids)
                if tokens >= 5:
                    await asyncio.wait_for(engine.shutdown(), 30)
        except EngineShutDown:
            return tokens
        return None

    tokens = asyncio.run(run())
    assert tokens is not None and tokens < 1500
    assert steps < 100  # not the 1,500 the request had left (a step or two after shutdown)


def test_a_request_after_shutdown_fails_as_the_engine_gone(tiny_model):
    """A worker being removed shuts its engine down while routers may still send it a request
    (they see it draining within a poll): the request fails with EngineShutDown, which the
    router retries elsewhere, never as an engine error (a 500), and `apply` is refused the
    same way rather than restarting the step loop on a closed engine."""
    from workers.contract.protocol import EngineShutDown

    llm = LLM(tiny_model, num_blocks=64)

    async def run():
        engine = AsyncEngine(llm.engine)
        async for _ in engine.generate_stream("warm", PARAMS):
            pass
        await engine.shutdown()
        with pytest.raises(EngineShutDown, match="shut down"):
            async for _ in engine.generate_stream("too late", PARAMS):
                pass
        with pytest.raises(EngineShutDown, match="shut down"):
            await asyncio.wait_for(engine.apply(lambda: 1), 10)
        assert not engine.is_healthy

    asyncio.run(run())
