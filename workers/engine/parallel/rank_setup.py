"""What a rank of a worker group starts from (`RankSetup`, picklable: the driver builds it, the
rank process reads it), the device it runs on and the KV caches it allocates there."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from workers.engine.parallel.messages import DeviceCacheSpec
from workers.engine.parallel.rank_memory import KVProfile
from workers.engine.parallel.shared_cache import SharedTensor, map_tensors

# pipeline-parallel CPU ranks: descriptors of their caches in the driver's shared memory;
# the rest: a spec
RankCaches = tuple[SharedTensor, ...] | DeviceCacheSpec


@dataclass(frozen=True)
class RankSetup:
    """Everything a rank needs to start, picklable."""

    rank: int  # global: stage * tp_size + tp_rank
    tp_size: int
    pp_size: int
    expert_parallel: bool
    init_method: str  # e.g. "tcp://127.0.0.1:29500"
    model: str  # the checkpoint folder
    dtype: str  # a torch dtype name, e.g. "float32"
    load_format: str
    seed: int
    attention_backend: str
    kv_caches: RankCaches  # this stage's layers, this rank's heads
    timeout_s: float  # collectives give up after this long
    device: str  # the kind, "cpu" (gloo) or "cuda" (NCCL); `rank_device` picks which GPU
    host_blocks: int = 0  # blocks of this rank's host tier of its caches (0: none)
    serves_kv: bool = False  # run a KV transfer agent host over its caches (`Ready.agent`)
    # measure first (a GPU group sized by profiling): `kv_caches` (a `DeviceCacheSpec`) is
    # then a template, its number of blocks fixed by the driver's `AllocateCaches`
    profile: KVProfile | None = None
    # > 0: the largest decode batch the driver may ask it to capture (`CaptureGraphs`; on the
    # CPU the static buffers run eagerly); its caches get one block more than `kv_caches`
    # says, the sink of padded rows. 0: every step eager (enforce_eager, pipeline stages)
    graph_batch_size: int = 0
    # > 0: LoRA adapters on its shard, this many device slots of rank up to `max_lora_rank`
    # (`LoadAdapter`, `StepMessage.lora_writes`); 0: none
    max_loras: int = 0
    max_lora_rank: int = 0

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size


def rank_device(kind: str, rank: int, device_count: int) -> torch.device:
    """The device global rank `rank` runs on, given the CUDA devices it sees. A rank that sees
    one GPU uses it (a Ray rank actor holding one GPU: Ray set its CUDA_VISIBLE_DEVICES);
    one that sees several takes GPU `rank % device_count` (spawned ranks on one host, which
    all see every GPU: the engine checked there are enough for one each)."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise ValueError(f"a rank runs on 'cpu' or 'cuda', got {kind!r}")
    if device_count < 1:
        raise RuntimeError(f"rank {rank} should run on a GPU but sees no CUDA device "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return torch.device("cuda", 0 if device_count == 1 else rank % device_count)


def allocate_rank_caches(caches: RankCaches, device: torch.device) -> list[torch.Tensor]:
    """The rank's caches, per layer of its stage: zeroed tensors of its own on `device`, or
    the driver's shared memory mapped."""
    if isinstance(caches, DeviceCacheSpec):
        dtype = getattr(torch, caches.dtype)
        return [torch.zeros(caches.shape, dtype=dtype, device=device)
                for _ in range(caches.num_layers)]
    return map_tensors(caches)  # the driver sees what is written here
