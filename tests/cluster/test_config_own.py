"""Every field the cluster defines itself (replicas, placement, autoscaling, ports, keys from the
environment) reaches a setting, and the same setting whether the deployment runs on Ray or in
process (`cluster.settings`), or only the mode it belongs to. Each field in turn is set to a value
other than the base config's; the settings each mode would run with are compared before and
after. No Ray, no model: only the translations run. The settings defined on the router's, the
engine's and the workers' records are tested from their definitions in test_config_reach.py.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from typing import Any, Iterator, Literal

import pytest
from pydantic import BaseModel

from cluster.app import pool_deployment_options, router_deployment_options
from cluster.config import CleaveConfig, ConfigError
from cluster.derive import Source
from cluster.ingress import router_config as ray_router_config
from cluster.pool import engine_spec
from cluster.serve_config import build_serve_config
from cluster.settings import in_process_plan, model_path, router_cores

MODEL = "/models/coverage-model"
KEYS_ENV = "CLEAVE_COVERAGE_KEYS"  # `router.api_keys_env` names it; it holds one key


def _scaling() -> dict[str, Any]:
    """A pool that autoscales (min < max), so the autoscaling fields reach the Serve options."""
    return {"replicas": {"min": 1, "max": 2}}


BASES = {
    "disaggregated": {"model": {"path": MODEL},
                      "pools": {"prefill": _scaling(), "decode": _scaling()}},
    "aggregated": {"model": {"path": MODEL}, "pools": {"aggregated": _scaling()}},
}

# Fields that only make sense in one mode: (path, pools as *) -> (the mode, why). Each must
# reach that mode, and only it.
ONE_MODE = {
    "router.replicas": ("ray", "in process there is one router"),
    "router.ingress": ("ray", "how Serve exposes the router; in process it binds its ports"),
    "pools.*.replicas.max": ("ray", "an autoscaling bound; in process a pool keeps the "
                                    "replicas it starts with"),
    "pools.*.memory_per_rank_bytes": ("ray", "a placement resource"),
    "pools.*.resources": ("ray", "a placement resource"),
    "router.cpu_affinity": ("ray", "the router replicas' processes are pinned; in process "
                                   "the router shares the workers' process"),
    "pools.*.autoscaling.*": ("ray", "nothing autoscales in process"),
}

# Fields a pool of that kind has but does not use: the config refuses a value other than the
# default, naming the field, rather than dropping it (path -> the text of the error).
REFUSED = {
    "pools.prefill.autoscaling.target_kv_usage": "the prefill pool scales on",
    "pools.prefill.autoscaling.target_running_seqs": "the prefill pool scales on",
    "pools.decode.autoscaling.target_waiting_tokens": "the decode pool scales on",
    "pools.aggregated.autoscaling.target_waiting_tokens": "the aggregated pool scales on",
}

# Fields that gate the config's own checks and reach no setting: path -> (a config the check
# refuses without the field, the text of that refusal). Each must let that config through.
GATES = {
    "router.allow_unauthenticated": ({"router": {"host": "0.0.0.0"}},
                                     "serves beyond this machine"),
}

# Values the generic choice (`_other_value`) cannot make valid or telling: path -> value.
VALUES = {
    "pools.*.replicas.initial": 2,  # the base starts min = 1 replica: initial 1 changes nothing
    "router.host": "127.0.0.2",  # loopback: a non-loopback host needs keys (tested apart)
    "router.api_keys_env": KEYS_ENV,
    "pools.*.cpu_affinity": [0],
    "router.cpu_affinity": [0],
}


def _generic(path: tuple[str, ...]) -> str:
    return ".".join("*" if i == 1 and path[0] == "pools" else p for i, p in enumerate(path))


def _matches(path: tuple[str, ...], pattern: str) -> bool:
    parts = pattern.split(".")
    if parts[-1] == "*" and len(path) >= len(parts):
        path = path[:len(parts)]
    return len(path) == len(parts) and all(p in ("*", q) for p, q in zip(parts, path))


def _lookup(table: dict[str, Any], path: tuple[str, ...]) -> Any:
    return next((v for k, v in table.items() if _matches(path, k)), None)


# ---- walking the config's fields -------------------------------------------------------------


def _model_type(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model in `annotation` (`X`, `X | None`), or None for a leaf."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (
        annotation,)
    return next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)


def leaf_fields(model: BaseModel, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Paths of every leaf field under `model` (sub-models that are None are skipped)."""
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if _model_type(info.annotation) is not None:
            if value is not None:
                yield from leaf_fields(value, prefix + (name,))
        else:
            yield prefix + (name,)


