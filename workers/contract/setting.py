"""One definition per setting: its default, its description and its bounds, written once on the
field of the frozen record that runs with it (`router.config.RouterConfig`,
`workers.engine.config.EngineConfig`, `workers.serving.options.WorkerOptions`):

    max_n: int = setting(16, "Samples per request at most.", ge=1)

What users write is derived from these fields: the cluster config's pydantic models
(`cluster.config`), the `cleave serve` and `cleave generate` flags (`cluster.flags`) and the Helm
chart's `values.schema.json` (`deploy/helm/cleave/tools/gen_docs.py`). A field added to a record
reaches all three with nothing else written. Torch-free: the router imports it.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

_KEY = "setting"  # the `dataclasses.field` metadata key holding a field's `Setting`


@dataclass(frozen=True)
class Setting:
    """What a setting's field carries besides its default and its type."""

    description: str  # one or two sentences a user reads in `--help` and the chart's schema
    ge: float | None = None  # bounds; None: unbounded (a value of None always passes)
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] | None = None  # the values allowed; None: any of the type
    # the section of the cluster config holding it ("model", "router", "pool", "engine",
    # "kv_transfer"); "": the record's own section (`cluster.config.derived` names it); None:
    # not in the cluster config (the cluster sets it itself, e.g. the device or the model path)
    section: str | None = ""
    key: str | None = None  # its name in the cluster config when not the field's
    # the CLI flag and its aliases; (): `--field-name`; None: no flag
    flag: tuple[str, ...] | None = ()

    def __post_init__(self) -> None:
        if not self.description.strip():
            raise ValueError("a setting needs a description (it is its --help line)")

    def violation(self, name: str, value: Any) -> str | None:
        """Why `value` is not allowed for the setting `name`, or None."""
        if value is None:
            return None
        if self.choices is not None and value not in self.choices:
            return f"{name} must be one of {self.choices}, got {value!r}"
        low, opening = (self.ge, "[") if self.gt is None else (self.gt, "(")
        top, close = (self.le, "]") if self.lt is None else (self.lt, ")")
        if ((low is not None and (value < low or (self.gt is not None and value == low)))
                or (top is not None and (value > top or (self.lt is not None and value == top)))):
            if low is not None and top is not None:
                return f"{name} must be in {opening}{low:g}, {top:g}{close}, got {value}"
            if low is not None:
                words = "at least" if self.gt is None else "greater than"
                return f"{name} must be {words} {low:g}, got {value}"
            words = "at most" if self.lt is None else "less than"
            return f"{name} must be {words} {top:g}, got {value}"
        return None


def setting(default: Any = dataclasses.MISSING, description: str = "", *,
            default_factory: Any = dataclasses.MISSING, **meta: Any) -> Any:
    """A dataclass field defining one setting; `meta`: `Setting`'s other fields."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={_KEY: Setting(description, **meta)})


@dataclass(frozen=True)
class Defined:
    """One field of a record, as its definition says."""

    name: str
    type: Any  # the resolved annotation
    setting: Setting
    default: Any  # dataclasses.MISSING: required

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING


def settings_of(record: type) -> list[Defined]:
    """Every field of the dataclass `record`, in order; raises `TypeError` naming a field
    defined without `setting(...)` (a setting with no description)."""
    hints = typing.get_type_hints(record)
    out = []
    for f in dataclasses.fields(record):
        s = f.metadata.get(_KEY)
        if s is None:
            raise TypeError(f"{record.__name__}.{f.name} is not defined with setting(...): it "
                            f"has no description or bounds")
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        out.append(Defined(f.name, hints[f.name], s, default))
    return out


def check_settings(obj: Any) -> None:
    """Raise `ValueError` naming the first field of `obj` outside its definition's bounds or
    choices (for a record's `__post_init__`)."""
    for f in dataclasses.fields(obj):
        s = f.metadata.get(_KEY)
        problem = s.violation(f.name, getattr(obj, f.name)) if s is not None else None
        if problem is not None:
            raise ValueError(problem)
