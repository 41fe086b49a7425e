"""The channel client: its per-request stream merges events of one sample that are already here
(tokens, text and logprobs in order), never across samples, a finish or a failure; its deadlines
fail a silent channel's streams and abort a prefill that is not answered in time."""

from __future__ import annotations

import asyncio

import pytest

from router.channel import ChannelClient, Deadlines
from router.errors import WorkerUnavailableError
from router.request_stream import RequestStream
from router.worker_client import WorkerChannel
from workers.contract.calls import Prefill, Submit
from workers.contract.messages import WorkerOutputs
from workers.contract.protocol import (
    EngineStats,
    FinishReason,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    WorkerRequest,
)


def event(index: int, token: int, last: bool = False) -> TokenEvent:
    return TokenEvent("r", index, [token], f"<{token}>",
                      logprobs=[TokenLogprob(token, -float(token), {})],
                      finish_reason=FinishReason.LENGTH if last else None)


class _QuietChannel(WorkerChannel):
    """A worker that takes commands and never answers on its own (the test feeds the stream)."""

    worker_id = "w"

    async def call(self, call):
        if isinstance(call, Submit):
            return None
        raise AssertionError(f"not asked of a quiet worker: {call}")

    async def next_outputs(self, subscriber, timeout_s, min_interval_s=0.0):
        await asyncio.Event().wait()


async def stream(num_samples: int = 1) -> RequestStream:
    client = ChannelClient(_QuietChannel(), "router")
    params = SamplingParams(n=num_samples, max_tokens=8)
    return client.generate(WorkerRequest("r", (1, 2, 3), params))  # type: ignore[return-value]


async def drain(s: RequestStream) -> list[TokenEvent]:
    return [e async for e in s]


def test_events_here_at_once_merge_until_a_finish():
    async def go():
        s = await stream()
        for token in (1, 2, 3):
            s.put(event(0, token))
        s.put(event(0, 4, last=True))
        return await drain(s)

    out = asyncio.run(go())
    assert len(out) == 1
    assert out[0].token_ids == [1, 2, 3, 4] and out[0].text == "<1><2><3><4>"
    assert [lp.token_id for lp in out[0].logprobs] == [1, 2, 3, 4]
    assert out[0].finish_reason is FinishReason.LENGTH


def test_samples_never_merge_with_each_other():
    async def go():
        s = await stream(num_samples=2)
        for e in (event(0, 1), event(0, 2), event(1, 7), event(0, 3, last=True),
                  event(1, 8, last=True)):
            s.put(e)
        return await drain(s)

    out = asyncio.run(go())
    assert [(e.index, e.token_ids) for e in out] == [(0, [1, 2]), (1, [7]), (0, [3]), (1, [8])]


def test_a_failure_after_events_is_raised_after_them():
    async def go():
        s = await stream()
        s.put(event(0, 1))
        s.put(WorkerUnavailableError("w", "gone"))
        first = await s.__anext__()
        with pytest.raises(WorkerUnavailableError):
            await s.__anext__()
        return first

    assert asyncio.run(go()).token_ids == [1]


class _SlowChannel(_QuietChannel):
    """A worker whose prefill never answers; it records the commands it is sent."""

    def __init__(self) -> None:
        self.commands: list[object] = []

    async def call(self, call):
        if isinstance(call, Submit):
            self.commands.extend(call.commands)
        elif isinstance(call, Prefill):
            await asyncio.Event().wait()


def test_a_silent_channel_fails_its_streams_as_the_worker_being_unavailable():
    async def go():
        client = ChannelClient(_QuietChannel(), "router", Deadlines(stall_s=0.05))
        s = client.generate(WorkerRequest("r", (1, 2, 3), SamplingParams(max_tokens=8)))
        with pytest.raises(WorkerUnavailableError, match="silent"):
            await asyncio.wait_for(s.__anext__(), 5)
        await client.close()

    asyncio.run(go())


def test_a_prefill_past_its_deadline_is_aborted_on_the_worker():
    async def go():
        channel = _SlowChannel()
        client = ChannelClient(channel, "router", Deadlines(prefill_s=0.05))
        with pytest.raises(WorkerUnavailableError, match="not answered in 0.05 s"):
            await client.prefill(WorkerRequest("p", (1, 2, 3), SamplingParams(max_tokens=8)))
        await asyncio.sleep(0.01)  # the abort goes out with the loop's next turn
        assert [type(c).__name__ for c in channel.commands] == ["Abort"]
        assert channel.commands[0].request_id == "p"
        await client.close()

    asyncio.run(go())


class _UnhealthyChannel(_QuietChannel):
    """A worker whose output channel says its engine is unhealthy (a stalled step)."""

    async def next_outputs(self, subscriber, timeout_s, min_interval_s=0.0):
        await asyncio.sleep(0.01)
        return WorkerOutputs((), (), (), EngineStats(0, 1, 0.0, 8, 0, 8, healthy=False))


def test_a_worker_reporting_itself_unhealthy_fails_its_streams_so_they_move():
    async def go():
        client = ChannelClient(_UnhealthyChannel(), "router")
        s = client.generate(WorkerRequest("r", (1, 2, 3), SamplingParams(max_tokens=8)))
        with pytest.raises(WorkerUnavailableError, match="unhealthy"):
            await asyncio.wait_for(s.__anext__(), 5)
        await client.close()

    asyncio.run(go())


class _RecordingChannel(_QuietChannel):
    """Answers each poll at once with nothing, noting the interval it was asked for."""

    def __init__(self, interval: float) -> None:
        self.output_interval_s = interval
        self.asked: list[float] = []

    async def next_outputs(self, subscriber, timeout_s, min_interval_s=0.0):
        self.asked.append(min_interval_s)
        await asyncio.sleep(0.005)
        return WorkerOutputs((), (), (), EngineStats(0, 0, 0.0, 8, 0, 8))


def test_the_reader_asks_for_its_channels_interval_between_messages():
    """Between processes a message per step costs a framed pickle (merged to one per ms);
    in one process a message is a return value, and merging would only delay tokens."""
    from cluster.inprocess_client import InProcessChannel
    from cluster.process_worker import ProcessChannel
    from cluster.worker_client import RayChannel

    assert InProcessChannel.output_interval_s == 0.0
    assert ProcessChannel.output_interval_s == RayChannel.output_interval_s == 0.001

    async def go():
        for interval in (0.0, 0.001):
            channel = _RecordingChannel(interval)
            client = ChannelClient(channel, "router")
            client.generate(WorkerRequest("r", (1, 2), SamplingParams(max_tokens=2)))
            await asyncio.sleep(0.05)
            await client.close()
            assert channel.asked and set(channel.asked) == {interval}

    asyncio.run(go())