def all_field_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> set[str]:
    """Every leaf field of the model type, pools as *."""
    out = set()
    for name, info in model.model_fields.items():
        sub = _model_type(info.annotation)
        out |= (all_field_paths(sub, prefix + (name,)) if sub is not None
                else {_generic(prefix + (name,))})
    return out


def _field_info(path: tuple[str, ...]) -> Any:
    model: type[BaseModel] = CleaveConfig
    for name in path[:-1]:
        model = _model_type(model.model_fields[name].annotation)
    return model.model_fields[path[-1]]


def _bounds(info: Any) -> tuple[float | None, float | None]:
    low = high = None
    for m in info.metadata:
        if getattr(m, "ge", None) is not None:
            low = m.ge
        if getattr(m, "gt", None) is not None:
            low = m.gt + (1 if isinstance(m.gt, int) else 0.5)
        if getattr(m, "le", None) is not None:
            high = m.le
        if getattr(m, "lt", None) is not None:
            high = m.lt
    return low, high


def _other_value(path: tuple[str, ...], current: Any) -> Any:
    """A valid value other than `current`, from the field's type and bounds."""
    chosen = _lookup(VALUES, path)
    if chosen is not None:
        return chosen
    info = _field_info(path)
    kind = info.annotation
    if isinstance(kind, types.UnionType):  # X | None
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    low, high = _bounds(info)
    if typing.get_origin(kind) is Literal:
        return next(c for c in typing.get_args(kind) if c != current)
    if kind is bool:
        return not current
    if kind is int:
        return current + 1 if current is not None else int(low or 0) + 1
    if kind is float:
        if current is None:
            return float(low or 0) + 1.0
        value = current * 2 if current else 1.0
        return value if high is None or value <= high else current / 2
    if kind is str:
        return f"{current}-other" if current else "other"
    if typing.get_origin(kind) is dict:
        return {"cleave_test": 1.0}
    if typing.get_origin(kind) is list:
        return ["test-key"]
    raise AssertionError(f"no value rule for {'.'.join(path)} ({info.annotation}); add one "
                         f"to VALUES")


