"""Where the driver's step runs: in this process (`LocalExecutor`) or on a group of ranks.

Both take a `StepMessage` and return the logits of its `logit_rows`; both own the KV cache the
step writes. The runner cannot tell them apart.
"""

from __future__ import annotations

import dataclasses
import socket
import weakref
from dataclasses import dataclass

import torch

from kvtransfer.remote_messages import AgentHostAddress
from workers.engine.kv_cache.spec import KVCacheSpec
from workers.engine.parallel.graph_ladder import capture_sizes, padded_size
from workers.engine.parallel.group import RankGroup, RankLauncher, SpawnLauncher
from workers.engine.parallel.local import LocalExecutor, ModelExecutor, SamplingExecutor
from workers.engine.parallel.messages import (
    AdapterReply,
    AllocateCaches,
    CaptureGraphs,
    GraphsCaptured,
    LoadAdapter,
    RankTiming,
    SampledTokens,
    StepMessage,
    UnloadAdapter,
)
from workers.engine.parallel.pipeline import stage_layers
from workers.engine.parallel.rank import DeviceCacheSpec, rank_main
from workers.engine.parallel.rank_setup import RankCaches, RankSetup
from workers.engine.parallel.rank_memory import KVSizing, group_num_blocks
from workers.engine.parallel.shared_cache import SharedCaches
from workers.models.lora import LoraAdapterError

__all__ = ["GroupExecutor", "GroupOptions", "KVCacheNotShared", "LocalExecutor",
           "ModelExecutor", "SamplingExecutor", "rank_setups"]


@dataclass(frozen=True)
class GroupOptions:
    """How a worker group runs; mirrors the parallel fields of `EngineConfig`."""

    tp_size: int
    pp_size: int
    expert_parallel: bool
    model: str
    dtype: str  # resolved torch dtype name, e.g. "float32"
    load_format: str
    seed: int
    attention_backend: str
    timeout_s: float
    device: str  # the ranks' kind: "cpu" (gloo) or "cuda" (NCCL, one GPU per rank)
    host_blocks: int = 0  # the KV cache's host tier: each rank keeps its own share
    # > 0 (one pipeline stage only): decode batches up to this many sequences replay CUDA
    # graphs on the ranks (on the CPU: their static buffers, eagerly); 0: eager
    graph_batch_size: int = 0
    max_model_len: int = 0  # tokens: the longest context a graph attends over (with graphs)
    max_loras: int = 0  # > 0: LoRA adapters on every rank's shard, this many slots; 0: none
    max_lora_rank: int = 0


GPU_GROUP_KV_ERROR = (
    "the KV cache of a GPU pipeline-parallel group lives on its ranks' devices, each stage "
    "holding some layers; KV handoff from/to such a worker is not supported yet — serve it as "
    "an aggregated pool")
RANK_AGENTS_KV_ERROR = (
    "the KV cache of a tensor-parallel group lives in its ranks; each rank's own transfer "
    "agent serves its shard (`agent_hosts`)")


class KVCacheNotShared(RuntimeError):
    """The executor's KV cache is out of this process's reach: the ranks' own agents hand it
    off (`agent_hosts`), or nothing can."""


