"""The calls of the worker channel: each operation a router asks of a worker and waits for, as
one typed record whose base names its result type (`Prefill` is a `Call[PrefillResult]`).
Torch-free.

A router makes one with `router.worker_client.WorkerClient.call` (its named methods, such as
`export_prefix`, build the record); a transport carries the record whole
(`router.worker_client.WorkerChannel.call`: in one process, to a worker process, to a Ray
actor's socket) and knows nothing of what it asks; the worker answers it through its one table
(`workers.serving.dispatch`). The streaming commands (`Generate`, `DecodeFromHandoff`,
`Resume`) and `Abort` are in `workers.contract.messages`: they ride `Submit`, and their events
come back on the output channel (`WorkerOutputs`).

Adding an operation: its record here, its handler in `workers.serving.dispatch`, a test.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from workers.contract.messages import Command, Paused, PrefillResult, PrefixFetch
from workers.contract.prefix_cache import HotPrefix, KVSnapshot
from workers.contract.protocol import EngineStats, WorkerInfo, WorkerRequest

if TYPE_CHECKING:
    from kvtransfer.handoff import KVHandoff

CALLS_VERSION = 1  # the worker refuses a record of another version (`workers.serving.dispatch`)

R = TypeVar("R")


@dataclass(frozen=True)
class Call(Generic[R]):
    """One operation on a worker whose answer is an `R`. A worker raises its own refusals
    (`InvalidRequestError`, `ValueError` for a role that cannot, `KVPullFailed`) to the caller
    as it raised them."""

    version: int = field(default=CALLS_VERSION, kw_only=True, repr=False)

    def undone_by_abort(self) -> str | None:
        """The request whose `Abort` undoes this call on the worker when its caller gives up
        (a cancel does not cross a process boundary); None: nothing to undo."""
        return None


@dataclass(frozen=True)
class Info(Call[WorkerInfo]):
    """The worker's description (role, block size, model shape, TP size)."""


@dataclass(frozen=True)
class Health(Call[bool]):
    """True when the worker can take requests."""


@dataclass(frozen=True)
class Stats(Call[EngineStats]):
    """The worker's load as of its last step (routers route on the copy each output message
    carries instead)."""


@dataclass(frozen=True)
class SnapshotKV(Call[KVSnapshot]):
    """The block hashes the worker's prefix cache holds now (a router's resync)."""


@dataclass(frozen=True)
class Submit(Call[None]):
    """Start or abort requests, in order, for `subscriber` (a router), whose events then come
    on its output channel; a refused one arrives there as a failure. A router sends the
    commands of one event-loop turn in one `Submit`."""

    subscriber: str
    commands: tuple[Command, ...]


@dataclass(frozen=True)
class Prefill(Call[PrefillResult]):
    """Run the prompt to its first token and offer its KV under a lease per TP rank, each for
    the decode worker's `decode_tp_size` ranks to pull; with `prefix` (another worker's
    `ExportPrefix`) that part of the prompt is pulled first, not computed."""

    req: WorkerRequest
    decode_tp_size: int = 1
    prefix: PrefixFetch | None = None

    def undone_by_abort(self) -> str | None:
        return self.req.request_id


@dataclass(frozen=True)
class ExportPrefix(Call["KVHandoff | None"]):
    """Offer the KV of the leading `block_hashes` cached here (up to the first miss) under a
    lease per rank, for the worker of `reader_tp_size` ranks that will run `request_id`; None
    when none of them is cached."""

    request_id: str
    block_hashes: tuple[int, ...]
    reader_tp_size: int = 1


@dataclass(frozen=True)
class HotPrefixes(Call[tuple[HotPrefix, ...]]):
    """Hand-off, source: the prefixes requests hit here lately, most worth first, still
    cached, within `max_blocks` in all."""

    max_blocks: int


@dataclass(frozen=True)
class LandPrefix(Call[int]):
    """Hand-off, target: pull `fetch` (another worker's `ExportPrefix` of `token_ids`' blocks)
    into the prefix cache with no request to run; answers the blocks landed (0: the pull failed
    or found no room, and nothing is held)."""

    request_id: str
    fetch: PrefixFetch
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ExportRunning(Call[dict[int, "KVHandoff"]]):
    """Live migration, source: offer the running request's full computed blocks (it decodes
    on), by sample index; a sample with none is left out."""

    request_id: str
    reader_tp_size: int = 1


@dataclass(frozen=True)
class PrepareMigration(Call[dict[int, int]]):
    """Live migration, target: pull `exported` (the source's `ExportRunning`) ahead of the
    `Resume`; answers how many blocks landed, by sample index. Raises `KVPullFailed`."""

    request_id: str
    exported: Mapping[int, KVHandoff]


@dataclass(frozen=True)
class Pause(Call[Paused]):
    """Live migration, source: stop the request between two steps; its stream there ends with
    `RequestMoved` after every token it produced, and the blocks written since `ExportRunning`
    are offered."""

    request_id: str
    reader_tp_size: int = 1


@dataclass(frozen=True)
class CancelMigration(Call[None]):
    """A live migration that will not happen: let go of what `ExportRunning` offered or
    `PrepareMigration` landed for the request, now rather than when their leases end."""

    request_id: str


@dataclass(frozen=True)
class LoadLoraAdapter(Call[tuple[str, ...]]):
    """Read the PEFT adapter folder at `lora_path` and serve it as `lora_name` (between two
    steps); answers the adapters loaded here after it. Raises `ValueError`
    (`LoraAdapterError`) naming what is wrong, with nothing kept: a bad folder, a rank over
    `max_lora_rank`, a name already loaded, or a worker started without `enable_lora`.

    Without `lora_path` (a load on demand: a request named it): the folder `lora_name` in the
    worker's `EngineConfig.lora_dir`; a name already loaded is kept as is (two routers may ask
    at once), and `KeyError` when there is no such folder (or no `lora_dir`)."""

    lora_name: str
    lora_path: str | None = None


@dataclass(frozen=True)
class UnloadLoraAdapter(Call[tuple[str, ...]]):
    """Stop serving adapter `lora_name`; answers the adapters loaded here after it. Raises
    `KeyError` when it is not loaded, `ValueError` while requests here still run under it."""

    lora_name: str


@dataclass(frozen=True)
class LoraAdapters(Call[dict[str, str]]):
    """The LoRA adapters loaded here: name -> the folder each was read from (none without
    `enable_lora`)."""


POOLINGS = ("last", "mean")  # how `Embed` pools a prompt's final hidden states


@dataclass(frozen=True)
class Embeddings:
    """`Embed`'s answer: one vector per prompt, in order (fp32 values, `hidden_size` each)."""

    vectors: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class Embed(Call[Embeddings]):
    """Run whole prompts through the model (no sampling, nothing cached or kept) and pool each
    one's final hidden states (the final norm's output): its last token's (`last`) or their
    mean (`mean`), scaled to unit length when `normalize`. Raises `InvalidRequestError` for a
    pooling it does not know or a worker whose model is split over ranks."""

    token_ids: tuple[tuple[int, ...], ...]
    pooling: str = "last"
    normalize: bool = True
