"""One rank of a worker group: joins the process group, loads its shard, runs steps.

A rank holds tensor-parallel rank `tp_rank` of pipeline stage `stage` (global rank
`stage * tp_size + tp_rank`) and the KV cache of that stage's layers for its heads. It allocates
that cache itself on its device from a `DeviceCacheSpec` (a GPU's memory, or the CPU's) and
serves it to the transfer layer through its own agent (`kvtransfer.remote.AgentHost`, on a
thread of its own), whose address its `Ready` carries: the driver never sees the cache. Only a
pipeline-parallel group on the CPU still maps the driver's shared memory instead (the driver's
agents serve it: a rank's handoff would hold only its stage's layers). It serves `StepMessage`s
until `Shutdown`, replying to each with a `StepReply`: the last stage's first TP rank samples
a step that carries a `SamplingRecord` (`workers.engine.parallel.sampling`) and sends the token ids,
else the logits on the CPU; any exception is sent back as `RankFailed` and the rank exits
non-zero. A tensor-parallel group's GPU ranks replay their pure-decode steps from CUDA graphs
captured at the driver's `CaptureGraphs` (`workers.engine.parallel.rank_graphs`).
"""

from __future__ import annotations

import datetime
import time
import traceback

import torch
import torch.distributed as dist

from kvtransfer.agent_host import AgentHost
from workers.attention import get_backend
from workers.engine.kv_cache.host_caches import HostCaches
from workers.kernels.kv_quant import encoding as kv_encoding
from workers.models.comm import CommStats, Communicator, StageLink
from workers.engine.parallel.messages import (
    AdapterReply,
    AllocateCaches,
    CaptureGraphs,
    DeviceCacheSpec,
    GraphsCaptured,
    LoadAdapter,
    MemoryReport,
    RankConn,
    RankFailed,
    RankTiming,
    Ready,
    Shutdown,
    StepMessage,
    StepReply,
    UnloadAdapter,
)
from workers.engine.parallel.pipeline import microbatch_tensors, split_microbatches, stage_layers
from workers.engine.parallel.rank_graphs import RankGraphs
from workers.engine.parallel.rank_memory import KVProfile, measure_rank_memory
from workers.engine.parallel.rank_setup import (RankCaches, RankSetup, allocate_rank_caches,
                                                rank_device)
from workers.engine.parallel.sampling import RankSampler
from workers.models.lora import AdapterSlots, LoraAdapterError

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}  # device kind -> torch.distributed backend
AGENT_HOST = "127.0.0.1"  # a rank's agent host listens here: its driver is on the same node


