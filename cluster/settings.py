"""The one translation of a `CleaveConfig` into the settings each part runs with.

    CleaveConfig ──► RouterConfig                       the router (`router_config`)
                 ──► per pool, PoolPlan:                the pools may differ
                       EngineConfig                     the pool's engines (`engine_config`)
                       WorkerOptions                    how their KV moves (`worker_options`)

Every way of running goes through here: the Ray app (`cluster.pool.engine_spec` for the engine
actors, `cluster.ingress` for the router), `cleave serve --in-process` (`in_process_plan`, run by
`cluster.local_server`), and the Helm chart, whose `serveConfigV2` hands a CleaveConfig dict to
`cluster.app.build_app`. What only Ray has (placement bundles, autoscaling, router replicas) is
`cluster.app`'s.

The translation is mechanical: each record's field is defined once (`workers.contract.setting`),
names the config section holding it, and `cluster.derive.record_kwargs` reads it from there.
What is left here is what the cluster decides itself: the model folder, the engine's device
(from `gpus_per_rank`), keys from the environment, and the mode's default of a setting left
unset (`cluster.derive.MODE_DEFAULTS`). tests/cluster/test_config_reach.py checks that every
setting reaches the Ray app, in-process and the chart from its one definition.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from cluster.config import POOL_ROLES, CleaveConfig, ConfigError, PoolSettings
from cluster.derive import record_kwargs
from router.config import RouterConfig
from workers.engine.config import EngineConfig
from workers.serving.options import WorkerOptions

__all__ = ["InProcessPlan", "PoolPlan", "WorkerOptions", "engine_config", "in_process_plan",
           "router_config", "worker_options"]

Mode = Literal["ray", "in_process"]


@dataclass(frozen=True)
class PoolPlan:
    """One pool's workers: how many at start, in which role, running which engine."""

    name: str  # prefill, decode or aggregated
    role: str  # the workers' role (`workers.serving.worker.ROLES`)
    replicas: int  # at start; in process for good (nothing autoscales there)
    engine: EngineConfig
    worker: WorkerOptions
    cpu_affinity: tuple[int, ...] | None = None  # cores each worker claims from (None: unpinned)
    cores_per_rank: int = 1  # how many of them


@dataclass(frozen=True)
class InProcessPlan:
    """What `cluster.local_server` runs: the router, where it listens, and its pools."""

    router: RouterConfig
    pools: tuple[PoolPlan, ...]
    host: str  # the HTTP and gRPC servers' address, and the workers' KV transport's
    http_port: int  # 0: any free port
    grpc_port: int  # 0: any free port

    def __post_init__(self) -> None:
        if not any(p.role in ("decode", "both") and p.replicas for p in self.pools):
            counts = {p.name: p.replicas for p in self.pools}
            raise ValueError(f"in process the pools keep the replicas they start with, and "
                             f"none of {counts} decodes: give the decode (or aggregated) pool "
                             f"at least one replica at start")


def model_path(config: CleaveConfig) -> str:
    """The model folder; unset in the config: the embedded tiny model (created on first use).
    `cleave serve` settles the path before (`cluster.default_model`): its replicas get one."""
    if config.model.path is not None:
        return config.model.path
    from workers.models.make_model import default_model_path

    return str(default_model_path())


def router_config(config: CleaveConfig, model_path: str, mode: Mode = "ray") -> RouterConfig:
    """The router's settings. Reads the `router.api_keys_env` variable now."""
    r = config.router
    keys = list(r.api_keys)
    if r.api_keys_env:
        from_env = [k for k in os.environ.get(r.api_keys_env, "").split(",") if k]
        if not from_env:  # a missing Secret must not open the server
            raise ConfigError(f"router.api_keys_env={r.api_keys_env!r}: that environment "
                              f"variable is unset or holds no key where the router starts")
        keys += from_env
    return RouterConfig(**{**record_kwargs(RouterConfig, _sections(config), mode),
                           "model_path": model_path, "api_keys": tuple(keys)})


def _sections(config: CleaveConfig, pool: PoolSettings | None = None) -> dict[str, Any]:
    """The config's sections by the names settings' definitions give them."""
    sections: dict[str, Any] = {"model": config.model, "router": config.router,
                                "kv_transfer": config.kv_transfer}
    if pool is not None:
        sections.update(pool=pool, engine=pool.engine)
    return sections


def _pool(config: CleaveConfig, pool: str) -> PoolSettings:
    settings = getattr(config.pools, pool, None) if pool in POOL_ROLES else None
    if settings is None:
        present = [name for name, _ in config.pools.items()]
        raise ValueError(f"no pool {pool!r} in this config; it has {present}")
    return settings


def engine_config(config: CleaveConfig, pool: str, model_path: str) -> EngineConfig:
    """The engine every replica of `pool` runs. The device follows `gpus_per_rank`, said
    outright: on Ray an engine actor that only drives GPU ranks holds no GPU itself, so "auto"
    would resolve to the CPU there."""
    p = _pool(config, pool)
    return EngineConfig(**record_kwargs(EngineConfig, _sections(config, p)), model=model_path,
                        device="cpu" if p.gpus_per_rank == 0 else "cuda")


def worker_options(config: CleaveConfig, pool: str) -> WorkerOptions:
    """A pool's workers' options: the transfer's (the same in every pool) and the pool's
    step watchdog."""
    return WorkerOptions(**record_kwargs(WorkerOptions, _sections(config, _pool(config, pool))))


def pool_cores(pool: PoolSettings) -> tuple[tuple[int, ...] | None, int]:
    """A pool's `cpu_affinity` (None: unpinned) and the cores each of its ranks claims."""
    cores = tuple(pool.cpu_affinity) if pool.cpu_affinity is not None else None
    return cores, pool.cores_per_rank


def pool_plans(config: CleaveConfig, model_path: str) -> tuple[PoolPlan, ...]:
    """The pools present, in `POOL_NAMES` order."""
    return tuple(PoolPlan(name, POOL_ROLES[name], p.replicas.start,
                          engine_config(config, name, model_path), worker_options(config, name),
                          *pool_cores(p))
                 for name, p in config.pools.items())


def torch_threads(pool: PoolSettings) -> int | None:
    """On Ray, a CPU rank's torch threads: the CPUs it reserves (None on GPU: torch's default).
    In process every worker shares the process's threads."""
    return max(1, int(pool.cpus_per_rank)) if pool.gpus_per_rank == 0 else None


def router_cores(config: CleaveConfig) -> tuple[int, ...] | None:
    """On Ray, the host cores every router replica's process is pinned to (None: unpinned)."""
    cores = config.router.cpu_affinity
    return tuple(cores) if cores is not None else None


def in_process_plan(config: CleaveConfig, model_path: str) -> InProcessPlan:
    """`cleave serve --in-process`: each pool's starting replicas as engines in this process
    (or, `--process-per-worker`, each in a process of its own, pinned by `cpu_affinity`)."""
    r = config.router
    return InProcessPlan(router_config(config, model_path, "in_process"),
                         pool_plans(config, model_path), r.host, r.http_port, r.grpc_port)
