"""How an `Engine` is assembled from its config: the tokenizer, the model (here or on a group of
ranks), the KV budget, and the executor that runs steps (local, CUDA-graph, or a rank group).
Each function takes what it needs explicitly; `workers.engine.core` calls them once, at start."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from workers.engine import cuda_graphs, memory_profile
from workers.attention import get_backend
from workers.engine.config import EngineConfig
from workers.models.loader import load_model
from workers.kernels.kv_quant import KV_QUANT_DTYPES
from workers.models.dtypes import resolve_dtype
from workers.models.model_config import ModelConfig
from workers.engine.parallel.executor import (GroupExecutor, GroupOptions, LocalExecutor,
                                              ModelExecutor)
from workers.engine.parallel.group import SpawnLauncher
from workers.engine.parallel.rank_memory import KVProfile, KVSizing
from workers.engine.kv_cache import KVCacheManager
from workers.engine.runner import KVCacheSpec, ModelRunner, allocate_kv_caches
from workers.engine.speculative.draft_checkpoint import load_draft_checkpoint
from workers.engine.speculative.own_cache import OwnCacheDraft
from workers.engine.speculative.speculator import NoSpeculation, Speculator, build_speculator
from workers.engine.speculative.mtp import mtp_model_config

if TYPE_CHECKING:
    from workers.models.llama import LlamaForCausalLM
    from workers.engine.parallel.group import RankLauncher
    from workers.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 512 * 1024**2


def spawns_ranks(launcher: RankLauncher | None) -> bool:
    """True when a group's ranks are this process's children, seeing the GPUs it sees; not so
    for Ray rank actors, which hold their own (and Ray may show this process all or none)."""
    return launcher is None or isinstance(launcher, SpawnLauncher)


def load_tokenizer(model_path: str) -> Tokenizer | None:
    from workers.tokenizer import Tokenizer

    tokenizer = Tokenizer.found_in(model_path)
    if tokenizer is None:
        logger.warning("no tokenizer.json in %s: prompts must be token ids", model_path)
    return tokenizer


def load_local_model(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                     device: torch.device) -> LlamaForCausalLM:
    # the checkpoint's multi-token-prediction layer too where it drafts
    model_config = mtp_model_config(config.speculative, model_config, config.model)
    return load_model(config.model, model_config, dtype=dtype, device=device,
                      attn_backend=get_backend(config.resolved_attention_backend),
                      load_format=config.load_format, seed=config.seed,
                      fp32_int_kernels=config.fp32_int_kernels,
                      gguf_packed=config.gguf_packed)


def kv_cache_spec(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype) -> KVCacheSpec:
    """The shape of one KV block (a cache of 1 block: the number is decided later), in the
    configured KV dtype ("auto": the model's `dtype`)."""
    kv_dtype = (dtype if config.kv_cache_dtype == "auto"
                else KV_QUANT_DTYPES.get(config.kv_cache_dtype)
                or resolve_dtype(config.kv_cache_dtype, mc))
    return KVCacheSpec(mc.num_hidden_layers, 1, config.block_size, mc.kv_cache_heads,
                       mc.kv_cache_head_dim, kv_dtype, latent=mc.mla is not None)


def num_kv_blocks(config: EngineConfig, spec: KVCacheSpec, model: LlamaForCausalLM | None,
                  device: torch.device, max_model_len: int) -> int:
    """KV blocks: as configured, or what `kv_cache_memory_bytes` holds, or on a GPU what the
    weights and a profiled step leave of `gpu_memory_utilization`, else 512 MiB on the CPU."""
    if config.num_blocks is not None:
        return config.num_blocks
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    elif device.type == "cuda" and model is not None:
        budget = memory_profile.gpu_kv_budget(
            model, lambda n: allocate_kv_caches(dataclasses.replace(spec, num_blocks=n), device),
            device, utilization=config.gpu_memory_utilization,
            num_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
            block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            graph_batch_size=graph_batch_size(config, model, device))
    else:
        budget = CPU_KV_CACHE_BYTES
    num_blocks = budget // spec.bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block of "
                         f"{spec.bytes_per_block} bytes; raise kv_cache_memory_bytes")
    return num_blocks


def num_host_blocks(config: EngineConfig, spec: KVCacheSpec) -> int:
    """Blocks of the host tier: what `host_kv_cache_memory_bytes` holds (0: no tier). A tier
    too small for one block is refused; without prefix caching there is nothing to keep."""
    budget = config.host_kv_cache_memory_bytes
    if budget == 0:
        return 0
    if not config.enable_prefix_caching:
        raise ValueError("host_kv_cache_memory_bytes keeps evicted prefix-cache blocks; it "
                         "needs enable_prefix_caching")
    num_blocks = budget // spec.bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"host_kv_cache_memory_bytes={budget} holds no block of "
                         f"{spec.bytes_per_block} bytes")
    return num_blocks


def graph_batch_size(config: EngineConfig, model: LlamaForCausalLM, device: torch.device) -> int:
    """The largest decode batch `local_executor` replays from the static buffers (captured on
    a GPU); 0 when it takes the plain `LocalExecutor`."""
    if (config.enforce_eager or config.max_cuda_graph_batch_size == 0 or config.enable_lora
            or not cuda_graphs.graphs_supported(model, model.attn_backend, device)):
        return 0
    return min(config.max_cuda_graph_batch_size, config.max_num_seqs)