def rank_main(setup: RankSetup, conn: RankConn) -> None:
    """The rank's entry point. `conn`: its end of the channel to the driver (`send`, `recv`)."""
    torch.set_num_threads(1)
    host = None
    try:
        runner = _StageRunner(setup)
        if setup.profile is not None:  # a two-phase start: report, then allocate
            conn.send(runner.measure(setup.profile))
            msg = conn.recv()
            if isinstance(msg, Shutdown):
                return
            if not isinstance(msg, AllocateCaches):
                raise TypeError(f"rank {setup.rank} expected AllocateCaches after its memory "
                                f"report, got {type(msg).__name__}")
            runner.allocate(msg.kv_caches)
        address = None
        if setup.serves_kv:
            host = AgentHost(runner.kv_caches, tp_rank=setup.tp_rank, tp_size=setup.tp_size,
                             encoding=kv_encoding(runner.kv_caches[0].dtype))
            address = host.start(AGENT_HOST)
        conn.send(Ready(setup.rank, address))
        while True:
            msg = conn.recv()
            if isinstance(msg, Shutdown):
                break
            if isinstance(msg, CaptureGraphs):
                conn.send(runner.capture_graphs(msg))
                continue
            if isinstance(msg, LoadAdapter | UnloadAdapter):
                conn.send(runner.adapter(msg))
                continue
            conn.send(runner.step(msg))
    except BaseException:  # noqa: BLE001 - reported to the driver, then the process exits
        conn.send(RankFailed(setup.rank, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if host is not None:
            host.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


class _StageRunner:
    def __init__(self, setup: RankSetup) -> None:
        from workers.models.loader import load_model
        from workers.models.dtypes import resolve_dtype
        from workers.models.model_config import ModelConfig
        from workers.models.layers import Shard

        self.setup = setup
        tp, pp = setup.tp_size, setup.pp_size
        cuda_count = torch.cuda.device_count() if setup.device == "cuda" else 0
        self.device = rank_device(setup.device, setup.rank, cuda_count)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # before NCCL starts: it uses the current device
        dist.init_process_group(BACKENDS[self.device.type], init_method=setup.init_method,
                                rank=setup.rank, world_size=tp * pp,
                                timeout=datetime.timedelta(seconds=setup.timeout_s))
        self.stats = CommStats()
        comm = None
        for stage in range(pp):  # every rank creates every group, in the same order
            ranks = [stage * tp + r for r in range(tp)]
            group = dist.new_group(ranks) if tp > 1 else None
            if stage == setup.stage and tp > 1:
                comm = Communicator(group, ranks, setup.tp_rank, self.stats, self.device)
        self.link = StageLink(self.stats, self.device)
        config = ModelConfig.from_pretrained(setup.model)
        self.layers = stage_layers(config.num_hidden_layers, pp)[setup.stage]
        shard = Shard(setup.tp_rank, tp, comm, self.layers, setup.expert_parallel)
        self.dtype = resolve_dtype(setup.dtype, config)
        self.model = load_model(setup.model, config, dtype=self.dtype, device=self.device,
                                attn_backend=get_backend(setup.attention_backend),
                                load_format=setup.load_format, seed=setup.seed, shard=shard)
        self.hidden_size = config.hidden_size
        self.adapters = (AdapterSlots(self.model, setup.max_loras, setup.max_lora_rank)
                         if setup.max_loras else None)  # before a measure: its stacks count
        self.is_first, self.is_last = setup.stage == 0, setup.stage == pp - 1
        self.kv_caches: list[torch.Tensor] = []
        self.host: HostCaches | None = None
        self.graphs: RankGraphs | None = None
        if setup.profile is None:
            self.allocate(setup.kv_caches)
        self.sampler = (RankSampler(setup.seed, self.device)
                        if self.is_last and setup.tp_rank == 0 else None)

    def allocate(self, caches: RankCaches) -> None:
        """This rank's caches (and their host tier), for good; with graphs one block more, the
        last (`self.sink_block`), for padded rows."""
        self.sink_block = -1
        if self.setup.graph_batch_size:
            if not isinstance(caches, DeviceCacheSpec):
                raise ValueError(f"rank {self.setup.rank}: only a rank allocating its own caches "
                                 f"captures CUDA graphs (pipeline stages run eagerly)")
            self.sink_block = caches.shape[1]
            caches = caches.with_blocks(self.sink_block + 1)
        self.kv_caches = allocate_rank_caches(caches, self.device)
        self.host = (HostCaches(self.kv_caches, self.setup.host_blocks)
                     if self.setup.host_blocks else None)

    def measure(self, profile: KVProfile) -> MemoryReport:
        """Runs the profile step with the group on a throw-away cache; the device's readings."""
        template = self.setup.kv_caches
        if not isinstance(template, DeviceCacheSpec) or self.device.type != "cuda":
            raise ValueError(f"rank {self.setup.rank}: only a GPU rank allocating its own "
                             f"caches measures its memory (device {self.device})")

        def run(msg: StepMessage, num_blocks: int) -> None:
            self.kv_caches = allocate_rank_caches(template.with_blocks(num_blocks), self.device)
            try:
                self.step(msg)
            finally:
                self.kv_caches = []

        return measure_rank_memory(self.setup.rank, run, self.device, profile)

    def capture_graphs(self, msg: CaptureGraphs) -> GraphsCaptured:
        """Warms up and captures `msg.sizes` (every rank at once: collectives); the reply."""
        if not self.setup.graph_batch_size or max(msg.sizes, default=0) > (
                self.setup.graph_batch_size):
            raise ValueError(f"rank {self.setup.rank} was set up for decode graphs of up to "
                             f"{self.setup.graph_batch_size} rows, asked for {msg.sizes}")
        self.graphs = RankGraphs(self.setup.rank, self.model, self.kv_caches, self.device,
                                 self.sink_block, msg)
        return self.graphs.reply

    def adapter(self, msg: LoadAdapter | UnloadAdapter) -> AdapterReply:
        """Loads or forgets an adapter on this rank; a bad one is refused in the reply."""
        rank = self.setup.rank
        if self.adapters is None:
            raise RuntimeError(f"rank {rank} was started without LoRA adapters (max_loras=0)")
        if isinstance(msg, UnloadAdapter):
            if msg.name in self.adapters.paths:
                self.adapters.remove(msg.name)
            return AdapterReply(rank)
        try:
            self.adapters.add(msg.name, msg.path)
        except LoraAdapterError as e:
            return AdapterReply(rank, str(e))
        return AdapterReply(rank)

    @torch.inference_mode()
    def step(self, msg: StepMessage) -> StepReply:
        start = time.perf_counter()
        self.stats.reset()
        rank = self.setup.rank
        if msg.block_copies:
            if self.host is None:
                raise RuntimeError(f"rank {rank}: a step carries KV tier copies, but the rank "
                                   "has no host tier")
            self.host.apply(msg.block_copies)  # this rank's layers and heads
        tier_copy_s = time.perf_counter() - start
        if msg.graph_size:
            if self.graphs is None:
                raise RuntimeError(f"rank {rank}: step {msg.step_id} asks for graph size "
                                   f"{msg.graph_size}, but no graphs were captured")
            t0 = time.perf_counter()
            graph_logits = self.graphs.run(msg)  # writes the K/V even when no logits are wanted
            logits = graph_logits if msg.logit_rows else None
            busy = [time.perf_counter() - t0]  # replays: no collective is timed on the host
        else:
            logits, busy = self._forward(msg)
        sampled = None
        if self.sampler is not None and msg.sampling is not None:
            sampled, logits = self.sampler(logits, msg.sampling), None
        # else the first TP rank's go back on the CPU: a reply is pickled (never a CUDA tensor)
        logits = logits.cpu() if logits is not None and self.setup.tp_rank == 0 else None
        if self.device.type == "cuda":
            # the step ends when its kernels and sends have: honest timings, and a CUDA error
            # is raised in the step that caused it
            torch.cuda.synchronize(self.device)
        timing = RankTiming(rank, time.perf_counter() - start, self.stats.seconds, tuple(busy),
                            dict(self.stats.bytes_by_site), tier_copy_s)
        return StepReply(msg.step_id, timing, logits, sampled)

    def _forward(self, msg: StepMessage) -> tuple[torch.Tensor | None, list[float]]:
        """The eager forward, micro-batch by micro-batch: the logits of `msg.logit_rows` on
        the last stage (else None) and each micro-batch's compute seconds."""
        tp, rank = self.setup.tp_size, self.setup.rank
        if self.adapters is not None:  # one stage: one micro-batch, the step's rows whole
            self.adapters.write(msg.lora_writes)
            self.adapters.batch.begin(msg.query_start_loc, msg.lora_slots, self.device)
        outputs, busy, pending = [], [], []
        for mb in split_microbatches(msg):
            hidden = None
            if not self.is_first:
                hidden = self.link.recv((mb.num_tokens, self.hidden_size), self.dtype, rank - tp)
            t0, c0 = time.perf_counter(), self.stats.seconds
            ids, positions, meta = microbatch_tensors(msg, mb, self.device)
            out = self.model(ids, positions, self.kv_caches, meta, hidden)
            busy.append(time.perf_counter() - t0 - (self.stats.seconds - c0))
            if self.is_last:
                outputs.append(out)
            else:
                pending.append(self.link.send(out, rank + tp))
        for work in pending:
            work.wait()  # type: ignore[attr-defined]  # `StageLink.send`'s torch Work
        logits = None
        if self.is_last and msg.logit_rows:  # every TP rank: the vocab shards are all-gathered
            hidden = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
            logits = self.model.compute_logits(hidden[list(msg.logit_rows)])
        return logits, busy
