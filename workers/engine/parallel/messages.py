"""What crosses the driver <-> rank boundary: one typed message each way per step.

A step that samples carries a `SamplingRecord`: the last stage's first TP rank keeps a mirror of
every request it samples for (parameters sent once, then only the tokens appended since) and
replies with the sampled token ids (`SampledTokens`), not the logits. These records live only
between a driver and ranks of the same build (never stored, never across releases): no version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvtransfer.remote_messages import AgentHostAddress
from workers.engine.kv_cache.host_tier import NO_COPIES, BlockCopies
from workers.contract.protocol import SamplingParams, TokenLogprob


class RankConn(Protocol):
    """A rank's end of its channel to the driver (a pipe's; on Ray, a socket's)."""

    def send(self, obj: object) -> None: ...

    def recv(self) -> Any: ...


@dataclass(frozen=True)
class SamplingRequest:
    """A request the sampling rank has no mirror of yet (or a new sample under a known id):
    sent once, at its first sampling step there."""

    request_id: str
    params: SamplingParams
    eos_token_ids: frozenset[int]  # masked until min_tokens
    # the prompt, only with a repetition penalty (it sees the prompt's tokens); else ()
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # its output so far (a continuation's sent tokens)
    constrained: bool  # structured output: each step's row brings its grammar's mask


@dataclass(frozen=True)
class PromptLogprobRows:
    """Consecutive logit rows (after the sampling rows) that each predict a prompt token."""

    target_token_ids: tuple[int, ...]  # [num rows]: the prompt token each row predicts
    num_top: int  # top alternatives per row (the request's prompt_logprobs)


@dataclass(frozen=True)
class SamplingRecord:
    """What the sampling rank needs for one step beyond the logits: the first `len(rows)`
    `logit_rows` sample, one row per request id in `rows`; then `prompt_logprobs`' rows."""

    rows: tuple[str, ...]  # [num sampling rows]: request id of each
    # [num sampling rows]: output tokens the request gained since the rank last saw it
    appended: tuple[tuple[int, ...], ...]
    new: tuple[SamplingRequest, ...] = ()  # mirrors to create first
    finished: tuple[str, ...] = ()  # mirrors to drop first (finished, aborted, replaced)
    # [num constrained rows, ceil(vocab / 32)] int32: xgrammar token bitmasks (bit set: the
    # token is allowed) of the constrained rows, in row order; filled by the driver, which
    # holds the grammar matchers
    grammar_masks: torch.Tensor | None = None
    prompt_logprobs: tuple[PromptLogprobRows, ...] = ()


@dataclass(frozen=True)
class StepMessage:
    """One engine step, the same for every rank: a flat batch of new tokens from several
    sequences (decodes first), and which rows' logits the driver needs."""

    step_id: int  # increasing; replies carry it back
    input_ids: tuple[int, ...]  # [num_tokens]
    positions: tuple[int, ...]  # [num_tokens]
    slot_mapping: tuple[int, ...]  # [num_tokens]: cache slot of each token's K/V
    query_start_loc: tuple[int, ...]  # [num_seqs + 1]: prefix sums of new tokens per sequence
    seq_lens: tuple[int, ...]  # [num_seqs]: tokens in context after this step
    block_tables: tuple[tuple[int, ...], ...]  # [num_seqs][max_blocks], padded with 0
    num_decodes: int  # leading sequences with exactly one new token
    logit_rows: tuple[int, ...]  # rows (token indices) whose logits come back, in this order
    num_microbatches: int = 1  # pipeline micro-batches the batch is split into (by sequence)
    # KV copies between the cache and its host tier, made by each cache's holder before the
    # forward pass (workers.engine.kv_cache.host_caches)
    block_copies: BlockCopies = NO_COPIES
    # None: the logits of `logit_rows` come back; else the last rank samples them
    sampling: SamplingRecord | None = None
    # [num_seqs]: each sequence's LoRA adapter slot, -1 for the base model; (): none has one
    # (workers.models.lora)
    lora_slots: tuple[int, ...] = ()
    # (device slot, adapter name): adapters the driver's slot table brought in for this step,
    # copied from each holder's host copy into its slot before the forward pass, in order
    lora_writes: tuple[tuple[int, str], ...] = ()
    # > 0: a pure decode that every rank pads to this many rows and replays from its CUDA
    # graph of that size (one of `GraphsCaptured.sizes`; the driver chose it, so every rank's
    # captured collectives pair up); 0: run eagerly
    graph_size: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


@dataclass(frozen=True)
class LoadAdapter:
    """Read the PEFT adapter folder at `path` and keep this rank's shard of it on the host as
    `name` (each rank reads the folder itself: they share the driver's node). Answered by an
    `AdapterReply`."""

    name: str
    path: str


@dataclass(frozen=True)
class UnloadAdapter:
    """Forget adapter `name` if this rank has it (a load that failed on another rank is
    undone with one). Answered by an `AdapterReply`."""

    name: str


