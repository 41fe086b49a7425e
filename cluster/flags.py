"""Command-line flags onto a `CleaveConfig`, generated from the settings' definitions.

Every field of the cluster config whose definition gives it a flag becomes one: the derived
fields (`cluster.derive.Source`: `--max-num-seqs`, vLLM's names where the definition gives them)
and the cluster's own fields marked with `cluster.derive.flag` (`--port`). Its help is the
definition's description, its choices and bounds the definition's. A flag given on the command
line overrides the `--config` file's value; a flag left out keeps it (or the config's default).
Pool-wide flags (`--tensor-parallel-size`, `--block-size`, ...) apply to every pool. The few
flags that are not one setting (`--device`, worker counts, `--kv-offloading-size` in GiB) are
written here.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel

from cluster.config import CleaveConfig, ConfigError, PoolSettings
from cluster.derive import Flag, Source, config_type
from workers.contract.setting import settings_of
from workers.engine.config import EngineConfig

_DEST = "setting:"  # argparse dest of a generated flag: this, then the field's dotted path


def _strip(annotation: Any) -> Any:
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else annotation
    return annotation


def _submodel(annotation: Any) -> type[BaseModel] | None:
    kind = _strip(annotation)
    return kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None


def flagged_fields(model: type[BaseModel] = CleaveConfig, prefix: tuple[str, ...] = ()
                   ) -> Iterator[tuple[tuple[str, ...], tuple[str, ...], Any, Any]]:
    """(path, flag names, annotation, FieldInfo) of every config field with a flag; a pool's
    fields once, under `pools.*`."""
    for name, info in model.model_fields.items():
        path = prefix + (name,)
        if name == "pools" and not prefix:
            yield from flagged_fields(PoolSettings, ("pools", "*"))
            continue
        sub = _submodel(info.annotation)
        if sub is not None:
            yield from flagged_fields(sub, path)
            continue
        names: tuple[str, ...] = ()
        for meta in info.metadata:
            if isinstance(meta, Source):
                names = meta.flags
            elif isinstance(meta, Flag):
                names = meta.names
        if names:
            yield path, names, info.annotation, info


def flag_kind(annotation: Any, name: str) -> dict[str, Any]:
    """`add_argument` keywords for a field of type `annotation` whose flag is `name`."""
    metavar = name.lstrip("-").upper().replace("-", "_")
    kind = _strip(annotation)
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        return {"type": type(choices[0]), "choices": choices}
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(kind) in (list, tuple):
        return {"action": "append", "type": typing.get_args(kind)[0], "metavar": metavar}
    if kind in (int, float, str):
        return {"type": kind, "metavar": metavar}
    raise TypeError(f"no flag for a setting of type {annotation}; define it with flag=None")


def help_text(description: str | None, default: Any) -> str:
    """A flag's help: the definition's description, and its default when it has one."""
    if not description:
        raise ValueError("a flag needs a description (its --help line)")
    text = description.replace("%", "%%")
    if default is not None and default not in ([], {}, ()) and not callable(default):
        text += f" (default: {default})"
    return text


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `cleave serve` and `cleave build-serve-config` (all default to unset)."""
    p.add_argument("--config", default=None, help="a Cleave config YAML file (flags override it)")
    for path, names, annotation, info in flagged_fields():
        p.add_argument(*names, dest=_DEST + ".".join(path), default=None,
                       help=help_text(info.description,
                                      info.get_default(call_default_factory=True)),
                       **flag_kind(annotation, names[0]))
    p.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="GiB of host memory per replica keeping evicted prefix-cache blocks, "
                        "copied back on a hit instead of recomputed (every pool's "
                        "engine.host_kv_cache_memory_bytes; default 0: none)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: one GPU per rank when this machine has one")
    p.add_argument("--num-workers", type=int, default=None,
                   help="replicas of one aggregated pool (instead of prefill/decode pools)")
    p.add_argument("--prefill-workers", type=int, default=None, help="prefill replicas")
    p.add_argument("--decode-workers", type=int, default=None, help="decode replicas")