def group_graph_batch_size(config: EngineConfig, kind: str) -> int:
    """The largest decode batch a group's ranks capture as CUDA graphs (0: eager): GPU ranks
    of one pipeline stage, unless `enforce_eager` or `max_cuda_graph_batch_size=0`. Pipeline
    stages run eagerly: a captured stage would have to capture its point-to-point transfers
    paired with its neighbours' and a ladder per micro-batch. LoRA steps run eagerly. Whether
    the model can be captured at all (not an MoE) the ranks decide: they hold it."""
    if (kind != "cuda" or config.pipeline_parallel_size > 1 or config.enforce_eager
            or config.max_cuda_graph_batch_size == 0 or config.enable_lora):
        return 0
    return min(config.max_cuda_graph_batch_size, config.max_num_seqs)


def local_executor(config: EngineConfig, model: LlamaForCausalLM, spec: KVCacheSpec,
                   device: torch.device, max_model_len: int,
                   host_blocks: int = 0) -> ModelExecutor:
    """The model in this process; on a GPU its decode steps replay CUDA graphs unless
    `enforce_eager` (the cache then has one extra block for the graphs' padded rows)."""
    max_batch = graph_batch_size(config, model, device)
    if max_batch == 0:
        return LocalExecutor(model, allocate_kv_caches(spec, device), device, host_blocks)
    caches = allocate_kv_caches(dataclasses.replace(spec, num_blocks=spec.num_blocks + 1), device)
    return cuda_graphs.CudaGraphExecutor(
        model, caches, device, sink_block=spec.num_blocks, max_batch_size=max_batch,
        max_seq_len=max_model_len, capture=device.type == "cuda", host_blocks=host_blocks)


def group_executor(config: EngineConfig, spec: KVCacheSpec, launcher: RankLauncher | None,
                   device: torch.device, dtype: torch.dtype, host_blocks: int = 0,
                   max_model_len: int = 0) -> tuple[ModelExecutor, torch.device, KVCacheSpec]:
    """tensor_parallel_size x pipeline_parallel_size ranks, started by `launcher` (None:
    spawned): processes over gloo on the CPU, or one GPU each over NCCL on cuda; the driver's
    device; and `spec` with the cache's blocks. A GPU group's cache is sized like one GPU's
    (`num_kv_blocks`) but on every rank, after its shard and a profiled step, the group taking
    the fewest blocks any rank has room for (`workers.engine.parallel.rank_memory`); a CPU group's
    (and one given `num_blocks` or `kv_cache_memory_bytes`) as the config says. GPU ranks of one
    stage then capture their decode graphs (`group_graph_batch_size`). The last rank
    samples; the driver's device only matters to a driver-side sampler."""
    kind = device.type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"tensor/pipeline parallelism runs on 'cpu' or 'cuda'; "
                         f"device={config.device!r} is not supported with "
                         f"{config.world_size} ranks")
    if device.index is not None:
        raise ValueError(f"device={config.device!r} names one GPU, but "
                         f"{config.world_size} ranks use one GPU each; set device='cuda' "
                         f"(CUDA_VISIBLE_DEVICES chooses the GPUs)")
    if kind == "cuda" and not (spawns_ranks(launcher) and torch.cuda.is_available()):
        device = torch.device("cpu")
    options = GroupOptions(
        config.tensor_parallel_size, config.pipeline_parallel_size,
        config.expert_parallel_size > 1, config.model, str(dtype).removeprefix("torch."),
        config.load_format, config.seed, config.resolved_attention_backend,
        config.rank_timeout_s, kind, host_blocks, group_graph_batch_size(config, kind),
        max_model_len, config.max_loras if config.enable_lora else 0, config.max_lora_rank)
    sizing = None
    if kind == "cuda" and config.num_blocks is None and config.kv_cache_memory_bytes is None:
        step, num_blocks = memory_profile.profile_step(
            config.max_num_batched_tokens, max_model_len, config.block_size, config.max_num_seqs)
        sizing = KVSizing(KVProfile(step, num_blocks), lambda r: memory_profile.kv_budget_bytes(
            r.total_bytes, r.peak_bytes, r.outside_torch_bytes, config.gpu_memory_utilization))
    else:
        spec = dataclasses.replace(spec, num_blocks=num_kv_blocks(config, spec, None, device,
                                                                  max_model_len))
    logger.info("worker group: %d ranks on %s%s", config.world_size, kind,
                ", KV cache sized by profiling every rank" if sizing else "")
    executor = GroupExecutor(options, spec, launcher, sizing)
    return executor, device, dataclasses.replace(spec, num_blocks=executor.num_blocks)


def speculator(config: EngineConfig, mc: ModelConfig, tokenizer: Tokenizer | None,
               dtype: torch.dtype, max_model_len: int, runner: ModelRunner,
               kv: KVCacheManager) -> Speculator | NoSpeculation:
    """What drafts for the engine (`config.speculative`): a draft checkpoint loaded on the
    runner's device in the target's `dtype` (`mc`, `tokenizer`: the target's), drafting on a
    cache of its own (its layers and heads, the target's blocks), else `build_speculator`'s."""
    checkpoint = load_draft_checkpoint(config, mc, tokenizer, dtype, runner.device,
                                       max_model_len)
    draft = None
    if checkpoint is not None:
        spec = dataclasses.replace(kv_cache_spec(config, checkpoint.config, dtype),
                                   num_blocks=runner.spec.num_blocks)
        draft = OwnCacheDraft(checkpoint, allocate_kv_caches(spec, runner.device),
                              runner.device, spec.block_size, runner.sampler.generator,
                              "draft_model")
    return build_speculator(config.speculative, max_model_len, runner, kv, draft)
