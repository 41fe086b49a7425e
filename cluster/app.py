"""The Cleave Ray Serve application, built from a `CleaveConfig`.

    router (ingress: HTTP + gRPC) ──► engine actors, called directly
        │ reads                          ▲ owned by
    directory ◄── registers ── pool-prefill / pool-decode / pool-aggregated replicas

`build_app(args)` is the application builder Serve's config points at
(`import_path: cluster.app:build_app`, `args: <the config as a dict>`); it needs no running Ray.
Each pool is one deployment whose replica is one worker group: its ranks' resources are one
placement group (`STRICT_PACK`), and it autoscales on its own signals (`cluster.autoscaling`).
What the engines and the router run with comes from `cluster.settings`, as in process; the
Serve options here (placement, autoscaling, replicas) are what only Ray has.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from cluster.autoscaling import policy_kwargs
from cluster.config import CleaveConfig, PoolSettings
from cluster.directory import Directory
from cluster.ingress import RouterIngress
from cluster.pool import WorkerReplica

APP_NAME = "cleave"
ROUTER_CPUS = 0.0  # the router is I/O bound; reserving none lets 2 cores fit 2 pools
DRAIN_MARGIN_S = 30.0  # Serve's shutdown timeout beyond the drain timeout
# Serve replaces a replica after 3 failed health checks in a row: measured on an idle machine, a
# broken engine is detected 5 s and replaced 11 s after it breaks (every 5 s: 14 s and 20 s); a
# check is one call to the engine actor
HEALTH_CHECK_PERIOD_S = 2.0


def pool_deployment_options(name: str, pool: PoolSettings) -> dict[str, Any]:
    """Serve options of one pool's deployment."""
    bundle: dict[str, float] = {"CPU": pool.cpus_per_rank}
    if pool.gpus_per_rank:
        bundle["GPU"] = pool.gpus_per_rank
    if pool.memory_per_rank_bytes:
        bundle["memory"] = float(pool.memory_per_rank_bytes)
    bundle.update(pool.resources)
    r, a = pool.replicas, pool.autoscaling
    options: dict[str, Any] = {
        "name": f"pool-{name}",
        "ray_actor_options": {"num_cpus": 0},  # the ranks hold the resources
        "placement_group_bundles": [dict(bundle) for _ in range(pool.ranks)],
        "placement_group_strategy": "STRICT_PACK",
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": a.drain_timeout_s + DRAIN_MARGIN_S,
        "graceful_shutdown_wait_loop_s": 0.5,
        "max_ongoing_requests": 1000,  # Serve calls are control calls; requests bypass Serve
    }
    if r.min == r.max:
        options["num_replicas"] = r.min
    else:
        options["autoscaling_config"] = {
            "min_replicas": r.min, "max_replicas": r.max, "initial_replicas": r.start,
            "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s,
            "metrics_interval_s": a.metrics_interval_s,
            "look_back_period_s": max(2 * a.metrics_interval_s, 2.0),
            "policy": {"policy_function": "cluster.autoscaling:PoolPolicy",
                       "policy_kwargs": policy_kwargs(name, a)},
        }
    return options


def router_deployment_options(config: CleaveConfig) -> dict[str, Any]:
    """Serve options of the router's deployment (its own settings: `cluster.settings`)."""
    return {"name": "router", "num_replicas": config.router.replicas,
            "ray_actor_options": {"num_cpus": ROUTER_CPUS},
            "graceful_shutdown_wait_loop_s": 0.5,
            "max_ongoing_requests": config.router.max_in_flight + 16,
            # with Serve's proxies in front (ingress: serve), their queue is bounded too
            "max_queued_requests": config.router.max_in_flight}


def build_app(args: dict[str, Any]) -> Application:
    """The application for a config dict (`CleaveConfig.to_dict()`); raises `ConfigError`."""
    config = CleaveConfig.parse(args)
    data = config.to_dict()
    directory = serve.deployment(Directory).options(
        name="directory", num_replicas=1, ray_actor_options={"num_cpus": 0},
        graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=5.0).bind()
    pools = [serve.deployment(WorkerReplica).options(
                 **pool_deployment_options(name, pool)).bind(data, name, directory)
             for name, pool in config.pools.items()]
    return serve.deployment(RouterIngress).options(
        **router_deployment_options(config)).bind(data, directory, *pools)
