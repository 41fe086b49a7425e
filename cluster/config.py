"""The cluster's configuration: one pydantic model, loaded from YAML, every field documented.

`CleaveConfig` is the single source of truth for a deployment: `cleave serve --config FILE`,
`python -m cluster.launch --config FILE` (Ray job submission), `cleave build-serve-config` and the
Helm chart's `serveConfigV2` (whose application `args` are this model as a dict) all read it.
Errors are raised as `ConfigError`, one line per problem, naming the field by its dotted path
("pools.decode.tp=3 does not divide the model's 8 KV heads").

Defaults are written once (the rule is `cluster.settings`'s): a setting an inner record has
(`router.config.RouterConfig`, `workers.engine.config.EngineConfig`, `workers.serving.worker.Worker`'s keywords)
takes its default from that record (`default_of`); a setting only the cluster has (replicas,
placement, autoscaling, ports) has its default here.

Checks against the model's own config.json (head counts, layers, context length) need the model
folder, so they run in `check_against_model`, called where the model is present (the CLI, the
replicas), not on load (the chart renders the config on a machine without the model).

Long because it is the config's reference: every field carries the description that the Helm
chart's schema and values table are generated from.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any, Callable, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from router.config import RouterConfig
from workers.engine.config import EngineConfig
from workers.serving.worker import Worker

POOL_NAMES = ("prefill", "decode", "aggregated")
# the worker role each pool's replicas serve (`workers.serving.worker.ROLES`)
POOL_ROLES = {"prefill": "prefill", "decode": "decode", "aggregated": "both"}
# on Ray, how long a stream whose decode worker died waits for another by default: Serve
# replaces a pool's lost replica, and a replica loads its model within this
RAY_MIGRATION_WAIT_S = 120.0


def default_of(record: Callable[..., Any], name: str) -> Any:
    """The default of keyword `name` of `record` (a dataclass or a class): the one place that
    default is written."""
    default = inspect.signature(record).parameters[name].default
    if default is inspect.Parameter.empty:
        raise TypeError(f"{record.__name__}.{name} has no default to read")
    return default


def _check_cores(cores: list[int] | None) -> list[int] | None:
    if cores is None:
        return None
    if not cores or min(cores) < 0 or len(set(cores)) != len(cores):
        raise ValueError(f"cpu_affinity={cores}: expected distinct core numbers >= 0, at "
                         f"least one")
    return cores


class ConfigError(ValueError):
    """A configuration the cluster cannot run; the message names each bad field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSettings(_Strict):
    path: str | None = Field(None, description=(
        "A model folder (config.json, safetensors, tokenizer files) readable on every node. "
        "Unset: the embedded tiny model, created on first use."))
    served_model_name: str | None = Field(
        default_of(RouterConfig, "served_model_name"), description=(
            "The name clients pass as `model`; default: the model folder's name."))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default_of(EngineConfig, "dtype"), description=(
            "Weights and activations; auto: the checkpoint's own dtype."))
    max_model_len: int | None = Field(
        default_of(EngineConfig, "max_model_len"), ge=2, description=(
            "Tokens per sequence, prompt and output together; default: the model's context."))
    load_format: Literal["auto", "safetensors", "dummy"] = Field(
        default_of(EngineConfig, "load_format"), description=(
            "dummy: seeded random weights of the checkpoint's shapes (benchmarks)."))


class ReplicaSettings(_Strict):
    min: int = Field(1, ge=0, description="Replicas the autoscaler keeps at least.")
    max: int = Field(1, ge=1, description="Replicas the autoscaler grows to at most.")
    initial: int | None = Field(None, ge=0, description="Replicas at start; default: min.")

    @model_validator(mode="after")
    def _ordered(self) -> ReplicaSettings:
        if self.min > self.max:
            raise ValueError(f"min={self.min} is more than max={self.max}")
        if self.initial is not None and not self.min <= self.initial <= self.max:
            raise ValueError(f"initial={self.initial} is outside [min={self.min}, "
                             f"max={self.max}]")
        return self

    @property
    def start(self) -> int:
        return self.min if self.initial is None else self.initial


