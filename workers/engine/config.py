"""Engine options: one frozen record, validated in the user's terms."""

from __future__ import annotations

from dataclasses import dataclass

from workers.contract.setting import setting
from workers.engine.speculative.config import SpeculativeConfig, parse_speculative_config


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_lora(config: EngineConfig) -> None:
    _require(config.max_loras >= 1, f"max_loras must be at least 1, got {config.max_loras}")
    _require(config.max_lora_rank >= 1,
             f"max_lora_rank must be at least 1, got {config.max_lora_rank}")
    _require(not config.lora_modules or config.enable_lora,
             f"lora_modules {list(config.lora_modules)} need enable_lora")
    _require(config.lora_dir is None or config.enable_lora,
             f"lora_dir {config.lora_dir!r} needs enable_lora")
    _require(not config.enable_lora or config.pipeline_parallel_size == 1,
             f"LoRA adapters run on one pipeline stage (tensor parallelism shards them), got "
             f"pipeline_parallel_size={config.pipeline_parallel_size}")
    _require(not config.enable_lora or (config.pipeline_microbatches or 1) == 1,
             f"LoRA steps run whole (one micro-batch), got pipeline_microbatches="
             f"{config.pipeline_microbatches}")
    names = [m.split("=", 1)[0] for m in config.lora_modules]
    bad = [m for m in config.lora_modules
           if "=" not in m or not m.split("=", 1)[0] or not m.split("=", 1)[1]]
    _require(not bad, f"lora_modules entries must be NAME=PATH, got {bad}")
    _require(len(set(names)) == len(names), f"lora_modules names repeat: {names}")


ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: the checkpoint's own
LOAD_FORMATS = ("auto", "safetensors", "dummy")  # dummy: seeded random weights
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SCHEDULING_POLICIES = ("deadline", "fcfs")  # the waiting queue's order (engine.waiting_order)
# full precision (auto: the model's dtype) or 8 bits with a scale per quarter of each token's head
# (workers.kernels.kv_quant)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3")
QUANTIZED_KV_CACHE_DTYPES = ("int8", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class EngineConfig:
    """What one engine serves and how. Unset sizes are derived from the checkpoint and device.
    Each field is one setting's definition (`workers.contract.setting`): the cluster config and
    the flags are derived from it."""

    model: str = setting(description=(
        "A folder with config.json, safetensors and tokenizer files."), section=None, flag=None)
    dtype: str = setting("auto", "Weights and activations; auto: the checkpoint's own dtype.",
                         choices=DTYPES, section="model")
    load_format: str = setting("auto", (
        "dummy: seeded random weights of the checkpoint's shapes (benchmarks)."),
        choices=LOAD_FORMATS, section="model")
    # the cluster derives it from its pools' gpus_per_rank
    device: str = setting("auto", "auto (cuda when present, else cpu), cpu, cuda or cuda:N.",
                          section=None, flag=None)
    max_model_len: int | None = setting(None, (
        "Tokens per sequence, prompt and output together; default: the model's context."),
        ge=2, section="model")
    block_size: int = setting(16, "Tokens per KV block; the same in every pool.",
                              choices=BLOCK_SIZES)
    kv_cache_memory_bytes: int | None = setting(None, (
        "KV-cache budget per rank; default 512 MiB on CPU, from gpu_memory_utilization on "
        "GPU."), gt=0)
    gpu_memory_utilization: float = setting(0.9, (
        "On GPU: the fraction of the device's total memory that weights, activations and the "
        "KV cache take together (memory held outside this process's torch allocator counted "
        "against it)."), gt=0, le=1)
    num_blocks: int | None = setting(None, (
        "Exactly this many KV blocks (overrides the memory budget)."), ge=1,
        flag=("--num-gpu-blocks-override",))
    # workers.engine.kv_cache.host_tier; its flag is --kv-offloading-size, in GiB
    host_kv_cache_memory_bytes: int = setting(0, (
        "Host memory per replica for the KV cache's host tier: prefix-cache blocks evicted "
        "from the KV cache are kept there and copied back on a hit instead of recomputed. "
        "0: no host tier. Needs enable_prefix_caching."), ge=0, flag=None)
    kv_cache_dtype: str = setting("auto", (
        "KV-cache element type; the same in every pool. auto: the model's dtype. int8 / fp8 "
        "(e4m3 values, int8 keys): 8 bits with a scale per quarter of each token's head, 1.78x "
        "the blocks of bf16 in the same bytes; every attention backend reads it."),
        choices=KV_CACHE_DTYPES)
    max_num_seqs: int = setting(128, "Running sequences at most.", ge=1)
    max_num_batched_tokens: int = setting(2048, (
        "New tokens per engine step at most (the chunked-prefill budget)."), ge=1)
    scheduling_policy: str = setting("deadline", (
        "The waiting queue's order. deadline: requests with a TTFT target (the x-slo-ttft-ms "
        "header) earliest-due first, ahead of those without; fcfs: arrival order."),
        choices=SCHEDULING_POLICIES)
    enable_prefix_caching: bool = setting(True, "Reuse cached KV blocks of prefixes.",
                                          flag=("--enable-prefix-caching", "--prefix-caching"))
    attention_backend: str = setting("auto", (
        "Attention kernels. auto: triton on a GPU when installed; on the CPU, cpu (a C decode "
        "kernel compiled at first use) when a C compiler is present; torch otherwise."),
        choices=ATTENTION_BACKENDS)
    enforce_eager: bool = setting(False, (
        "On a GPU: run every decode step eagerly instead of replaying CUDA graphs."))
    max_cuda_graph_batch_size: int = setting(256, (
        "Decode batches up to this size replay CUDA graphs (0: none)."), ge=0)
    seed: int = setting(0, "The seed of requests without one, and of dummy weights.")
    tensor_parallel_size: int = setting(1, (
        "Tensor-parallel ranks per replica (sharing each layer's heads, MLP columns and "
        "vocabulary)."), ge=1, section="pool", key="tp", flag=("--tensor-parallel-size", "-tp"))
    pipeline_parallel_size: int = setting(1, "Pipeline stages per replica.", ge=1,
                                          section="pool", key="pp",
                                          flag=("--pipeline-parallel-size", "-pp"))
    expert_parallel_size: int = setting(1, (
        "Expert-parallel ranks (MoE models): 1, or tp to shard the experts across the "
        "tensor-parallel group."), ge=1, section="pool", key="ep")
    pipeline_microbatches: int | None = setting(None, (
        "Microbatches per pipelined step; default: the pipeline stages."), ge=1)
    rank_timeout_s: float = setting(120.0, (
        "A parallel rank silent this long (start-up or a step) is failed."), gt=0)
    # `workers.engine.async_step`: step N+1's decode inputs are taken from step N's tokens on
    # the device
    async_scheduling: bool = setting(False, (
        "Schedule and launch the next step while the current one runs on the device (one rank "
        "per replica; steps with penalties, grammars, seeds or min_tokens run synchronously)."))
    # the dequantized fp32 path stays the default as the faithful reference: its logits equal
    # transformers' on the dequantized weights; the int kernels' do not, to 1e-4
    fp32_int_kernels: bool = setting(False, (
        "With dtype float32 and an int8 or int4 checkpoint on a CPU with AVX-512 VNNI: keep the "
        "weights packed for Cleave's int kernels (activations quantized to int8 in the kernel; "
        "1.3-2.1x a bfloat16 engine's decode step on the small preset) instead of dequantizing "
        "them to fp32, the faithful reference. A GGUF file's packed Q8_0/Q4_0/Q4_1 weights move "
        "to a VNNI kernel too (int8 activations, as llama.cpp multiplies them; its output "
        "differs from the fp32 block kernel's)."))
    # packed is the faster on the CPU (`benchmarks/gguf_packed.py`); dequantized at load is the
    # reference transformers' GGUF loading matches to fp32 1e-4 (packed: up to the order of sums)
    gguf_packed: bool = setting(True, (
        "A GGUF file's Q8_0, Q4_0 and Q4_1 weights stay packed on the CPU as the file stores "
        "them (the tied output projection and embedding included), read by Cleave's block "
        "kernels; off: dequantized to the model's dtype at load. GPUs always dequantize."))
    # workers.models.lora: PEFT adapters on the base model, several in one step
    enable_lora: bool = setting(False, (
        "Load LoRA adapters on the base model (one pipeline stage; tensor-parallel ranks "
        "shard them as their projections): a request selects one "
        "by naming it as its model, and POST /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter load and unload them at run time."))
    max_loras: int = setting(4, (
        "Adapters in the device's slots at once (a step runs at most this many); the least "
        "recently used is evicted to host memory."), ge=1)
    max_lora_rank: int = setting(16, "The largest LoRA rank an adapter may have.", ge=1)
    lora_modules: tuple[str, ...] = setting((), (
        "Adapters loaded at start, each NAME=PATH (a PEFT adapter folder); NAME is the model "
        "name requests select it by. Needs enable_lora."))
    lora_dir: str | None = setting(None, (
        "A folder of PEFT adapter folders, each named for its adapter: a request whose model "
        "names no loaded adapter but a sub-folder here has it loaded first, on every worker "
        "(as vLLM's filesystem LoRA resolver, VLLM_LORA_RESOLVER_CACHE_DIR). Unset: such a "
        "request is a 404. Needs enable_lora."))

    # workers.engine.speculative; parsed and checked by `speculative`
    speculative_config: str | None = setting(None, (
        "Speculative decoding, as vLLM's JSON object, e.g. {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2} "
        "(Cleave's keys: disable_by_batch_size; draft_length, cost or fixed). Methods: "
        "ngram, draft_model (with \"model\": a checkpoint sharing the tokenizer; without: the "
        "target's first draft_num_layers layers), quantized_self, mtp. Unset: none. A request "
        "turns it off with speculative=false."))

    def __post_init__(self) -> None:
        _check_lora(self)
        _require(self.block_size in BLOCK_SIZES,
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
        spec = self.speculative
        _require(spec is None or not (self.async_scheduling or self.enable_lora),
                 f"speculative_config needs no async_scheduling and no enable_lora, got "
                 f"async_scheduling={self.async_scheduling}, enable_lora={self.enable_lora}")
        _require(spec is None or self.world_size == 1 or spec.drafts_beside_the_target,
                 f"speculative_config method {spec and spec.method!r} drafts with the target's "
                 f"weights, which a group of {self.world_size} ranks holds: use 'ngram' or a "
                 f"draft checkpoint of its own ('draft_model' with 'model')")
        _require(self.rank_timeout_s > 0,
                 f"rank_timeout_s must be positive, got {self.rank_timeout_s}")

    @property
    def lora_paths(self) -> dict[str, str]:
        """`lora_modules` as adapter name -> folder."""
        return dict(m.split("=", 1) for m in self.lora_modules)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` parsed (ValueError naming a bad key or value)."""
        return parse_speculative_config(self.speculative_config)

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
