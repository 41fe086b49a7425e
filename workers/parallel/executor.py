"""Where the driver's step runs: in this process (`LocalExecutor`) or on a group of ranks.

Both take a `StepMessage` and return the logits of its `logit_rows`; both own the KV cache the
step writes. The runner cannot tell them apart.
"""

from __future__ import annotations

import abc
import socket
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from workers.parallel.group import RankGroup, RankLauncher, SpawnLauncher
from workers.parallel.messages import RankTiming, StepMessage
from workers.parallel.pipeline import MicroBatch, microbatch_tensors, stage_layers
from workers.parallel.rank import RankSetup, rank_main
from workers.parallel.shared_cache import SharedCaches, SharedTensor


class ModelExecutor(abc.ABC):
    @abc.abstractmethod
    def execute(self, msg: StepMessage) -> torch.Tensor:
        """Runs the step (writing its K/V into the cache); returns the logits of
        `msg.logit_rows`, [len(logit_rows), vocab_size] float32, on the driver's device."""

    @abc.abstractmethod
    def kv_caches_by_rank(self) -> list[list[torch.Tensor]]:
        """Per TP rank, per layer (all stages): `[2, num_blocks, block_size, heads, head_dim]`
        with `heads` that rank's KV heads. Shared with the ranks: writes land in their cache."""

    def close(self) -> None:
        """Stop whatever runs the model (idempotent)."""


class LocalExecutor(ModelExecutor):
    def __init__(self, model: nn.Module, caches: list[torch.Tensor],
                 device: torch.device) -> None:
        self.model, self.caches, self.device = model, caches, device

    def execute(self, msg: StepMessage) -> torch.Tensor:
        whole = MicroBatch(0, msg.num_seqs, 0, msg.num_tokens)
        ids, positions, meta = microbatch_tensors(msg, whole, self.device)
        hidden = self.model(ids, positions, self.caches, meta)  # [T, hidden]
        return self.model.compute_logits(hidden[list(msg.logit_rows)])

    def kv_caches_by_rank(self) -> list[list[torch.Tensor]]:
        return [self.caches]


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


class GroupExecutor(ModelExecutor):
    """tp_size x pp_size ranks, each its own process (CPU/gloo here), started by `launcher`
    (default: spawned processes).

    The KV cache is allocated here in one file of shared memory (`SharedCaches`), one tensor per
    (TP rank, layer) holding that rank's heads; the ranks of the layer's stage map it, so the
    driver (and the transfer layer) see exactly what the ranks write. The file is unlinked once
    every rank is ready, or when the start fails. NOTE: on GPUs the caches live on the ranks'
    devices; the driver would get CUDA IPC handles or per-rank transfer agents instead.
    """

    def __init__(self, options: GroupOptions, num_layers: int, num_blocks: int,
                 block_size: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
                 launcher: RankLauncher | None = None) -> None:
        tp, pp = options.tp_size, options.pp_size
        self.tp_size, self.pp_size = tp, pp
        shape = (2, num_blocks, block_size, num_kv_heads // tp, head_dim)
        shared = SharedCaches(tp * num_layers, shape, kv_dtype)
        by_rank = [slice(t * num_layers, (t + 1) * num_layers) for t in range(tp)]
        self.caches = [shared.tensors[s] for s in by_rank]  # [tp rank][layer]: `shape`
        try:
            setups = _rank_setups(options, num_layers, [shared.refs[s] for s in by_rank])
            self.group = RankGroup(rank_main, setups, launcher or SpawnLauncher(),
                                   options.timeout_s)
        finally:
            shared.unlink()  # every rank has mapped it (or the group failed to start)
        self._finalizer = weakref.finalize(self, self.group.close)
        self.last_timings: list[RankTiming] = []  # per rank, of the last step

    def execute(self, msg: StepMessage) -> torch.Tensor:
        replies = self.group.step(msg)
        self.last_timings = [r.timing for r in replies]
        logits = replies[(self.pp_size - 1) * self.tp_size].logits
        if logits is None:
            return torch.empty(0, 0)
        return logits

    def kv_caches_by_rank(self) -> list[list[torch.Tensor]]:
        return self.caches

    def close(self) -> None:
        self._finalizer()


def _rank_setups(options: GroupOptions, num_layers: int,
                 caches: list[list[SharedTensor]]) -> list[RankSetup]:
    """Every rank's setup, in global rank order; `caches[tp rank][layer]`."""
    tp, pp = options.tp_size, options.pp_size
    stages = stage_layers(num_layers, pp)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    return [RankSetup(rank=stage * tp + t, tp_size=tp, pp_size=pp,
                      expert_parallel=options.expert_parallel, init_method=init_method,
                      model=options.model, dtype=options.dtype,
                      load_format=options.load_format, seed=options.seed,
                      attention_backend=options.attention_backend,
                      kv_caches=tuple(caches[t][i] for i in stages[stage]),
                      timeout_s=options.timeout_s)
            for stage in range(pp) for t in range(tp)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