class EngineSettings(_Strict):
    """Per-replica engine options: `workers.engine.config.EngineConfig`'s fields, with its defaults."""

    block_size: Literal[1, 2, 4, 8, 16, 32, 64, 128, 256] = Field(
        default_of(EngineConfig, "block_size"), description=(
            "Tokens per KV block; the same in every pool."))
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8", "fp8",
                            "fp8_e4m3"] = Field(
        default_of(EngineConfig, "kv_cache_dtype"), description=(
            "KV-cache element type; the same in every pool. auto: the model's dtype. int8 / "
            "fp8 (e4m3): 8 bits with a scale per token and head, 1.78x the blocks of bf16 in "
            "the same bytes; every attention backend reads it."))
    kv_cache_memory_bytes: int | None = Field(
        default_of(EngineConfig, "kv_cache_memory_bytes"), gt=0, description=(
            "KV-cache budget per rank; default 512 MiB on CPU, from gpu_memory_utilization on "
            "GPU."))
    host_kv_cache_memory_bytes: int = Field(
        default_of(EngineConfig, "host_kv_cache_memory_bytes"), ge=0, description=(
            "Host memory per replica for the KV cache's host tier: prefix-cache blocks evicted "
            "from the KV cache are kept there and copied back on a hit instead of recomputed. "
            "0: no host tier. Needs enable_prefix_caching."))
    gpu_memory_utilization: float = Field(
        default_of(EngineConfig, "gpu_memory_utilization"), gt=0, le=1, description=(
            "On GPU: the fraction of memory free after loading the model given to the KV "
            "cache."))
    num_blocks: int | None = Field(default_of(EngineConfig, "num_blocks"), ge=1, description=(
        "Exactly this many KV blocks (overrides the memory budget)."))
    max_num_seqs: int = Field(default_of(EngineConfig, "max_num_seqs"), ge=1, description=(
        "Running sequences at most."))
    max_num_batched_tokens: int = Field(
        default_of(EngineConfig, "max_num_batched_tokens"), ge=1, description=(
            "New tokens per engine step at most (the chunked-prefill budget)."))
    enable_prefix_caching: bool = Field(
        default_of(EngineConfig, "enable_prefix_caching"), description=(
            "Reuse cached KV blocks of prefixes."))
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = Field(
        default_of(EngineConfig, "attention_backend"), description=(
            "Attention kernels. auto: triton on a GPU when installed; on the CPU, cpu (a C "
            "decode kernel compiled at first use) when a C compiler is present; torch "
            "otherwise."))
    enforce_eager: bool = Field(default_of(EngineConfig, "enforce_eager"), description=(
        "On a GPU: run every decode step eagerly instead of replaying CUDA graphs."))
    max_cuda_graph_batch_size: int = Field(
        default_of(EngineConfig, "max_cuda_graph_batch_size"), ge=0, description=(
            "Decode batches up to this size replay CUDA graphs (0: none)."))
    async_scheduling: bool = Field(default_of(EngineConfig, "async_scheduling"), description=(
        "Schedule and launch the next step while the current one runs on the device (one "
        "rank per replica; steps with penalties, grammars, seeds or min_tokens run "
        "synchronously)."))
    fp32_int_kernels: bool = Field(default_of(EngineConfig, "fp32_int_kernels"), description=(
        "With model.dtype float32 and an int8 or int4 checkpoint on a CPU with AVX-512 VNNI: "
        "keep the weights packed for Cleave's int kernels (activations quantized to int8 in "
        "the kernel; 1.3-2.1x a bfloat16 engine's decode step on the small preset) instead "
        "of dequantizing them to fp32, the faithful reference."))


