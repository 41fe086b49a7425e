"""A worker's call whose caller gives up after the worker took blocks for it leaves nothing held.

The caller's cancel comes at the worst moment, as a soak's faults make it: the op that holds or
reserves the blocks has run between two steps, and the call's answer (the offer that would end
the hold with its lease) is not made yet. That is a router's deadline (in one process), a lost
connection (a killed router: `cluster.socket_calls.serve_calls` cancels what it was serving) or
an `Abort` of the request (a client that went away) ending a prefix pull. Each case at the two
moments: while the op runs, and once it ran but before the caller resumed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable

import pytest

from workers.contract.calls import ExportPrefix, ExportRunning, LandPrefix, Pause
from workers.contract.messages import Abort, Generate, PrefixFetch
from workers.contract.prefix_cache import hash_block
from workers.contract.protocol import SamplingParams, WorkerRequest
from workers.engine.config import EngineConfig
from workers.serving.dispatch import dispatch
from workers.serving.worker import Worker

NUM_BLOCKS = 48
BLOCK = 16
PROMPT = tuple(range(7, 71))  # 64 tokens: 4 full blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LONG = dataclasses.replace(GREEDY, max_tokens=400)
MOMENTS = ("while_it_runs", "once_it_ran")


@pytest.fixture(scope="module")
def pair(tiny_model, run):
    """A worker whose prefix cache holds PROMPT's blocks, and one that pulls from it."""
    config = EngineConfig(model=tiny_model, num_blocks=NUM_BLOCKS, max_num_batched_tokens=256)
    workers = [Worker.from_config(wid, config, "both") for wid in ("src", "dst")]

    async def warm() -> None:
        for w in workers:
            await w.agents()
        await _drain(workers[0].stream(Generate(WorkerRequest("warm", PROMPT, GREEDY))))

    run(warm())
    yield workers
    for w in workers:
        run(w.shutdown())