def add_engine_flags(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """The flags of `cleave generate`: `EngineConfig`'s settings that have one (those named in
    `skip` left out), and `--kv-offloading-size`; `engine_options` reads them back."""
    for d in settings_of(EngineConfig):
        names = Source(EngineConfig, d).flags
        if names and d.name not in skip:
            p.add_argument(*names, dest=_DEST + d.name, default=None,
                           help=help_text(d.setting.description, d.default),
                           **flag_kind(config_type(d), names[0]))
    p.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="GiB of host memory keeping evicted prefix-cache blocks "
                        "(host_kv_cache_memory_bytes)")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `EngineConfig` fields given on the command line (`add_engine_flags`)."""
    given = given_settings(args)
    if args.kv_offloading_size is not None:
        given["host_kv_cache_memory_bytes"] = int(args.kv_offloading_size * 2**30)
    return given


def _fixed(n: int) -> dict[str, int]:
    return {"min": n, "max": n, "initial": n}


def _pools(args: argparse.Namespace, pools: dict[str, Any]) -> dict[str, Any]:
    if args.num_workers is not None and (args.prefill_workers or args.decode_workers):
        raise ConfigError(f"--num-workers={args.num_workers} (an aggregated pool) cannot be "
                          f"combined with --prefill-workers/--decode-workers")
    if args.num_workers is not None:
        return {"aggregated": {**pools.get("aggregated", {}),
                               "replicas": _fixed(args.num_workers)}}
    out = dict(pools)
    for name, n in (("prefill", args.prefill_workers), ("decode", args.decode_workers)):
        if n is None:
            continue
        out.pop("aggregated", None)
        if n == 0:
            out.pop(name, None)
        else:
            out[name] = {**out.get(name, {}), "replicas": _fixed(n)}
    return out


def _set(node: dict[str, Any], path: list[str], value: Any) -> None:
    for name in path[:-1]:
        node = node.setdefault(name, {})
    node[path[-1]] = value


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The generated flags given on the command line: dotted config path -> value."""
    return {dest[len(_DEST):]: value for dest, value in vars(args).items()
            if dest.startswith(_DEST) and value is not None}


def config_from_args(args: argparse.Namespace) -> CleaveConfig:
    """The config file (or the defaults) with the given flags applied; raises `ConfigError`."""
    base = CleaveConfig.from_yaml(args.config) if args.config else CleaveConfig()
    data = base.to_dict()
    given = given_settings(args)
    keys = list(given.pop("router.api_keys", []))
    keys += [k for k in os.environ.get("CLEAVE_API_KEYS", "").split(",") if k]
    if keys:
        given["router.api_keys"] = keys
    pools = _pools(args, {k: v for k, v in data["pools"].items() if v is not None})
    if args.kv_offloading_size is not None:
        if not args.kv_offloading_size >= 0:
            raise ConfigError(f"--kv-offloading-size must be >= 0 GiB, got "
                              f"{args.kv_offloading_size}")
        given["pools.*.engine.host_kv_cache_memory_bytes"] = int(args.kv_offloading_size * 2**30)
    gpus = None if args.device == "auto" and args.config else _gpus_per_rank(args.device)
    if gpus is not None:
        given["pools.*.gpus_per_rank"] = gpus
    for dotted, value in given.items():
        path = dotted.split(".")
        if path[:2] == ["pools", "*"]:
            for settings in pools.values():
                _set(settings, path[2:], value)
        else:
            _set(data, path, value)
    data["pools"] = pools
    return CleaveConfig.parse(data)


def _gpus_per_rank(device: str) -> float | None:
    """GPUs per rank for `--device` (None: keep the config's)."""
    if device == "cpu":
        return 0.0
    if device == "cuda":
        return 1.0
    import torch

    return 1.0 if torch.cuda.is_available() else None
