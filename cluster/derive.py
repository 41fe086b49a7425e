"""The cluster config's fields derived from the settings' one definition.

A setting the router, the engine or a worker runs with is defined once, on its record's field
(`workers.contract.setting`): default, description, bounds, choices, where the cluster config
holds it and its flag. `derived(section)` adds every such field of `RECORDS` whose section is
`section` to a pydantic model of the cluster config; `record_kwargs` reads them back into the
record. Nothing here names a setting: a field added to a record reaches the cluster config, its
flags (`cluster.flags`) and the chart's schema by itself.

Shapes change only where YAML needs it: a tuple is a list, a tuple of (name, value) pairs is a
mapping (`policy_options` -> `policy_weights: {w_hit: 2}`), choices are an enum. A setting whose
default depends on where the deployment runs (`MODE_DEFAULTS`) is optional in the config.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, Field, create_model

from router.config import RouterConfig
from workers.contract.setting import Defined, settings_of
from workers.engine.config import EngineConfig
from workers.serving.options import WorkerOptions

# each record's home section of the cluster config (a field's `section` may name another)
RECORDS: dict[type, str] = {RouterConfig: "router", EngineConfig: "engine",
                            WorkerOptions: "kv_transfer"}
# on Ray, how long a stream whose decode worker died waits for another by default: Serve
# replaces a pool's lost replica, and a replica loads its model within this
RAY_MIGRATION_WAIT_S = 120.0
# settings whose default depends on the mode: name -> (mode -> default; other modes: the
# record's), and why
MODE_DEFAULTS: dict[str, tuple[dict[str, Any], str]] = {
    "migration_wait_s": ({"ray": RAY_MIGRATION_WAIT_S},
                         ("on Ray a pool that lost its only replica gets it replaced; in "
                          "process nothing replaces a dead worker")),
}


@dataclass(frozen=True)
class Source:
    """Annotated metadata of a derived field: the record field it comes from."""

    record: type
    defined: Defined

    @property
    def flags(self) -> tuple[str, ...]:
        names = self.defined.setting.flag
        if names is None:
            return ()
        return names or (f"--{self.defined.name.replace('_', '-')}",)


@dataclass(frozen=True)
class Flag:
    """Annotated metadata giving a cluster-only field (ports, host) a flag."""

    names: tuple[str, ...]


def flag(*names: str) -> Flag:
    return Flag(names)


def _optional(kind: Any) -> tuple[Any, bool]:
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(kind))
    return kind, False


def config_type(d: Defined) -> Any:
    kind, optional = _optional(d.type)
    if d.setting.choices is not None:
        kind = Literal[d.setting.choices]
    elif typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        # (name, value) pairs become a dict, other items a list (`dict[k, v]`, `list[item]`)
        kind = (types.GenericAlias(dict, typing.get_args(item)) if typing.get_origin(item) is tuple
                else types.GenericAlias(list, (item,)))
    optional = optional or d.name in MODE_DEFAULTS
    return kind | None if optional else kind


def _field(record: type, d: Defined) -> tuple[Any, Any]:
    s = d.setting
    description, default = s.description, d.default
    if d.name in MODE_DEFAULTS:
        modes, why = MODE_DEFAULTS[d.name]
        where = ", ".join(f"{v:g} on {m.replace('ray', 'Ray')}" for m, v in modes.items())
        description += f" Unset: {where}, {default:g} in process ({why})."
        default = None
    bounds: dict[str, Any] = {k: v for k, v in (("ge", s.ge), ("gt", s.gt), ("le", s.le),
                                                 ("lt", s.lt)) if v is not None}
    kind = config_type(d)
    shape = typing.get_origin(_optional(kind)[0])
    if shape in (list, dict):  # a fresh list or mapping per config, of the record's default
        info = Field(default_factory=functools.partial(shape, default), description=description)
    else:
        info = Field(default, description=description, **bounds)
    return Annotated[kind, Source(record, d)], info


def to_record(value: Any) -> Any:
    """A cluster config's value as the record holds it."""
    if isinstance(value, dict):
        return tuple(sorted(value.items()))
    if isinstance(value, list):
        return tuple(value)
    return value


def derived_settings(section: str) -> list[tuple[type, Defined]]:
    """The record fields the cluster config holds in `section`, in `RECORDS` order."""
    out = []
    for record, home in RECORDS.items():
        for d in settings_of(record):
            where = home if d.setting.section == "" else d.setting.section
            if where == section:
                out.append((record, d))
    return out


M = TypeVar("M", bound=BaseModel)


def derived(section: str) -> Callable[[type[M]], type[M]]:
    """A class decorator: the model with the fields of `section` (`derived_settings`) added
    after its own. Its validators may read them."""
    def build(cls: type[M]) -> type[M]:
        fields = {d.setting.key or d.name: _field(record, d)
                  for record, d in derived_settings(section)}
        return create_model(  # type: ignore[call-overload]  # fields made at run time
            cls.__name__, __base__=cls, __module__=cls.__module__, __doc__=cls.__doc__,
            **fields)
    return build


def record_kwargs(record: type, sections: dict[str, Any], mode: str = "") -> dict[str, Any]:
    """The keyword arguments of `record` that the cluster config holds, read from `sections`
    (section name -> its model instance), with `mode`'s default for a setting left unset."""
    home = RECORDS[record]
    out = {}
    for d in settings_of(record):
        where = home if d.setting.section == "" else d.setting.section
        if where is None:
            continue
        value = getattr(sections[where], d.setting.key or d.name)
        if value is None and d.name in MODE_DEFAULTS:
            value = MODE_DEFAULTS[d.name][0].get(mode, d.default)
        out[d.name] = to_record(value)
    return out