def with_field(base: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """`base` with the field at `path` set, and what it must agree with set alike."""
    data = copy.deepcopy(base)
    node = data
    for name in path[:-1]:
        node = node.setdefault(name, {})
    node[path[-1]] = value
    generic = _generic(path)
    if generic == "pools.*.ep":  # ep is 1 or tp
        node["tp"] = value
    if generic in ("pools.*.engine.block_size", "pools.*.engine.kv_cache_dtype"):  # all pools
        for pool in data["pools"].values():
            pool.setdefault("engine", {})[path[-1]] = value
    return data


# ---- what each mode runs with ----------------------------------------------------------------


def _flat(value: Any, prefix: tuple[str, ...], out: dict[tuple[str, ...], Any]) -> None:
    if dataclasses.is_dataclass(value):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flat(v, prefix + (str(k),), out)
    else:
        out[prefix] = value


def ray_settings(config: CleaveConfig) -> dict[tuple[str, ...], Any]:
    """The Ray app's settings: those in-process has too (router, listen, pools), then the
    Serve options only Ray has (under "ray")."""
    shared: dict[str, Any] = {"router": ray_router_config(config, model_path(config))}
    serve = build_serve_config(config)
    shared["listen"] = {"host": serve["http_options"]["host"],
                        "http_port": serve["http_options"]["port"],
                        "grpc_port": serve["grpc_options"]["port"]}
    pools, only_ray = {}, {"router": router_deployment_options(config),
                           "router_cores": router_cores(config),
                           "proxy_location": serve["proxy_location"]}
    for name, pool in config.pools.items():
        spec = engine_spec(config, name, "worker")
        options = pool_deployment_options(name, pool)
        start = options.get("num_replicas") or options["autoscaling_config"]["initial_replicas"]
        pools[name] = {"role": spec.role, "replicas": start, "engine": spec.engine,
                       "worker": spec.worker, "cpu_affinity": spec.cpu_affinity,
                       "cores_per_rank": spec.cores_per_rank}
        only_ray[f"pool-{name}"] = {**options, "torch_threads": spec.torch_threads}
    shared["pools"] = pools
    out: dict[tuple[str, ...], Any] = {}
    _flat({**shared, "ray": only_ray}, (), out)
    return out


def in_process_settings(config: CleaveConfig) -> dict[tuple[str, ...], Any]:
    """What `cleave serve --in-process` runs (`cluster.local_server` builds exactly this)."""
    plan = in_process_plan(config, model_path(config))
    out: dict[tuple[str, ...], Any] = {}
    _flat({"router": plan.router,
           "listen": {"host": plan.host, "http_port": plan.http_port, "grpc_port": plan.grpc_port},
           "pools": {p.name: {"role": p.role, "replicas": p.replicas, "engine": p.engine,
                              "worker": p.worker, "cpu_affinity": p.cpu_affinity,
                              "cores_per_rank": p.cores_per_rank} for p in plan.pools}}, (),
          out)
    return out


def changed(before: dict, after: dict) -> dict[tuple[str, ...], Any]:
    return {k: after.get(k) for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


# ---- the tests -------------------------------------------------------------------------------


def test_the_bases_differ_only_in_the_modes_migration_wait(monkeypatch):
    monkeypatch.setenv(KEYS_ENV, "env-key")
    for base in BASES.values():
        config = CleaveConfig.parse(base)
        ray = {k: v for k, v in ray_settings(config).items() if k[0] != "ray"}
        assert changed(ray, in_process_settings(config)) == {("router", "migration_wait_s"): 0.0}
        assert ray[("router", "migration_wait_s")] == 120.0


def test_the_walk_covers_every_field_and_the_tables_name_real_ones():
    walked = {p for base in BASES.values() for p in leaf_fields(CleaveConfig.parse(base))}
    assert {_generic(p) for p in walked} == all_field_paths(CleaveConfig)
    for pattern in [*ONE_MODE, *REFUSED, *VALUES, *GATES]:
        assert any(_matches(p, pattern) for p in walked), f"{pattern} names no config field"


def _derived(path: tuple[str, ...]) -> bool:
    """Whether the field is a record's setting (`cluster.derive`), not the cluster's own."""
    return any(isinstance(m, Source) for m in _field_info(path).metadata)


def _cases() -> Iterator[Any]:
    for base_name, base in BASES.items():
        for path in leaf_fields(CleaveConfig.parse(base)):
            if not _derived(path):
                yield pytest.param(base_name, path, id=f"{base_name}:{'.'.join(path)}")


@pytest.mark.parametrize("base_name, path", list(_cases()))
def test_every_field_reaches_the_same_setting_in_both_modes(monkeypatch, base_name, path):
    monkeypatch.setenv(KEYS_ENV, "env-key")
    base = BASES[base_name]
    config = CleaveConfig.parse(base)
    node: Any = config
    for name in path:
        node = getattr(node, name)
    data = with_field(base, path, _other_value(path, node))
    name = ".".join(path)
    refused = REFUSED.get(name)
    if refused is not None:
        with pytest.raises(ConfigError, match=refused):
            CleaveConfig.parse(data)
        return
    gate = GATES.get(name)
    if gate is not None:
        gated, refusal = gate
        with pytest.raises(ConfigError, match=refusal):
            CleaveConfig.parse({**base, **gated})
        allowed = with_field({**base, **gated}, path, _other_value(path, node))
        assert CleaveConfig.parse(allowed)
        return
    other = CleaveConfig.parse(data)
    ray = changed(ray_settings(config), ray_settings(other))
    local = changed(in_process_settings(config), in_process_settings(other))
    reached = {m for m, c in (("ray", ray), ("in_process", local)) if c}
    one_mode = _lookup(ONE_MODE, path)
    if one_mode is not None:
        assert reached == {one_mode[0]}, (
            f"{name} is listed as {one_mode[0]}-only ({one_mode[1]}) but reaches {reached}")
        return
    assert reached, f"{name} reaches no setting in either mode"
    assert reached == {"ray", "in_process"}, f"{name} reaches only {reached}"
    shared = {k: v for k, v in ray.items() if k[0] != "ray"}
    assert shared == local, f"{name}: Ray runs with {shared}, in process with {local}"