class AutoscalingSettings(_Strict):
    """How one pool grows and shrinks. Prefill pools scale on waiting prompt tokens per
    replica; decode and aggregated pools on KV occupancy and running sequences per replica.
    Replicas = ceil(current * load / target), clamped to [min, max]; a scale-down waits until
    load has stayed below target × (1 - hysteresis) for `downscale_delay_s`."""

    target_waiting_tokens: int = Field(2048, ge=1, description=(
        "Prefill: prompt tokens waiting per replica the pool aims for."))
    target_kv_usage: float = Field(0.7, gt=0, le=1, description=(
        "Decode: fraction of KV blocks in use per replica the pool aims for."))
    target_running_seqs: int = Field(32, ge=1, description=(
        "Decode: running sequences per replica the pool aims for."))
    upscale_delay_s: float = Field(5.0, ge=0, description=(
        "Load must stay above target this long before replicas are added."))
    downscale_delay_s: float = Field(30.0, ge=0, description=(
        "Load must stay below target this long before replicas are removed."))
    hysteresis: float = Field(0.2, ge=0, lt=1, description=(
        "Scale down only below target × (1 - hysteresis), so the count does not flap."))
    metrics_interval_s: float = Field(1.0, gt=0, description=(
        "How often each replica reports its load to the autoscaler."))
    drain_timeout_s: float = Field(120.0, ge=0, description=(
        "A replica being removed waits this long for its requests to finish; those left "
        "move to other workers."))


# the autoscaling targets a pool of each kind does not scale on (prefill: waiting prompt tokens;
# decode and aggregated: KV occupancy and running sequences)
_UNUSED_TARGETS = {"prefill": ("target_kv_usage", "target_running_seqs"),
                   "decode": ("target_waiting_tokens",)}


class PoolSettings(_Strict):
    replicas: ReplicaSettings = Field(default_factory=ReplicaSettings)
    tp: int = Field(default_of(EngineConfig, "tensor_parallel_size"), ge=1, description=(
        "Tensor-parallel ranks per replica."))
    pp: int = Field(default_of(EngineConfig, "pipeline_parallel_size"), ge=1, description=(
        "Pipeline stages per replica."))
    ep: int = Field(default_of(EngineConfig, "expert_parallel_size"), ge=1, description=(
        "Expert-parallel ranks (MoE models): 1, or tp to shard the experts across the "
        "tensor-parallel group."))
    gpus_per_rank: float = Field(0.0, ge=0, description=(
        "GPUs each rank reserves; 0 runs on CPU. Set 1 on GPU clusters."))
    cpus_per_rank: float = Field(1.0, ge=0, description="CPUs each rank reserves.")
    memory_per_rank_bytes: int | None = Field(None, gt=0, description=(
        "Host memory each rank reserves (a Ray resource; unset: no reservation)."))
    resources: dict[str, float] = Field(default_factory=dict, description=(
        "Custom Ray resources each rank reserves, e.g. {cleave_pool_decode: 1} to keep the "
        "pool on nodes started with that resource."))
    cpu_affinity: list[int] | None = Field(None, description=(
        "Host cores (on each node) this pool's ranks run on, as if each had a GPU to itself: "
        "a rank claims cpus_per_rank of them (at least one) that no other worker on its node "
        "holds, pins its process and its torch threads to them, and fails to start naming "
        "the list when too few are free. Unset: not pinned (Ray runs"
        " the rank's threads anywhere)."))
    step_timeout_s: float = Field(default_of(Worker, "step_timeout_s"), gt=0, description=(
        "A worker whose engine step runs longer fails its health check and leaves routing "
        "(its streams move to other workers) until the step returns."))
    max_waiting_requests: int = Field(
        default_of(Worker, "max_waiting_requests"), ge=1, description=(
            "Requests a worker queues at most; more are refused as overloaded (the router "
            "tries another worker, or answers 429 when every one is full)."))
    engine: EngineSettings = Field(default_factory=EngineSettings)
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)

    _cores = field_validator("cpu_affinity")(lambda v: _check_cores(v))

    @model_validator(mode="after")
    def _ep_within_tp(self) -> PoolSettings:
        if self.cpu_affinity is not None and len(self.cpu_affinity) < self.cores_per_rank:
            raise ValueError(f"cpu_affinity={self.cpu_affinity} lists fewer cores than one "
                             f"rank reserves (cpus_per_rank={self.cpus_per_rank}: "
                             f"{self.cores_per_rank})")
        if self.ep not in (1, self.tp):
            raise ValueError(f"ep={self.ep} must be 1 or equal to tp={self.tp} (experts are "
                             f"sharded across the tensor-parallel group)")
        if self.ranks > 1 and self.gpus_per_rank and self.gpus_per_rank != int(
                self.gpus_per_rank):
            raise ValueError(f"gpus_per_rank={self.gpus_per_rank} with tp × pp = {self.ranks} "
                             f"ranks: NCCL needs each rank on GPUs of its own; use a whole "
                             f"number")
        return self

    @property
    def ranks(self) -> int:
        return self.tp * self.pp

    @property
    def cores_per_rank(self) -> int:
        """The cores a rank claims from `cpu_affinity`: its CPUs, at least one."""
        return max(1, int(self.cpus_per_rank))