@dataclass(frozen=True)
class AdapterReply:
    """A rank's answer to `LoadAdapter` / `UnloadAdapter`. A bad adapter is no rank failure:
    the rank keeps nothing of it, says why, and serves on."""

    rank: int
    error: str | None = None  # the `LoraAdapterError`'s message; None: done


@dataclass(frozen=True)
class Shutdown:
    """The last message a rank gets: leave the process group and exit."""


@dataclass(frozen=True)
class RankTiming:
    """One rank's view of one step, in seconds and bytes."""

    rank: int
    wall_s: float  # from receiving the message to having the reply ready
    comm_s: float  # inside collectives and pipeline receives (waiting included)
    microbatch_busy_s: tuple[float, ...] = ()  # compute seconds per micro-batch
    comm_bytes: dict[str, int] = field(default_factory=dict)  # payload bytes by site
    tier_copy_s: float = 0.0  # copying KV blocks between the cache and its host tier

    @property
    def compute_s(self) -> float:
        return self.wall_s - self.comm_s


@dataclass(frozen=True)
class SampledTokens:
    """What the sampling rank picked for a step's `SamplingRecord`."""

    token_ids: tuple[int, ...]  # [len(rows)]
    logprobs: tuple[TokenLogprob | None, ...]  # [len(rows)]: None where not asked for
    prompt_logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()  # per `PromptLogprobRows`


@dataclass(frozen=True)
class StepReply:
    """Every rank replies to every step; only the last stage's first TP rank has logits (a
    step without a `SamplingRecord`) or sampled tokens (one with)."""

    step_id: int
    timing: RankTiming
    logits: torch.Tensor | None = None  # [len(logit_rows), vocab_size] float32
    sampled: SampledTokens | None = None


@dataclass(frozen=True)
class DeviceCacheSpec:
    """The KV caches a rank allocates, zeroed, on its own device (a GPU, or the CPU): one
    tensor of `shape` per layer of its stage."""

    num_layers: int  # this stage's
    shape: tuple[int, ...]  # [2, num_blocks, block_size, KV heads of this rank, head_dim]
    dtype: str  # a torch dtype name, e.g. "bfloat16"

    def with_blocks(self, num_blocks: int) -> DeviceCacheSpec:
        """The same caches, `num_blocks` blocks each."""
        planes, _, *rest = self.shape
        return DeviceCacheSpec(self.num_layers, (planes, num_blocks, *rest), self.dtype)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one KV block takes on this rank: its stage's layers, its heads."""
        planes, _, *rest = self.shape
        per_layer = planes * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        for dim in rest:
            per_layer *= dim
        return per_layer * self.num_layers


@dataclass(frozen=True)
class MemoryReport:
    """A rank started with a `KVProfile` has loaded its shard and run the profile step with
    the group: its device's memory readings (the first phase of a two-phase start; the driver
    turns them into a KV budget: `workers.engine.parallel.rank_memory`)."""

    rank: int
    total_bytes: int  # the device's memory
    peak_bytes: int  # torch's peak: the shard's weights, the profile step and its cache
    outside_torch_bytes: int  # held outside torch's allocator (the CUDA context, others)


@dataclass(frozen=True)
class AllocateCaches:
    """The driver's answer to every `MemoryReport`: the caches to allocate (the group's
    smallest budget sized them); the rank answers `Ready`."""

    kv_caches: DeviceCacheSpec


@dataclass(frozen=True)
class CaptureGraphs:
    """Sent by the driver to every rank, once, after every rank is `Ready` and before the first
    step (a group of one pipeline stage whose setups asked for graphs): capture the decode
    graphs of `sizes`, largest first. Every rank gets the same message and captures in the
    same order, so the all-reduces inside the graphs are captured in lockstep (NCCL requires
    it). Each rank answers `GraphsCaptured`."""

    sizes: tuple[int, ...]  # batch sizes in rows, ascending: `graph_ladder.capture_sizes`
    max_seq_len: int  # tokens: the longest context a captured step may attend over


@dataclass(frozen=True)
class GraphsCaptured:
    """A rank's answer to `CaptureGraphs`."""

    rank: int
    # the sizes whose decode steps it serves from static buffers: all of `CaptureGraphs.sizes`,
    # or () where its model or attention backend cannot be captured (the same on every rank)
    sizes: tuple[int, ...]
    captured: bool  # True: CUDA graphs; False: the static buffers run eagerly (the CPU)
    seconds: float  # wall time of the warm-up and capture


@dataclass(frozen=True)
class Ready:
    """A rank has joined the process group, loaded its shard and allocated its caches."""

    rank: int
    agent: AgentHostAddress | None = None  # where its KV transfer agent's host listens


@dataclass(frozen=True)
class RankFailed:
    """A rank's step (or start-up) raised; it exits after sending this."""

    rank: int
    error: str  # the traceback

    @property
    def summary(self) -> str:
        """The exception line, e.g. "FileNotFoundError: no config.json in ..."."""
        lines = [line for line in self.error.strip().splitlines() if line.strip()]
        return lines[-1] if lines else "unknown error"
