"""The worker's one dispatch (`workers.serving.dispatch`): every call record of the contract
(`workers.contract.calls`) has a handler that receives all of the record's fields; a record it
does not know, or of another version, is refused by name; every record survives the trip across
a process boundary."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
from typing import Any

import pytest

from workers.contract import calls
from workers.contract.calls import Call
from workers.contract.messages import Abort, PrefixFetch
from workers.contract.protocol import SamplingParams, WorkerRequest
from workers.serving.dispatch import HANDLERS, dispatch

HANDOFF: Any = "a handoff"  # the dispatch passes it on unread


def call_records() -> list[type[Call[Any]]]:
    """Every call record the contract module defines."""
    return [v for v in vars(calls).values()
            if isinstance(v, type) and issubclass(v, Call) and v is not Call]


def example(record: type[Call[Any]]) -> Call[Any]:
    """An instance of `record` whose every field holds a value of its own."""
    values: dict[str, Any] = {
        "request_id": "req-7", "block_hashes": (11, 12), "reader_tp_size": 3,
        "decode_tp_size": 2, "max_blocks": 64, "token_ids": (5, 6, 7),
        "subscriber": "router-a", "commands": (Abort("req-1"),),
        "req": WorkerRequest("req-8", (1, 2, 3), SamplingParams(max_tokens=4)),
        "fetch": PrefixFetch(HANDOFF, (11,)), "prefix": PrefixFetch(HANDOFF, (13,)),
        "exported": {0: "handoff-0"}, "pooling": "mean", "normalize": False,
        "lora_name": "sql", "lora_path": "/adapters/sql",
    }
    fields = [f.name for f in dataclasses.fields(record) if f.name != "version"]
    missing = [f for f in fields if f not in values]
    if missing:
        raise AssertionError(f"give {record.__name__}'s fields {missing} example values here")
    return record(**{f: values[f] for f in fields})


class _Recorder:
    """Stands in for a worker: any attribute is another recorder, any call is noted with its
    arguments (and answers a recorder)."""

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self._log = log
        self.worker_id = "w0"

    def __getattr__(self, name: str) -> _Recorder:
        return _Recorder(self._log)

    def __call__(self, *args: Any) -> _Recorder:
        self._log.append(args)
        return _Recorder(self._log)


def test_every_call_record_of_the_contract_has_a_handler():
    records = call_records()
    assert records, "the contract defines no call record"
    unhandled = sorted(r.__name__ for r in records if r not in HANDLERS)
    assert not unhandled, f"call records with no handler in workers.serving.dispatch: {unhandled}"
    assert set(HANDLERS) == set(records)  # the table answers nothing the contract lacks


@pytest.mark.parametrize("record", call_records(), ids=lambda r: r.__name__)
def test_each_handler_receives_every_field_of_its_record(record):
    call = example(record)
    log: list[tuple[Any, ...]] = []
    HANDLERS[record](_Recorder(log), call)
    passed = [a for args in log for a in args]
    for f in dataclasses.fields(record):
        if f.name != "version":
            value = getattr(call, f.name)
            assert any(a is value for a in passed), f"{record.__name__}.{f.name} is not passed"


@pytest.mark.parametrize("record", call_records(), ids=lambda r: r.__name__)
def test_each_record_is_frozen_and_crosses_a_process_boundary_whole(record):
    call = example(record)
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.version = 2  # type: ignore[misc]
    back = pickle.loads(pickle.dumps(call))
    assert back == call and back.version == calls.CALLS_VERSION


def test_a_record_with_no_handler_or_of_another_version_is_refused_by_name():
    @dataclasses.dataclass(frozen=True)
    class Unheard(Call[int]):
        pass

    worker: Any = _Recorder([])
    with pytest.raises(TypeError, match="no handler for Unheard"):
        asyncio.run(dispatch(worker, Unheard()))
    with pytest.raises(ValueError, match="Stats is of version 99; worker 'w0' speaks version 1"):
        asyncio.run(dispatch(worker, calls.Stats(version=99)))


def test_only_a_prefill_is_undone_by_an_abort_when_its_caller_gives_up():
    undone = {r.__name__: example(r).undone_by_abort() for r in call_records()}
    assert undone.pop("Prefill") == "req-8"
    assert set(undone.values()) == {None}