def _hashes(tokens: tuple[int, ...]) -> tuple[int, ...]:
    out: list[int] = []
    for i in range(len(tokens) // BLOCK):
        out.append(hash_block(out[-1] if out else None, tokens[i * BLOCK:(i + 1) * BLOCK], None))
    return tuple(out)


async def _drain(stream) -> list[int]:
    return [t async for event in stream for t in event.token_ids]


def _give_up_in(worker: Worker, verb: str, monkeypatch, give_up: Callable[[], None],
                moment: str) -> list[str]:
    """Wrap the connector's `verb` (run between steps) so that the caller gives up
    (`give_up()`) as it runs, or just after (before the caller resumes); what ran is logged."""
    real = getattr(worker.connector, verb)
    ran: list[str] = []

    def wrapped(*args, **kwargs):
        result = real(*args, **kwargs)
        ran.append(verb)
        if moment == "while_it_runs":
            give_up()
        else:  # before the caller's wake-up, which the op's result schedules after this
            asyncio.get_running_loop().call_soon(give_up)
        return result

    monkeypatch.setattr(worker.connector, verb, wrapped)
    return ran


async def _nothing_held(worker: Worker, timeout_s: float = 5.0) -> dict[str, int]:
    """What the worker still holds once it settles (empty when nothing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        await asyncio.sleep(0.02)
        held = {k: v for k, v in worker.resources().items() if v}
        free = worker.stats().num_free_blocks
        if (not held and free == NUM_BLOCKS) or time.monotonic() > deadline:
            return {**held, **({"blocks": NUM_BLOCKS - free} if free != NUM_BLOCKS else {})}


async def _cancelled_call(worker: Worker, call, verb: str, monkeypatch, moment: str) -> None:
    """`call` dispatched as a task (as a transport serves it), cancelled at `moment` of
    `verb`."""
    task: list[asyncio.Task] = []
    ran = _give_up_in(worker, verb, monkeypatch, lambda: task[0].cancel(), moment)
    task.append(asyncio.get_running_loop().create_task(dispatch(worker, call)))
    with pytest.raises(asyncio.CancelledError):
        await task[0]
    assert ran == [verb]  # the blocks were taken: the cancel came after


@pytest.mark.parametrize("moment", MOMENTS)
def test_an_export_of_a_prefix_given_up_frees_its_hold(pair, run, monkeypatch, moment):
    src, _ = pair

    async def go() -> None:
        call = ExportPrefix(f"ex-{moment}", _hashes(PROMPT))
        await _cancelled_call(src, call, "export_prefix", monkeypatch, moment)
        assert await _nothing_held(src) == {}

    run(go())


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_prefix_landing_given_up_frees_its_reserved_blocks(pair, run, monkeypatch, moment):
    src, dst = pair

    async def go() -> None:
        rid = f"land-{moment}"
        handoff = await dispatch(src, ExportPrefix(rid, _hashes(PROMPT)))
        call = LandPrefix(rid, PrefixFetch(handoff, _hashes(PROMPT)), PROMPT)
        await _cancelled_call(dst, call, "reserve_prefix", monkeypatch, moment)
        assert await _nothing_held(dst) == {}
        src.transfer.cancel(f"{rid}#prefix")  # nobody pulls it: its lease ends now
        assert await _nothing_held(src) == {}

    run(go())


@pytest.mark.parametrize("moment", MOMENTS)
def test_an_abort_while_a_prefix_is_reserved_for_a_request_frees_it(pair, run, monkeypatch,
                                                                    moment):
    """A client going away (an `Abort`) while the worker reserves blocks for the prefix its
    request pulls before it runs."""
    src, dst = pair

    async def go() -> None:
        rid = f"gen-{moment}"
        req = WorkerRequest(rid, PROMPT + (5, 6, 7), GREEDY)
        handoff = await dispatch(src, ExportPrefix(rid, _hashes(PROMPT)))
        ran = _give_up_in(dst, "reserve_prefix", monkeypatch,
                          lambda: dst.submit("router", [Abort(rid)]), moment)
        dst.submit("router", [Generate(req, PrefixFetch(handoff, _hashes(PROMPT)))])
        assert await _nothing_held(dst) == {}
        assert ran == ["reserve_prefix"]
        src.transfer.cancel(f"{rid}#prefix")
        assert await _nothing_held(src) == {}

    run(go())


def test_an_abort_behind_a_hung_step_frees_the_prefix_reserved_for_its_request(pair, run,
                                                                              monkeypatch):
    """The soak's path, with no hook in the op: a step hangs (its `step_stall`), the router
    gives up on the requests queued behind it and aborts them, and one of them was waiting
    for the step's end to reserve blocks for the prefix it pulls."""
    src, dst = pair
    rid = "behind-a-hung-step"
    entered, gate = threading.Event(), threading.Event()

    async def go() -> None:
        handoff = await dispatch(src, ExportPrefix(rid, _hashes(PROMPT)))
        reader = await _running(dst, "hung")
        real = dst.engine.step

        def hung_step():
            entered.set()
            gate.wait(10.0)
            return real()

        monkeypatch.setattr(dst.engine, "step", hung_step)
        assert await asyncio.to_thread(entered.wait, 10.0)  # the step thread hangs now
        req = WorkerRequest(rid, PROMPT + (5, 6, 7), GREEDY)
        dst.submit("router", [Generate(req, PrefixFetch(handoff, _hashes(PROMPT)))])
        await asyncio.sleep(0.05)  # its pull waits to reserve blocks, behind the step
        assert dst.resources()["pulls"] == 1 and dst.engine.kv.ledger.num_held == 0
        dst.submit("router", [Abort(rid)])
        reader.cancel()
        gate.set()
        monkeypatch.setattr(dst.engine, "step", real)
        await asyncio.gather(reader, return_exceptions=True)
        assert await _nothing_held(dst) == {}
        src.transfer.cancel(f"{rid}#prefix")
        assert await _nothing_held(src) == {}

    try:
        run(go())
    finally:
        gate.set()


async def _running(worker: Worker, rid: str) -> asyncio.Task[list[int]]:
    """A long request running on `worker`, its first token out; the task reading the rest."""
    stream = worker.stream(Generate(WorkerRequest(rid, PROMPT, LONG)))
    first = await stream.__anext__()
    assert first.token_ids
    reader = asyncio.get_running_loop().create_task(_drain(stream))
    return reader


@pytest.mark.parametrize("moment", MOMENTS)
def test_an_export_of_a_running_request_given_up_frees_its_hold(pair, run, monkeypatch,
                                                               moment):
    src, _ = pair

    async def go() -> None:
        rid = f"run-{moment}"
        reader = await _running(src, rid)
        await _cancelled_call(src, ExportRunning(rid), "export_running", monkeypatch, moment)
        reader.cancel()  # the request ends here (aborted); what the export held must go too
        await asyncio.gather(reader, return_exceptions=True)
        assert await _nothing_held(src) == {}

    run(go())


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_pause_given_up_frees_the_paused_blocks_and_ends_the_stream(pair, run, monkeypatch,
                                                                     moment):
    src, _ = pair

    async def go() -> None:
        rid = f"pause-{moment}"
        reader = await _running(src, rid)
        await _cancelled_call(src, Pause(rid), "pause", monkeypatch, moment)
        done, _ = await asyncio.wait([reader], timeout=5.0)
        assert done, "the paused request's stream never ended"
        assert isinstance(reader.exception(), Exception)  # failed: the router moves it on
        assert await _nothing_held(src) == {}

    run(go())