class GroupExecutor(SamplingExecutor):
    """tp_size x pp_size ranks, each its own process, started by `launcher` (default: spawned
    processes): on the CPU over gloo, or one GPU each over NCCL (`options.device`).

    Each rank allocates its caches (one tensor per layer holding its heads) and, with one
    pipeline stage, serves them through its own transfer agent (`agent_hosts`): the same code
    on GPUs and on the CPU. A pipeline-parallel group on the CPU is the exception: its caches
    are allocated here in one file of shared memory (`SharedCaches`) that the ranks of each
    layer's stage map, so this process's agents serve every layer of a TP rank's heads
    (`kv_caches_by_rank`); the file is unlinked once every rank is ready, or when the start
    fails. A pipeline-parallel GPU group serves aggregated only. The last stage's first TP rank
    samples (`execute_sampled`: token ids come back); `execute` brings the logits back on the
    CPU.

    With `options.graph_batch_size` every rank is sent the same `CaptureGraphs` once all are
    ready (after a measured start's allocation), and captures its ladder in lockstep with the
    others; afterwards this driver picks each pure decode's padded size (`graph_size`) for
    every rank (`graph_sizes`: the sizes the ranks serve, () when eager).
    """

    def __init__(self, options: GroupOptions, spec: KVCacheSpec,
                 launcher: RankLauncher | None = None, sizing: KVSizing | None = None) -> None:
        """`sizing` (GPU groups only): the ranks measure their memory first and the cache gets
        the blocks the tightest rank has room for (`num_blocks`; `spec.num_blocks` is ignored);
        without it the cache has `spec.num_blocks`."""
        if sizing is not None and options.device != "cuda":
            raise ValueError(f"only a GPU group sizes its KV cache by profiling its ranks; "
                             f"device={options.device!r}")
        tp, pp = options.tp_size, options.pp_size
        self.tp_size, self.pp_size = tp, pp
        num_layers, kv_dtype = spec.num_layers, spec.dtype
        # each rank holds its share of the KV heads; a latent is whole on every rank
        heads = spec.num_kv_heads if spec.latent else spec.num_kv_heads // tp
        shape = (spec.planes, spec.num_blocks, spec.block_size, heads, spec.cache_head_dim)
        shared = (SharedCaches(tp * num_layers, shape, kv_dtype)
                  if options.device == "cpu" and pp > 1 else None)
        # [tp rank][layer]: `shape`, views of what the CPU ranks write; None: in the ranks
        self.caches = (None if shared is None else
                       [shared.tensors[t * num_layers:(t + 1) * num_layers] for t in range(tp)])
        try:
            setups = rank_setups(options, num_layers, shape, kv_dtype, shared)
            if sizing is not None:
                setups = [dataclasses.replace(s, profile=sizing.profile) for s in setups]
            self.group = RankGroup(rank_main, setups, launcher or SpawnLauncher(),
                                   options.timeout_s, measure_first=sizing is not None)
        finally:
            if shared is not None:
                shared.unlink()  # every rank has mapped it (or the group failed to start)
        self._finalizer = weakref.finalize(self, self.group.close)
        self.num_blocks = spec.num_blocks  # of the cache, the same on every rank
        if sizing is not None:
            self.num_blocks = self._size_caches(setups, sizing)
        self.last_timings: list[RankTiming] = []  # per rank, of the last step
        self.block_size = spec.block_size
        self.graph_sizes: tuple[int, ...] = ()
        self.graphs_captured = False  # True: the ranks replay CUDA graphs (not on the CPU)
        self.max_model_len = options.max_model_len
        if options.graph_batch_size:
            self.graph_sizes = self._capture_graphs(options)

    def _capture_graphs(self, options: GroupOptions) -> tuple[int, ...]:
        """Every rank captures the same ladder (the group is stopped when one fails); the
        sizes they serve, the same on every rank."""
        request = CaptureGraphs(tuple(capture_sizes(options.graph_batch_size)),
                                options.max_model_len)
        try:
            replies = self.group.broadcast(
                request, GraphsCaptured, "CUDA graph capture", self.group.start_timeout_s)
            if len({r.sizes for r in replies}) != 1:
                raise RuntimeError(f"the ranks captured different decode graphs: "
                                   f"{[r.sizes for r in replies]}")
        except BaseException:
            self.group.close()
            raise
        self.graphs_captured = all(r.captured for r in replies)
        return replies[0].sizes

    def padded(self, msg: StepMessage) -> StepMessage:
        """`msg` with the graph size every rank pads it to (0: eager): the driver's decision,
        so that all ranks replay the same graph."""
        if not self.graph_sizes:
            return msg
        max_blocks = -(-self.max_model_len // self.block_size)
        size = padded_size(msg, self.graph_sizes, self.max_model_len, max_blocks)
        return dataclasses.replace(msg, graph_size=size or 0)

    def _size_caches(self, setups: list[RankSetup], sizing: KVSizing) -> int:
        """The second phase of a measured start: the blocks every rank has room for, allocated
        on each; the group is stopped when that fails."""
        try:
            templates = [s.kv_caches for s in setups
                         if isinstance(s.kv_caches, DeviceCacheSpec)]
            if len(templates) != len(setups):
                raise ValueError("a measured start sizes device caches; some ranks were given "
                                 "caches in shared memory")
            num_blocks = group_num_blocks(self.group.reports, sizing.budget,
                                          [t.bytes_per_block for t in templates])
            self.group.allocate([AllocateCaches(t.with_blocks(num_blocks))
                                 for t in templates])
        except BaseException:
            self.group.close()
            raise
        return num_blocks

    def execute(self, msg: StepMessage) -> torch.Tensor:
        replies = self.group.step(self.padded(msg))
        self.last_timings = [r.timing for r in replies]
        logits = replies[(self.pp_size - 1) * self.tp_size].logits  # on the CPU
        if logits is None:
            return torch.empty(0, 0)
        return logits

    def execute_sampled(self, msg: StepMessage) -> SampledTokens:
        if msg.sampling is None:
            raise ValueError(f"step {msg.step_id} carries no sampling record")
        replies = self.group.step(self.padded(msg))
        self.last_timings = [r.timing for r in replies]
        sampled = replies[(self.pp_size - 1) * self.tp_size].sampled
        if sampled is None:
            raise RuntimeError(f"the last rank sent no sampled tokens for step {msg.step_id}")
        return sampled

    @property
    def last_tier_copy_s(self) -> float:
        return max((t.tier_copy_s for t in self.last_timings), default=0.0)

    def kv_caches_by_rank(self) -> list[list[torch.Tensor]]:
        if self.caches is None:
            raise KVCacheNotShared(RANK_AGENTS_KV_ERROR if self.pp_size == 1
                                   else GPU_GROUP_KV_ERROR)
        return self.caches

    def agent_hosts(self) -> list[AgentHostAddress] | None:
        hosts = [ready.agent for ready in self.group.ready[:self.tp_size]]
        known = [h for h in hosts if h is not None]
        return known if len(known) == len(hosts) else None

    def load_adapter(self, name: str, path: str) -> None:
        """Every rank reads the PEFT adapter at `path` and keeps its shard as `name`. A bad
        one raises `LoraAdapterError` (the first rank's reason) and no rank keeps it."""
        replies = self.group.broadcast(LoadAdapter(name, path), AdapterReply,
                                       f"loading adapter {name!r}", self.group.timeout_s)
        errors = [r.error for r in replies if r.error is not None]
        if errors:  # the ranks that took it forget it: nothing half-loaded
            self.unload_adapter(name)
            raise LoraAdapterError(errors[0])

    def unload_adapter(self, name: str) -> None:
        """Every rank forgets adapter `name` (a rank without it does nothing)."""
        self.group.broadcast(UnloadAdapter(name), AdapterReply, f"unloading adapter {name!r}",
                             self.group.timeout_s)

    def close(self) -> None:
        self._finalizer()


def rank_setups(options: GroupOptions, num_layers: int, cache_shape: tuple[int, ...],
                kv_dtype: torch.dtype, shared: SharedCaches | None) -> list[RankSetup]:
    """Every rank's setup, in global rank order. With `shared` (a pipeline-parallel CPU group)
    ranks get descriptors of their caches in it (tensor `t * num_layers + layer` holds TP rank
    t's heads of `layer`); otherwise a `DeviceCacheSpec` of `cache_shape` per layer of their
    stage, and with one stage each rank hosts its own transfer agent."""
    tp, pp = options.tp_size, options.pp_size
    if options.graph_batch_size and (pp > 1 or options.max_model_len < 1):
        raise ValueError(f"decode graphs (graph_batch_size={options.graph_batch_size}) need "
                         f"one pipeline stage and a max_model_len; got pp_size={pp}, "
                         f"max_model_len={options.max_model_len}")
    if shared is not None and (options.device != "cpu" or pp == 1):
        raise ValueError(f"only a pipeline-parallel CPU group maps the driver's shared "
                         f"caches; got device={options.device!r}, pp_size={pp}")
    stages = stage_layers(num_layers, pp)
    dtype = str(kv_dtype).removeprefix("torch.")

    def caches(t: int, layers: range) -> RankCaches:
        if shared is None:
            return DeviceCacheSpec(len(layers), tuple(cache_shape), dtype)
        return tuple(shared.refs[t * num_layers + i] for i in layers)

    init_method = f"tcp://127.0.0.1:{_free_port()}"
    return [RankSetup(rank=stage * tp + t, tp_size=tp, pp_size=pp,
                      expert_parallel=options.expert_parallel, init_method=init_method,
                      model=options.model, dtype=options.dtype,
                      load_format=options.load_format, seed=options.seed,
                      attention_backend=options.attention_backend,
                      kv_caches=caches(t, stages[stage]), timeout_s=options.timeout_s,
                      device=options.device, host_blocks=options.host_blocks,
                      serves_kv=pp == 1, graph_batch_size=options.graph_batch_size,
                      max_loras=options.max_loras, max_lora_rank=options.max_lora_rank)
            for stage in range(pp) for t in range(tp)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