class PoolsSettings(_Strict):
    prefill: PoolSettings | None = Field(None, description=(
        "Prompts to their first token; KV handed off to the decode pool."))
    decode: PoolSettings | None = Field(None, description=(
        "Continues handed-off requests; also runs short prompts whole."))
    aggregated: PoolSettings | None = Field(None, description=(
        "Workers that prefill and decode (no handoff); instead of prefill and decode."))

    @model_validator(mode="after")
    def _shape(self) -> PoolsSettings:
        if self.aggregated is not None and (self.prefill or self.decode):
            raise ValueError("give either an aggregated pool or prefill/decode pools, not both")
        if self.aggregated is None and self.decode is None:
            raise ValueError("a deployment needs a decode pool (with or without a prefill "
                             "pool) or an aggregated pool")
        for name, pool in self.items():
            if name != "aggregated" and pool.pp > 1 and pool.gpus_per_rank > 0:
                raise ValueError(
                    f"{name}: a GPU pool of pp = {pool.pp} pipeline stages keeps each stage's "
                    f"layers of the KV cache on its ranks' GPUs and cannot hand it off yet; use "
                    f"an aggregated pool, or pp = 1 for prefill/decode pools (tp > 1 hands off "
                    f"from every rank)")
        for name, pool in self.items():
            unused = _UNUSED_TARGETS["prefill" if name == "prefill" else "decode"]
            for field in unused:
                value = getattr(pool.autoscaling, field)
                if value != AutoscalingSettings.model_fields[field].default:
                    used = _UNUSED_TARGETS["decode" if name == "prefill" else "prefill"]
                    raise ValueError(f"{name}.autoscaling.{field}={value}: the {name} pool "
                                     f"scales on {' and '.join(used)}")
        for field in ("block_size", "kv_cache_dtype"):  # KV handed off block for block
            values = {getattr(b.engine, field) for _, b in self.items()}
            if len(values) > 1:
                raise ValueError(f"every pool must use the same engine.{field}, got "
                                 f"{sorted(values)}")
        return self

    def items(self) -> list[tuple[str, PoolSettings]]:
        """(name, settings) of the pools present, in POOL_NAMES order."""
        return [(n, p) for n in POOL_NAMES if (p := getattr(self, n)) is not None]


