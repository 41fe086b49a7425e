"""Worker groups on GPUs: one GPU per rank over NCCL, the KV cache on the ranks' devices.

The planning runs on the CPU: which GPU a rank takes, the cache spec it gets instead of
shared-memory descriptors, and the driver around ranks that answer like GPU ranks (a fake
launcher, no process): a tensor-parallel group hands its KV off through its ranks' own agents
(their hosts' addresses come with `Ready`); a pipeline-parallel one serves aggregated and
refuses the handoff in the user's terms. Real NCCL ranks: tests/gpu/test_parallel_nccl.py (2
CUDA devices).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import pickle

import pytest
import torch

from kvtransfer import AgentHostAddress
from workers import SamplingParams
from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig
from workers.engine.core import Engine
from workers.engine.kv_cache.spec import KVCacheSpec
from workers.engine.parallel.executor import (
    GPU_GROUP_KV_ERROR,
    RANK_AGENTS_KV_ERROR,
    GroupExecutor,
    GroupOptions,
    KVCacheNotShared,
    rank_setups,
)
from workers.engine.parallel.group import RankHandle, RankLauncher
from workers.engine.parallel.messages import (
    AllocateCaches,
    CaptureGraphs,
    GraphsCaptured,
    MemoryReport,
    RankTiming,
    Ready,
    SampledTokens,
    Shutdown,
    StepMessage,
    StepReply,
)
from workers.engine.parallel.rank import DeviceCacheSpec
from workers.engine.parallel.rank_setup import RankSetup, rank_device
from workers.engine.parallel.shared_cache import FILE_PREFIX, SHM_DIR, SharedCaches, SharedTensor
from workers.contract.protocol import WorkerRequest
from workers.serving.transfer import kv_layouts
from workers.serving.worker import Worker

FAVOURITE = 7  # the token every fake rank's logits pick
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def options(device: str, tp: int = 2, pp: int = 1) -> GroupOptions:
    return GroupOptions(tp_size=tp, pp_size=pp, expert_parallel=False, model="unused",
                        dtype="float32", load_format="dummy", seed=0,
                        attention_backend="torch", timeout_s=30, device=device)


class FakeRank(RankHandle):
    """A rank without a process: ready at once, answers each step (last stage, first TP rank)
    with `FAVOURITE` for every sampling row, or, for a step without a sampling record, logits
    on the CPU that favour it."""

    def __init__(self, setup: RankSetup, vocab_size: int,
                 reading: tuple[int, int, int] = (0, 0, 0)) -> None:
        """`reading`: (total, peak, outside torch) bytes it reports when asked to measure."""
        self.setup, self.vocab_size = setup, vocab_size
        self.agent = (AgentHostAddress("127.0.0.1", 40000 + setup.rank, b"t")
                      if setup.serves_kv else None)
        self.inbox: list[object] = [Ready(setup.rank, self.agent) if setup.profile is None
                                    else MemoryReport(setup.rank, *reading)]
        self.received: list[object] = []
        self.code: int | None = None

    def send(self, msg: object) -> None:
        self.received.append(msg)
        if isinstance(msg, Shutdown):
            self.code = 0
        elif isinstance(msg, AllocateCaches):
            self.inbox.append(Ready(self.setup.rank, self.agent))
        elif isinstance(msg, CaptureGraphs):  # as a GPU rank whose model can be captured
            self.inbox.append(GraphsCaptured(self.setup.rank, msg.sizes, True, 0.0))
        elif isinstance(msg, StepMessage):
            s = self.setup
            logits = sampled = None
            if s.stage == s.pp_size - 1 and s.tp_rank == 0:
                if msg.sampling is not None:
                    rows = msg.sampling.rows
                    sampled = SampledTokens((FAVOURITE,) * len(rows), (None,) * len(rows))
                else:
                    logits = torch.zeros(len(msg.logit_rows), self.vocab_size)
                    logits[:, FAVOURITE] = 1.0
            self.inbox.append(StepReply(msg.step_id, RankTiming(s.rank, 0.0, 0.0), logits,
                                        sampled))

    def poll(self, timeout_s: float) -> bool:
        return bool(self.inbox)

    def recv(self) -> object:
        return self.inbox.pop(0)

    def exitcode(self) -> int | None:
        return self.code

    def stop(self, timeout_s: float) -> None:
        self.code = 0 if self.code is None else self.code


class FakeLauncher(RankLauncher):
    """Launches `FakeRank`s and keeps their setups (a Ray launcher stands in the same place:
    not `SpawnLauncher`, so the engine does not count this process's GPUs)."""

    def __init__(self, vocab_size: int = 512,
                 readings: dict[int, tuple[int, int, int]] | None = None) -> None:
        """`readings`: by rank, the memory it reports when measuring (default all 0)."""
        self.vocab_size = vocab_size
        self.readings = readings or {}
        self.setups: list[RankSetup] = []
        self.ranks: list[FakeRank] = []

    def launch(self, target: object, setup: RankSetup) -> RankHandle:
        self.setups.append(setup)
        self.ranks.append(FakeRank(setup, self.vocab_size,
                                   self.readings.get(setup.rank, (0, 0, 0))))
        return self.ranks[-1]


def cache_files() -> list[str]:
    return glob.glob(os.path.join(SHM_DIR, f"{FILE_PREFIX}{os.getpid()}-*"))


def cuda_engine(model: str, launcher: RankLauncher | None, **overrides: object) -> Engine:
    config = EngineConfig(model=model, device="cuda", tensor_parallel_size=2, num_blocks=16,
                          block_size=4, **overrides)
    return Engine(config, launcher)


# ---- which GPU a rank takes ----------------------------------------------------------------


def test_a_rank_that_sees_one_gpu_uses_it_and_spawned_ranks_share_out_the_host():
    assert [rank_device("cuda", r, 1) for r in range(4)] == [torch.device("cuda", 0)] * 4
    assert [rank_device("cuda", r, 4) for r in range(4)] == [torch.device("cuda", i)
                                                            for i in range(4)]
    assert rank_device("cuda", 5, 4) == torch.device("cuda", 1)
    assert rank_device("cpu", 3, 0) == torch.device("cpu")
    with pytest.raises(RuntimeError, match="rank 1 should run on a GPU but sees no CUDA device"):
        rank_device("cuda", 1, 0)
    with pytest.raises(ValueError, match="'cpu' or 'cuda', got 'tpu'"):
        rank_device("tpu", 0, 1)


# ---- what the driver sends its ranks ---------------------------------------------------------


def test_gpu_ranks_get_a_cache_spec_for_their_stage_instead_of_shared_memory():
    shape = (2, 16, 4, 1, 16)  # 2 KV heads over 2 TP ranks
    setups = rank_setups(options("cuda", tp=2, pp=2), 3, shape, torch.bfloat16, None)
    assert [(s.rank, s.stage, s.tp_rank) for s in setups] == [(0, 0, 0), (1, 0, 1),
                                                              (2, 1, 0), (3, 1, 1)]
    assert all(s.device == "cuda" for s in setups)
    # stage 0 holds layers 0-1, stage 1 layer 2
    assert [s.kv_caches for s in setups] == [DeviceCacheSpec(2, shape, "bfloat16")] * 2 + [
        DeviceCacheSpec(1, shape, "bfloat16")] * 2
    assert pickle.loads(pickle.dumps(setups)) == setups  # what a spawned rank or actor gets


def test_pipeline_parallel_cpu_ranks_map_their_heads_of_the_shared_caches():
    shape = (2, 8, 4, 1, 16)
    shared = SharedCaches(2 * 3, shape, torch.float32)  # [tp rank][layer]
    try:
        setups = rank_setups(options("cpu", tp=2, pp=2), 3, shape, torch.float32, shared)
        with pytest.raises(ValueError, match="only a pipeline-parallel CPU group maps"):
            rank_setups(options("cpu"), 3, shape, torch.float32, shared)
    finally:
        shared.unlink()
    assert all(s.device == "cpu" and not s.serves_kv for s in setups)
    assert all(isinstance(ref, SharedTensor) for s in setups for ref in s.kv_caches)
    # rank 3 = stage 1 (layer 2), TP rank 1: tensor 1 * 3 + 2
    assert setups[3].kv_caches == (shared.refs[5],)
    assert setups[0].kv_caches == (shared.refs[0], shared.refs[1])


def test_tensor_parallel_ranks_allocate_their_caches_and_host_their_own_agents():
    shape = (2, 8, 4, 1, 16)
    for device in ("cpu", "cuda"):
        setups = rank_setups(options(device), 3, shape, torch.float32, None)
        assert [(s.kv_caches, s.serves_kv) for s in setups] == [
            (DeviceCacheSpec(3, shape, "float32"), True)] * 2


@pytest.mark.parametrize("pp", [1, 2])
def test_a_gpu_group_allocates_no_shared_memory_and_hands_off_only_through_its_ranks(pp):
    launcher = FakeLauncher(vocab_size=32)
    before = cache_files()
    group = GroupExecutor(options("cuda", tp=2, pp=pp),
                          KVCacheSpec(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2,
                                      head_dim=16, dtype=torch.float16), launcher=launcher)
    try:
        assert cache_files() == before
        assert [s.kv_caches for s in launcher.setups] == [
            DeviceCacheSpec(2 // pp, (2, 8, 4, 1, 16), "float16")] * 2 * pp
        with pytest.raises(KVCacheNotShared) as refused:
            group.kv_caches_by_rank()
        if pp == 1:  # each TP rank's agent host, in rank order
            assert str(refused.value) == RANK_AGENTS_KV_ERROR
            assert [h.port for h in group.agent_hosts()] == [40000, 40001]
        else:
            assert str(refused.value) == GPU_GROUP_KV_ERROR and group.agent_hosts() is None
        msg = StepMessage(1, (1, 2), (0, 1), (0, 1), (0, 2), (2,), ((0,),), 0, (1,))
        logits = group.execute(msg)
        assert logits.device.type == "cpu" and logits.argmax(-1).tolist() == [FAVOURITE]
    finally:
        group.close()


# ---- the engine and the worker around a GPU group ---------------------------------------------


def test_a_gpu_engine_driven_from_a_process_without_gpus_serves_aggregated(tiny_model):
    """An engine actor holds no GPU while its Ray rank actors hold one each: the GPUs this
    process sees are neither counted nor used, and it samples on the CPU."""
    launcher = FakeLauncher()
    engine = cuda_engine(tiny_model, launcher)
    try:
        assert [s.device for s in launcher.setups] == ["cuda", "cuda"]
        assert engine.runner.device.type == "cpu"
        engine.generate(WorkerRequest("r", (1, 2, 3), GREEDY))
        tokens = [t for _ in range(4) for e in engine.step() for t in e.token_ids]
        assert tokens == [FAVOURITE] * 4
    finally:
        engine.close()


def test_the_kv_cache_of_a_pipeline_parallel_gpu_engine_is_refused_in_plain_words(tiny_model):
    engine = cuda_engine(tiny_model, FakeLauncher(), pipeline_parallel_size=2)
    try:
        for read in (lambda: kv_layouts(engine), engine.kv_caches_by_rank,
                     lambda: engine.kv_caches):
            with pytest.raises(KVCacheNotShared, match="serve it as an aggregated pool"):
                read()
        assert engine.kv_agent_hosts() is None
    finally:
        engine.close()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_only_a_pipeline_parallel_gpu_engine_refuses_the_handoff_roles(tiny_model, role):
    engine = cuda_engine(tiny_model, FakeLauncher(), pipeline_parallel_size=2)
    try:
        with pytest.raises(ValueError, match=f"a worker of role '{role}' hands KV off, but the "
                                             f"KV cache of a GPU pipeline-parallel group"):
            Worker("w", AsyncEngine(engine), role)
        worker = Worker("w", AsyncEngine(engine), "both")
        assert worker.role == "both"
    finally:
        engine.close()
    engine = cuda_engine(tiny_model, FakeLauncher())  # tensor-parallel: its ranks hand off
    try:
        assert Worker("w", AsyncEngine(engine), role).role == role
        assert len(engine.kv_agent_hosts()) == 2
    finally:
        engine.close()


def test_gpu_layouts_the_machine_cannot_hold_are_refused(tiny_model):
    if torch.cuda.device_count() < 2:  # spawned ranks share this process's GPUs: counted
        with pytest.raises(ValueError, match="needs 2 devices; only"):
            cuda_engine(tiny_model, None)
    with pytest.raises(ValueError, match="device='cuda:1' names one GPU, but 2 ranks use one "
                                         "GPU each; set device='cuda'"):
        Engine(EngineConfig(model=tiny_model, device="cuda:1", tensor_parallel_size=2,
                            num_blocks=16), FakeLauncher())


def test_a_refused_worker_stops_its_ranks(tiny_model):
    launcher = FakeLauncher()
    config = EngineConfig(model=tiny_model, device="cuda", tensor_parallel_size=2,
                          pipeline_parallel_size=2, num_blocks=16)
    with pytest.raises(ValueError, match="hands KV off"):
        Worker.from_config("w", config, "prefill", rank_launcher=launcher)
    assert len(launcher.ranks) == 4
    assert all(r.received == [Shutdown()] for r in launcher.ranks)


# ---- CUDA graphs on the ranks ------------------------------------------------------------------


def messages_of(rank: FakeRank, kind: type) -> list[object]:
    return [m for m in rank.received if isinstance(m, kind)]


@pytest.mark.parametrize("measured", [False, True])
def test_gpu_ranks_capture_the_same_ladder_in_lockstep_before_the_first_step(tiny_model,
                                                                             measured):
    launcher = FakeLauncher(readings={r: (2**24, 2**20, 0) for r in (0, 1)})  # room: 16 MiB
    sizing = {} if measured else {"num_blocks": 16}
    config = EngineConfig(model=tiny_model, device="cuda", tensor_parallel_size=2,
                          block_size=4, max_num_seqs=12, **sizing)
    engine = Engine(config, launcher)
    try:
        assert [s.graph_batch_size for s in launcher.setups] == [12, 12]
        ladder = CaptureGraphs((1, 2, 4, 8, 12), engine.max_model_len)
        for rank in launcher.ranks:
            # each rank: [AllocateCaches] then the same CaptureGraphs, before any step
            kinds = [type(m) for m in rank.received]
            assert kinds == [AllocateCaches, CaptureGraphs] if measured else [CaptureGraphs]
            assert rank.received[-1] == ladder
        assert engine.runner.executor.graph_sizes == ladder.sizes
        for i in range(3):  # 3 sequences decode padded to 4 rows, the same on every rank
            engine.generate(WorkerRequest(f"r{i}", (1, 2, 3), GREEDY))
        for _ in range(3):
            engine.step()
        steps = [messages_of(r, StepMessage) for r in launcher.ranks]
        assert steps[0] == steps[1]
        assert [m.graph_size for m in steps[0]] == [0, 4, 4]  # a prefill runs eagerly
    finally:
        engine.close()


def test_enforce_eager_and_pipeline_stages_keep_gpu_ranks_eager(tiny_model):
    for overrides in ({"enforce_eager": True}, {"max_cuda_graph_batch_size": 0},
                      {"pipeline_parallel_size": 2}):
        launcher = FakeLauncher()
        engine = cuda_engine(tiny_model, launcher, **overrides)
        try:
            assert all(s.graph_batch_size == 0 for s in launcher.setups), overrides
            assert not any(messages_of(r, CaptureGraphs) for r in launcher.ranks)
            engine.generate(WorkerRequest("r", (1, 2, 3), GREEDY))
            engine.step(), engine.step()
            assert all(m.graph_size == 0 for r in launcher.ranks
                       for m in messages_of(r, StepMessage))
        finally:
            engine.close()


def test_graphs_are_refused_for_pipeline_stages_and_ranks_must_agree():
    with pytest.raises(ValueError, match="need one pipeline stage and a max_model_len"):
        rank_setups(dataclasses.replace(options("cuda", pp=2), graph_batch_size=8,
                                        max_model_len=64), 2, (2, 8, 4, 1, 16), torch.float32,
                    None)

    class Disagreeing(FakeLauncher):
        def launch(self, target, setup):
            rank = super().launch(target, setup)
            if setup.rank == 1:  # as if its model could not be captured
                rank.send = lambda msg, send=rank.send: (
                    rank.inbox.append(GraphsCaptured(1, (), False, 0.0))
                    if isinstance(msg, CaptureGraphs) else send(msg))
            return rank

    launcher = Disagreeing(vocab_size=32)
    with pytest.raises(RuntimeError, match="captured different decode graphs"):
        GroupExecutor(dataclasses.replace(options("cuda"), graph_batch_size=4, max_model_len=64),
                      KVCacheSpec(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2,
                                  head_dim=16, dtype=torch.float16), launcher=launcher)
    assert all(isinstance(r.received[-1], Shutdown) for r in launcher.ranks)
