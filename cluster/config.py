"""The cluster's configuration: pydantic models, loaded from YAML, every field documented.

`CleaveConfig` is what a deployment runs: `cleave serve [--config FILE]`, `python -m
cluster.launch --config FILE`, `cleave build-serve-config` and the Helm chart's `serveConfigV2`
(whose application `args` are this model as a dict) all read it. Errors are `ConfigError`, one
line per problem naming the field's dotted path ("pools.decode.tp=3 does not divide ...").

A setting the router, the engines or the workers run with is not written here: each is defined
once on its record's field (`RouterConfig`, `EngineConfig`, `WorkerOptions`), and `derived`
(`cluster.derive`) adds it to its section's model. What only the cluster has (replicas,
placement, autoscaling, ports, keys from the environment) is defined here, once. The flags
(`cluster.flags`) and the chart's values schema (`deploy/helm/cleave/tools/gen_docs.py`) are
generated from these models. Checks against the model's config.json need the model folder:
they run in `check_against_model`, where the model is present, not on load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from cluster.config_checks import (
    check_against_model,
    check_cores,
    check_targets_used,
    format_errors,
    is_loopback,
)
from cluster.derive import RAY_MIGRATION_WAIT_S, derived, flag

__all__ = ["RAY_MIGRATION_WAIT_S", "CleaveConfig", "ConfigError", "is_loopback"]
POOL_NAMES = ("prefill", "decode", "aggregated")
# the worker role each pool's replicas serve (`workers.serving.worker.ROLES`)
POOL_ROLES = {"prefill": "prefill", "decode": "decode", "aggregated": "both"}


class ConfigError(ValueError):
    """A configuration the cluster cannot run; the message names each bad field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    if TYPE_CHECKING:  # the fields `derived` adds
        def __getattr__(self, name: str) -> Any: ...


@derived("model")
class ModelSettings(_Strict):
    path: Annotated[str | None, flag("--model")] = Field(None, description=(
        "A model folder or GGUF file on every node. Unset: the tiny random model, but `cleave "
        "serve` fetches SmolLM2-135M-Instruct once and serves it (names: `tiny`, `smollm2`)."))


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


@derived("engine")
class EngineSettings(_Strict):
    """Per-replica engine options: `workers.engine.config.EngineConfig`'s fields."""


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


@derived("pool")
class PoolSettings(_Strict):
    """One pool: its replicas, what each rank reserves, its engine (tp, pp, ep and the
    workers' own settings are derived fields)."""

    replicas: ReplicaSettings = Field(default_factory=ReplicaSettings)
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
    engine: EngineSettings = Field(default_factory=EngineSettings)
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)

    _cores = field_validator("cpu_affinity")(lambda v: check_cores(v))

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
        return int(self.tp * self.pp)

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
            check_targets_used(name, pool.autoscaling, AutoscalingSettings())
        for field in ("block_size", "kv_cache_dtype"):  # KV handed off block for block
            values = {getattr(b.engine, field) for _, b in self.items()}
            if len(values) > 1:
                raise ValueError(f"every pool must use the same engine.{field}, got "
                                 f"{sorted(values)}")
        return self

    def items(self) -> list[tuple[str, PoolSettings]]:
        """(name, settings) of the pools present, in POOL_NAMES order."""
        return [(n, p) for n in POOL_NAMES if (p := getattr(self, n)) is not None]


POLICY_WEIGHTS = ("w_hit", "w_queue", "w_kv", "queue_scale")  # prefix_aware's


@derived("router")
class RouterSettings(_Strict):
    """The router: where it listens, how it authenticates, and `RouterConfig`'s fields."""

    replicas: int = Field(1, ge=1, description="Router (ingress) replicas.")
    host: Annotated[str, flag("--host")] = Field("127.0.0.1", description=(
        "Address the HTTP and gRPC servers bind; 0.0.0.0 in a cluster."))
    http_port: Annotated[int, flag("--port")] = Field(8000, ge=1, le=65535, description=(
        "OpenAI-compatible HTTP port."))
    grpc_port: Annotated[int, flag("--grpc-port")] = Field(50051, ge=1, le=65535,
                                                           description="gRPC port.")
    ingress: Annotated[Literal["direct", "serve"], flag("--ingress")] = Field(
        "direct", description=(
            "direct: each router replica serves HTTP and gRPC on the ports itself (several on "
            "one node share them with SO_REUSEPORT; no proxy hop per token). serve: Ray "
            "Serve's proxies take the ports and forward to the router replicas (what KubeRay's "
            "serve Service expects)."))
    api_keys_env: str | None = Field(None, description=(
        "An environment variable holding comma-separated keys (e.g. from a Secret); unset or "
        "empty where the router starts is an error, not an open server."))
    allow_unauthenticated: Annotated[bool, flag("--allow-unauthenticated")] = Field(
        False, description=(
            "Serve on a non-loopback host without API keys. Without it such a config is "
            "refused: every route but /health would be open to the network."))
    cpu_affinity: list[int] | None = Field(None, description=(
        "Host cores the router replicas run on (shared by the replicas on a node; not claimed "
        "from the pools' cores, so list others). Unset: not pinned."))
    _cores = field_validator("cpu_affinity")(lambda v: check_cores(v))

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
        unknown = sorted(set(self.policy_weights) - set(POLICY_WEIGHTS))
        if unknown:
            raise ValueError(f"unknown policy_weights {unknown}; expected some of "
                             f"{sorted(POLICY_WEIGHTS)}")
        if self.policy_weights and self.policy != "prefix_aware":
            raise ValueError(f"policy_weights apply to prefix_aware, not {self.policy!r}")
        return self


@derived("kv_transfer")
class KVTransferSettings(_Strict):
    """Every worker's transfer options: `workers.serving.options.WorkerOptions`'s."""


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
        problems = check_against_model(self, model_config)
        if problems:
            raise ConfigError("; ".join(problems))
