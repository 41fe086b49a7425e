"""The worker's one dispatch: each call record of the worker channel (`workers.contract.calls`)
to the method of the `Worker`, or of its part, that answers it. No torch at import.

Every transport ends here: in one process `cluster.inprocess_client.InProcessChannel` calls
`dispatch`; a worker process and an engine actor serve it on their socket
(`cluster.socket_calls.serve_channel`). A record with no entry is refused by name, and a test
checks that every record of the contract has one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from workers.contract.calls import (
    CALLS_VERSION,
    Call,
    CancelMigration,
    Embed,
    ExportPrefix,
    ExportRunning,
    Health,
    HotPrefixes,
    Info,
    LandPrefix,
    LoadLoraAdapter,
    LoraAdapters,
    Pause,
    Prefill,
    PrepareMigration,
    SnapshotKV,
    Stats,
    Submit,
    UnloadLoraAdapter,
)

if TYPE_CHECKING:
    from workers.serving.worker import Worker

R = TypeVar("R")

# record type -> its handler on the worker (a method's value, or an awaitable of it)
HANDLERS: dict[type[Call[Any]], Callable[[Worker, Any], Any]] = {
    Info: lambda w, c: w.info,
    Health: lambda w, c: w.health(),
    Stats: lambda w, c: w.stats(),
    SnapshotKV: lambda w, c: w.async_engine.apply(w.connector.kv_snapshot),
    Submit: lambda w, c: w.submit(c.subscriber, c.commands),
    Prefill: lambda w, c: w.prefill(c.req, c.decode_tp_size, c.prefix),
    ExportPrefix: lambda w, c: w.prefixes.export(c.request_id, c.block_hashes,
                                                 c.reader_tp_size),
    HotPrefixes: lambda w, c: w.prefixes.hot(c.max_blocks),
    LandPrefix: lambda w, c: w.prefixes.land(c.request_id, c.fetch, c.token_ids,
                                             w.block_size),
    ExportRunning: lambda w, c: w.migrations.export(c.request_id, c.reader_tp_size),
    PrepareMigration: lambda w, c: w.prepare_migration(c.request_id, c.exported),
    Pause: lambda w, c: w.migrations.pause(c.request_id, c.reader_tp_size),
    CancelMigration: lambda w, c: w.migrations.cancel(c.request_id),
    Embed: lambda w, c: w.embed(c.token_ids, c.pooling, c.normalize),
    LoadLoraAdapter: lambda w, c: w.adapters.load(c.lora_name, c.lora_path),
    UnloadLoraAdapter: lambda w, c: w.adapters.unload(c.lora_name),
    LoraAdapters: lambda w, c: w.adapters.paths(),
}


async def dispatch(worker: Worker, call: Call[R]) -> R:
    """`call` answered by `worker` (on its event loop's thread). Raises `TypeError` for a
    record with no handler, `ValueError` for one of another version, and whatever the handler
    raises (the worker's refusals)."""
    handler = HANDLERS.get(type(call))
    if handler is None:
        raise TypeError(f"worker {worker.worker_id!r} has no handler for "
                        f"{type(call).__name__}; it answers "
                        f"{sorted(t.__name__ for t in HANDLERS)}")
    if call.version != CALLS_VERSION:
        raise ValueError(f"{type(call).__name__} is of version {call.version}; worker "
                         f"{worker.worker_id!r} speaks version {CALLS_VERSION}")
    answer = handler(worker, call)
    if inspect.isawaitable(answer):
        answer = await answer
    return answer
