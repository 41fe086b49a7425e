"""Engine options: one frozen record, validated in the user's terms."""

from __future__ import annotations

from dataclasses import dataclass


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
# full precision (auto: the model's dtype) or 8 bits with a scale per token and head
# (workers.kernels.kv_quant)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3")
QUANTIZED_KV_CACHE_DTYPES = ("int8", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class EngineConfig:
    """What one engine serves and how. Unset sizes are derived from the checkpoint and device."""

    model: str  # a folder with config.json, safetensors and tokenizer files
    dtype: str = "auto"  # auto (the checkpoint's own), float32, bfloat16, float16
    load_format: str = "auto"  # auto / safetensors, or dummy (seeded random weights)
    device: str = "auto"  # auto (cuda when present, else cpu), cpu, cuda, cuda:N
    max_model_len: int | None = None  # tokens per sequence; default: the model's context
    block_size: int = 16  # tokens per KV block
    kv_cache_memory_bytes: int | None = None  # KV budget; default 512 MiB on CPU
    # on GPU: the fraction of the device's total memory (not of what is free) that weights,
    # activations and the KV cache may take together, memory held outside this process's torch
    # allocator (CUDA context, other processes) counted against it (memory_profile)
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None  # overrides the budget: exactly this many KV blocks
    # the host-memory tier: evicted prefix-cache blocks kept in this many bytes of host memory
    # and copied back on a hit instead of recomputed (0: off; workers.engine.kv_cache.host_tier)
    host_kv_cache_memory_bytes: int = 0
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), float32, bfloat16, float16, int8, fp8
    max_num_seqs: int = 128  # running sequences at most
    max_num_batched_tokens: int = 2048  # new tokens per step at most (chunked-prefill budget)
    enable_prefix_caching: bool = True
    # auto: triton on a GPU when installed; cpu (the C decode kernel) on the CPU when a C compiler
    # builds it; else torch
    attention_backend: str = "auto"
    enforce_eager: bool = False  # on a GPU: never replay decode steps from CUDA graphs
    max_cuda_graph_batch_size: int = 256  # decode batches up to this size replay CUDA graphs
    seed: int = 0  # for requests without a seed, and for dummy weights
    tensor_parallel_size: int = 1  # ranks sharing each layer (heads, MLP columns, vocab)
    pipeline_parallel_size: int = 1  # stages the layers are split into
    expert_parallel_size: int = 1  # 1, or tensor_parallel_size: MoE experts split whole
    pipeline_microbatches: int | None = None  # per step; default: pipeline_parallel_size
    rank_timeout_s: float = 120.0  # a rank silent this long (start-up or a step) is failed
    # schedule and build step N+1 while step N runs, its decode inputs taken from step N's
    # tokens on the device (`workers.engine.async_step`); one engine process (world_size 1) only
    async_scheduling: bool = False
    # dtype float32 with an int8 (per channel) or int4 (groups of 32-256) checkpoint on a CPU
    # with AVX-512 VNNI: keep the weights packed for Cleave's int kernels (fp32 activations,
    # quantized to int8 per 32 columns in the kernel) instead of dequantizing them to fp32,
    # which stays the default as the faithful reference (its logits equal transformers' on the
    # dequantized weights; the int kernels' do not, to 1e-4)
    fp32_int_kernels: bool = False

    def __post_init__(self) -> None:
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256),
                 f"block_size must be a power of two from 1 to 256, got {self.block_size}")
        _require(self.max_num_seqs >= 1,
                 f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        _require(self.max_model_len is None or self.max_model_len >= 2,
                 f"max_model_len must be at least 2, got {self.max_model_len}")
        _require(0.0 < self.gpu_memory_utilization <= 1.0,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
                 f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        _require(self.host_kv_cache_memory_bytes >= 0,
                 f"host_kv_cache_memory_bytes must be >= 0 (0: no host tier), got "
                 f"{self.host_kv_cache_memory_bytes}")
        _require(self.num_blocks is None or self.num_blocks >= 1,
                 f"num_blocks must be at least 1, got {self.num_blocks}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size"):
            _require(getattr(self, name) >= 1, f"{name} must be at least 1, got "
                                               f"{getattr(self, name)}")
        _require(self.expert_parallel_size in (1, self.tensor_parallel_size),
                 f"expert_parallel_size={self.expert_parallel_size} must be 1 or equal to "
                 f"tensor_parallel_size={self.tensor_parallel_size}: experts are sharded "
                 f"across the tensor-parallel group")
        _require(self.pipeline_microbatches is None or self.pipeline_microbatches >= 1,
                 f"pipeline_microbatches must be at least 1, got {self.pipeline_microbatches}")
        _require(self.attention_backend in ATTENTION_BACKENDS,
                 f"attention_backend must be one of {ATTENTION_BACKENDS}, got "
                 f"{self.attention_backend!r}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _require(self.max_cuda_graph_batch_size >= 0,
                 f"max_cuda_graph_batch_size must be at least 0 (0: no CUDA graphs), got "
                 f"{self.max_cuda_graph_batch_size}")
        _require(not self.async_scheduling or self.world_size == 1,
                 f"async_scheduling needs one rank (the model in the engine's process), got "
                 f"world_size={self.world_size}")
        _require(not self.fp32_int_kernels or self.world_size == 1,
                 f"fp32_int_kernels needs one rank (parallel ranks dequantize their shards), "
                 f"got world_size={self.world_size}")
        _require(self.rank_timeout_s > 0,
                 f"rank_timeout_s must be positive, got {self.rank_timeout_s}")

    @property
    def quantized_kv_cache(self) -> bool:
        return self.kv_cache_dtype in QUANTIZED_KV_CACHE_DTYPES

    @property
    def world_size(self) -> int:
        """Ranks (processes, or devices) one engine uses."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_attention_backend(self) -> str:
        """`auto`: the Triton kernels on a GPU when triton is installed; on the CPU the C decode
        kernel when it builds here; else plain torch."""
        if self.attention_backend != "auto":
            return self.attention_backend
        if self.resolved_device == "cpu":
            from workers.attention import cpu_backend

            return "cpu" if cpu_backend.available() else "torch"
        import importlib.util

        return "triton" if importlib.util.find_spec("triton") is not None else "torch"