class RouterSettings(_Strict):
    replicas: int = Field(1, ge=1, description="Router (ingress) replicas.")
    host: str = Field("127.0.0.1", description=(
        "Address the HTTP and gRPC servers bind; 0.0.0.0 in a cluster."))
    http_port: int = Field(8000, ge=1, le=65535, description="OpenAI-compatible HTTP port.")
    grpc_port: int = Field(50051, ge=1, le=65535, description="gRPC port.")
    ingress: Literal["direct", "serve"] = Field("direct", description=(
        "direct: each router replica serves HTTP and gRPC on the ports itself (several on one "
        "node share them with SO_REUSEPORT; no proxy hop per token). serve: Ray Serve's "
        "proxies take the ports and forward to the router replicas (what KubeRay's serve "
        "Service expects)."))
    policy: Literal["prefix_aware", "least_loaded", "round_robin"] = Field(
        default_of(RouterConfig, "policy"), description="How a worker is chosen for a prompt.")
    policy_weights: dict[str, float] = Field(default_factory=dict, description=(
        "prefix_aware: w_hit, w_queue, w_kv, queue_scale."))
    api_keys: list[str] = Field(default_factory=list, description=(
        "Accepted bearer keys; empty and no api_keys_env: no authentication."))
    api_keys_env: str | None = Field(None, description=(
        "An environment variable holding comma-separated keys (e.g. from a Secret); unset or "
        "empty where the router starts is an error, not an open server."))
    allow_unauthenticated: bool = Field(False, description=(
        "Serve on a non-loopback host without API keys. Without it such a config is "
        "refused: every route but /health would be open to the network."))
    cpu_affinity: list[int] | None = Field(None, description=(
        "Host cores the router replicas run on (shared by the replicas on a node; not claimed "
        "from the pools' cores, so list others). Unset: not pinned."))
    _cores = field_validator("cpu_affinity")(lambda v: _check_cores(v))
    disagg_threshold_tokens: int = Field(
        default_of(RouterConfig, "disagg_threshold_tokens"), ge=0, description=(
            "Prompts with fewer uncached tokens than this prefill on the decode worker."))
    max_in_flight: int = Field(default_of(RouterConfig, "max_in_flight"), ge=1, description=(
        "Requests per router replica; more: 429."))
    max_n: int = Field(default_of(RouterConfig, "max_n"), ge=1, description=(
        "Samples per request at most."))
    kv_poll_interval_s: float = Field(
        default_of(RouterConfig, "kv_poll_interval_s"), gt=0, description=(
            "How often the router re-checks its workers' health and the directory."))
    start_retries: int = Field(default_of(RouterConfig, "start_retries"), ge=0, description=(
        "Other workers an aggregated request is started on when its worker fails or refuses "
        "it before the first token."))
    max_waiting_per_worker: int = Field(
        default_of(RouterConfig, "max_waiting_per_worker"), ge=1, description=(
            "Admission: requests waiting on a worker at most; when every healthy worker of "
            "the pool has this many, a request gets 429 with Retry-After."))
    max_pending_tokens_per_worker: int = Field(
        default_of(RouterConfig, "max_pending_tokens_per_worker"), ge=1, description=(
            "Admission: prompt tokens waiting on a worker at most (same rule)."))
    prefill_timeout_s: float = Field(
        default_of(RouterConfig, "prefill_timeout_s"), gt=0, description=(
            "A prefill not answered in this time is aborted and retried on another worker."))
    stall_timeout_s: float = Field(
        default_of(RouterConfig, "stall_timeout_s"), gt=0, description=(
            "A worker whose output channel is silent this long (it answers every 0.5 s when "
            "idle) is unhealthy; the streams on it move to other workers."))
    tool_call_parser: Literal["llama3_json", "hermes", "mistral"] | None = Field(
        None, description=(
            "How the model writes tool calls (vLLM's --tool-call-parser names); unset: the "
            "format its chat template's wording shows, and none when it renders no tools."))
    rebalance_kv_usage: float | None = Field(None, gt=0, le=1, description=(
        "A decode-pool worker whose KV usage reaches this fraction moves its longest running "
        "stream, with its KV (nothing recomputed), to the least used worker at least 0.2 "
        "below it, every kv_poll_interval_s. Unset: running streams stay where they started."))
    migration_wait_s: float | None = Field(None, ge=0, description=(
        f"A stream whose decode worker died waits this long for another one before it fails. "
        f"Unset: {RAY_MIGRATION_WAIT_S:g} s on Ray, where a pool that lost its only replica "
        f"gets it replaced; {default_of(RouterConfig, 'migration_wait_s'):g} s in process, where "
        f"nothing replaces a dead worker."))

    @model_validator(mode="after")
    def _ports(self) -> RouterSettings:
        if self.http_port == self.grpc_port:
            raise ValueError(f"http_port and grpc_port are both {self.http_port}")
        if any(not k for k in self.api_keys):
            raise ValueError("api_keys must not contain empty strings")
        if not (is_loopback(self.host) or self.api_keys or self.api_keys_env
                or self.allow_unauthenticated):
            raise ValueError(
                f"host={self.host!r} serves beyond this machine and no API key is set; set "
                f"api_keys or api_keys_env (cleave serve: --api-key or CLEAVE_API_KEYS), or "
                f"allow_unauthenticated (--allow-unauthenticated) to serve without keys")
        allowed = {"w_hit", "w_queue", "w_kv", "queue_scale"}
        unknown = sorted(set(self.policy_weights) - allowed)
        if unknown:
            raise ValueError(f"unknown policy_weights {unknown}; expected some of "
                             f"{sorted(allowed)}")
        if self.policy_weights and self.policy != "prefix_aware":
            raise ValueError(f"policy_weights apply to prefix_aware, not {self.policy!r}")
        return self


