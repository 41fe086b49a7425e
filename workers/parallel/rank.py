"""One rank of a worker group: joins the process group, loads its shard, runs steps.

A rank holds tensor-parallel rank `tp_rank` of pipeline stage `stage` (global rank
`stage * tp_size + tp_rank`) and the KV cache of that stage's layers for its heads, which the
driver allocated in shared memory and the rank maps before it reports `Ready`. It serves
`StepMessage`s until `Shutdown`, replying to each with a `StepReply`; any exception is sent back
as `RankFailed` and the rank exits non-zero.
"""

from __future__ import annotations

import datetime
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.attention import get_backend
from workers.parallel.comm import CommStats, Communicator, StageLink
from workers.parallel.messages import (
    RankFailed,
    RankTiming,
    Ready,
    Shutdown,
    StepMessage,
    StepReply,
)
from workers.parallel.pipeline import microbatch_tensors, split_microbatches, stage_layers
from workers.parallel.shared_cache import SharedTensor, map_tensors


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
    kv_caches: tuple[SharedTensor, ...]  # this stage's layers, this rank's heads
    timeout_s: float  # collectives give up after this long

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size


def rank_main(setup: RankSetup, conn: object) -> None:
    """The rank's entry point. `conn`: its end of the channel to the driver (`send`, `recv`)."""
    torch.set_num_threads(1)
    try:
        runner = _StageRunner(setup)
        conn.send(Ready(setup.rank))  # type: ignore[attr-defined]
        while True:
            msg = conn.recv()  # type: ignore[attr-defined]
            if isinstance(msg, Shutdown):
                break
            conn.send(runner.step(msg))  # type: ignore[attr-defined]
    except BaseException:  # noqa: BLE001 - reported to the driver, then the process exits
        conn.send(RankFailed(setup.rank, traceback.format_exc()))  # type: ignore[attr-defined]
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _StageRunner:
    def __init__(self, setup: RankSetup) -> None:
        from workers.loader import load_model
        from workers.model_config import ModelConfig, resolve_dtype
        from workers.models.layers import Shard

        self.setup = setup
        tp, pp = setup.tp_size, setup.pp_size
        dist.init_process_group("gloo", init_method=setup.init_method, rank=setup.rank,
                                world_size=tp * pp,
                                timeout=datetime.timedelta(seconds=setup.timeout_s))
        self.stats = CommStats()
        comm = None
        for stage in range(pp):  # every rank creates every group, in the same order
            ranks = [stage * tp + r for r in range(tp)]
            group = dist.new_group(ranks) if tp > 1 else None
            if stage == setup.stage and tp > 1:
                comm = Communicator(group, ranks, setup.tp_rank, self.stats)
        self.link = StageLink(self.stats)
        config = ModelConfig.from_pretrained(setup.model)
        self.layers = stage_layers(config.num_hidden_layers, pp)[setup.stage]
        shard = Shard(setup.tp_rank, tp, comm, self.layers, setup.expert_parallel)
        self.model = load_model(setup.model, config, dtype=resolve_dtype(setup.dtype, config),
                                device="cpu", attn_backend=get_backend(setup.attention_backend),
                                load_format=setup.load_format, seed=setup.seed, shard=shard)
        self.hidden_size, self.dtype = config.hidden_size, resolve_dtype(setup.dtype, config)
        self.is_first, self.is_last = setup.stage == 0, setup.stage == pp - 1
        self.kv_caches = map_tensors(setup.kv_caches)  # the driver sees what is written here

    @torch.inference_mode()
    def step(self, msg: StepMessage) -> StepReply:
        start = time.perf_counter()
        self.stats.reset()
        tp, rank = self.setup.tp_size, self.setup.rank
        outputs, busy, pending = [], [], []
        for mb in split_microbatches(msg):
            hidden = None
            if not self.is_first:
                hidden = self.link.recv((mb.num_tokens, self.hidden_size), self.dtype, rank - tp)
            t0, c0 = time.perf_counter(), self.stats.seconds
            ids, positions, meta = microbatch_tensors(msg, mb, torch.device("cpu"))
            out = self.model(ids, positions, self.kv_caches, meta, hidden)
            busy.append(time.perf_counter() - t0 - (self.stats.seconds - c0))
            if self.is_last:
                outputs.append(out)
            else:
                pending.append(self.link.send(out, rank + tp))
        for work in pending:
            work.wait()  # type: ignore[attr-defined]
        logits = None
        if self.is_last and msg.logit_rows:
            hidden = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
            logits = self.model.compute_logits(hidden[list(msg.logit_rows)])
        timing = RankTiming(rank, time.perf_counter() - start, self.stats.seconds, tuple(busy),
                            dict(self.stats.bytes_by_site))
        return StepReply(msg.step_id, timing,
                         logits if self.setup.tp_rank == 0 else None)
