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