class KVTransferSettings(_Strict):
    """Every worker's transfer options: `workers.serving.worker.Worker`'s keywords, with its defaults."""

    transport: Literal["tcp", "ucx", "nccl"] = Field(default_of(Worker, "transport"), description=(
        "How KV blocks move from prefill to decode workers (nccl runs on gloo with CPU "
        "caches)."))
    lease_s: float = Field(default_of(Worker, "lease_s"), gt=0, description=(
        "How long prefilled blocks wait for their decode worker at most."))
    pull_timeout_s: float = Field(default_of(Worker, "pull_timeout_s"), gt=0, description=(
        "How long a decode waits for its KV."))


class CleaveConfig(_Strict):
    """A whole deployment: the model, its worker pools, the router, the KV transport."""

    model: ModelSettings = Field(default_factory=ModelSettings)
    pools: PoolsSettings = Field(default_factory=lambda: PoolsSettings(
        prefill=PoolSettings(), decode=PoolSettings()))
    router: RouterSettings = Field(default_factory=RouterSettings)
    kv_transfer: KVTransferSettings = Field(default_factory=KVTransferSettings)

    @classmethod
    def parse(cls, data: dict[str, Any]) -> CleaveConfig:
        """Validate a dict (YAML's or JSON's), raising `ConfigError` naming each bad field."""
        if not isinstance(data, dict):
            raise ConfigError(f"a Cleave config is a mapping, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(format_errors(exc)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> CleaveConfig:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        return cls.parse(data or {})

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe, round-trips through `parse`."""
        return json.loads(self.model_dump_json())

    def check_against_model(self, model_config: Any) -> None:
        """Raise `ConfigError` for pool shapes the model cannot take. `model_config`:
        `workers.models.model_config.ModelConfig` (num_heads, num_kv_heads, num_layers, ...)."""
        problems = []
        heads = model_config.num_attention_heads
        kv_heads = model_config.num_key_value_heads
        layers = model_config.num_hidden_layers
        moe = getattr(model_config, "moe", None)
        experts = moe.num_experts if moe is not None else None
        for name, pool in self.pools.items():
            if heads % pool.tp:
                problems.append(f"pools.{name}.tp={pool.tp} does not divide the model's "
                                f"{heads} attention heads")
            if kv_heads % pool.tp:
                problems.append(f"pools.{name}.tp={pool.tp} does not divide the model's "
                                f"{kv_heads} KV heads")
            if pool.pp > layers:
                problems.append(f"pools.{name}.pp={pool.pp} is more than the model's {layers} "
                                f"layers")
            if pool.ep > 1 and not experts:
                problems.append(f"pools.{name}.ep={pool.ep} needs a mixture-of-experts model; "
                                f"this one has no experts")
            elif pool.ep > 1 and experts % pool.ep:
                problems.append(f"pools.{name}.ep={pool.ep} does not divide the model's "
                                f"{experts} experts")
        max_len = self.model.max_model_len
        if max_len is not None and max_len > model_config.max_position_embeddings:
            problems.append(f"model.max_model_len={max_len} is more than the model's context "
                            f"of {model_config.max_position_embeddings} tokens")
        if problems:
            raise ConfigError("; ".join(problems))


def is_loopback(host: str) -> bool:
    """True for an address (or name) only this machine reaches."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def format_errors(exc: ValidationError) -> str:
    """One line per problem: `pools.decode.tp: Input should be greater than or equal to 1
    (got 0)`."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        got = "" if err["type"] in ("missing", "extra_forbidden") else f" (got {err['input']!r})"
        if err["type"] == "model_type" or isinstance(err["input"], dict):
            got = ""
        lines.append(f"{where}: {msg}{got}")
    return "; ".join(lines)
