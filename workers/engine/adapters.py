"""The engine's LoRA adapters (`EngineConfig.enable_lora`): which are loaded, loading and
unloading them between steps, and refusing requests for adapters it does not have.

The model's side (PEFT folders, the device slots, the per-segment products) is
`workers.models.lora`, held by the executor (`AdapterStore`: the model in this process, or
every tensor-parallel rank its shard, loaded and unloaded by a message to each); the scheduler
keeps each step within `max_loras` adapters (`scheduler_records.adapter_fits`), and the runner
asks the slot table for each step's slots and the copies it needs (`ModelRunner._prepare`).
An engine without adapters has `NoAdapters`, which refuses any request naming one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from workers.contract.protocol import InvalidRequestError
from workers.engine.parallel.executor import GroupExecutor
from workers.engine.parallel.local import LocalExecutor
from workers.models.lora import AdapterSlots, LoraAdapterError, SlotTable

if TYPE_CHECKING:
    from workers.engine.config import EngineConfig
    from workers.engine.request import Request
    from workers.engine.runner import ModelRunner
    from workers.engine.scheduler import Scheduler
    from workers.models.llama import LlamaForCausalLM

__all__ = ["Adapters", "LoraAdapterError", "NoAdapters", "attach_adapters"]


class NoAdapters:
    """An engine that serves the base model only."""

    max_loras = 0  # the scheduler's bound on a step's adapters; 0: none

    def check(self, lora_name: str | None) -> None:
        """Raises `InvalidRequestError` (param `model`) unless `lora_name` is None."""
        if lora_name is not None:
            raise InvalidRequestError(f"The model `{lora_name}` does not exist: this worker "
                                      "serves no LoRA adapters (enable_lora)", param="model")

    def names(self) -> list[str]:
        return []

    def paths(self) -> dict[str, str]:
        return {}

    def resident(self) -> tuple[str, ...]:
        """The adapters in the device slots now, least recently used first (its load
        report's `lora_adapters`: the router routes by them)."""
        return ()

    def num_loads(self) -> int:
        """Adapters copied into a device slot since start (`SlotTable.num_loads`)."""
        return 0

    def cache_name(self, lora_name: str | None) -> str | None:
        """What the prefix cache keys `lora_name`'s blocks by (`Adapters.cache_name`)."""
        return lora_name

    def folder_of(self, name: str) -> str:
        """The folder a load on demand reads adapter `name` from: `<lora_dir>/<name>`.
        KeyError when there is none (no `lora_dir`, no such sub-folder, or a name that is not
        one folder's name)."""
        raise KeyError(f"adapter {name!r} is not loaded and this worker loads none on demand "
                       "(enable_lora, lora_dir)")

    def load(self, name: str, path: str) -> None:
        raise LoraAdapterError(f"cannot load adapter {name!r}: this worker serves no LoRA "
                               "adapters (start it with enable_lora)")

    def unload(self, name: str, running: Iterable[Request]) -> None:
        raise KeyError(f"adapter {name!r} is not loaded (this worker serves none)")


class AdapterStore(Protocol):
    """Where the adapters' weights are kept and copied into slots: the engine's executor
    (`LocalExecutor`: the model here; `GroupExecutor`: each rank its shard)."""

    def load_adapter(self, name: str, path: str) -> None:
        """Keeps the PEFT adapter at `path` as `name`; `LoraAdapterError`, nothing kept."""

    def unload_adapter(self, name: str) -> None:
        """Forgets adapter `name`."""


class Adapters(NoAdapters):
    """The adapters of an engine with LoRA: their weights kept by `store` (on the host of
    whatever holds the model), up to `max_loras` of them in the model's device slots, which
    `table` assigns (the runner sends each step's copies). Call between steps, on the step's
    thread."""

    def __init__(self, store: AdapterStore, table: SlotTable,
                 lora_dir: str | None = None) -> None:
        """`lora_dir`: the folder of adapter folders loads on demand read (`folder_of`)."""
        self.store, self.slots, self.lora_dir = store, table, lora_dir
        self.max_loras = table.max_loras
        self._paths: dict[str, str] = {}  # adapter name -> the folder it was loaded from
        self._loads: dict[str, int] = {}  # adapter name -> times loaded (`cache_name`)

    def check(self, lora_name: str | None) -> None:
        if lora_name is not None and lora_name not in self._paths:
            raise InvalidRequestError(
                f"The model `{lora_name}` does not exist: no LoRA adapter of that name is "
                f"loaded (loaded: {self.names()})", param="model")

    def names(self) -> list[str]:
        return sorted(self._paths)

    def resident(self) -> tuple[str, ...]:
        return tuple(self.slots.resident())

    def num_loads(self) -> int:
        return self.slots.num_loads

    def cache_name(self, lora_name: str | None) -> str | None:
        """What the prefix cache keys `lora_name`'s blocks by: its name, and from its second
        load on the load's number, so blocks cached under weights since unloaded never hit
        (the router's index keys by name only: after a reload its predictions for that
        adapter miss, never the KV)."""
        loads = self._loads.get(lora_name, 0) if lora_name is not None else 0
        return lora_name if loads <= 1 else f"{lora_name}#{loads}"

    def paths(self) -> dict[str, str]:
        """Adapter name -> the folder it was loaded from."""
        return dict(self._paths)

    def folder_of(self, name: str) -> str:
        if self.lora_dir is None:
            return super().folder_of(name)
        folder = Path(self.lora_dir) / name
        if name in ("", ".", "..") or Path(name).name != name or not folder.is_dir():
            raise KeyError(f"adapter {name!r} is not loaded and {self.lora_dir} (lora_dir) "
                           "has no folder of that name")
        return str(folder)

    def load(self, name: str, path: str) -> None:
        """Read and keep the PEFT adapter at `path` as `name`. `LoraAdapterError` naming what is
        wrong (and nothing kept) for a bad one or a name already loaded."""
        if not name:
            raise LoraAdapterError(f"an adapter needs a name, got {name!r}")
        if name in self._paths:
            raise LoraAdapterError(f"adapter {name!r} is already loaded (from "
                                   f"{self._paths[name]}); unload it first")
        self.store.load_adapter(name, path)
        self._paths[name] = str(Path(path))
        self._loads[name] = self._loads.get(name, 0) + 1

    def unload(self, name: str, running: Iterable[Request]) -> None:
        """Forget adapter `name`. KeyError when it is not loaded; `LoraAdapterError` while
        requests of `running` (the engine's unfinished ones) still use it."""
        if name not in self._paths:
            raise KeyError(f"adapter {name!r} is not loaded")
        users = [r.request_id for r in running if r.lora_name == name]
        if users:
            raise LoraAdapterError(f"adapter {name!r} is in use by {len(users)} request(s) "
                                   f"({users[:3]}); unload it once they finish")
        self.store.unload_adapter(name)
        self.slots.drop(name)
        del self._paths[name]


def attach_adapters(config: EngineConfig, model: LlamaForCausalLM | None,
                    runner: ModelRunner, scheduler: Scheduler) -> NoAdapters:
    """The engine's adapters: `NoAdapters` unless `config.enable_lora`; else the model's
    projections hooked (here, or on each rank of a group, which hooked its shard at start),
    the runner given the slot table, the scheduler its bound on a step's adapters, and
    `config.lora_modules` loaded (a bad one fails the start)."""
    if not config.enable_lora:
        return NoAdapters()
    executor = runner.executor
    store: AdapterStore
    if isinstance(executor, LocalExecutor):
        if model is None:
            raise ValueError("LoRA adapters need the engine's model (or a worker group)")
        executor.lora = AdapterSlots(model, config.max_loras, config.max_lora_rank)
        store = executor
    elif isinstance(executor, GroupExecutor):
        store = executor
    else:
        raise ValueError(f"LoRA adapters are not served by a {type(executor).__name__}")
    runner.adapters = SlotTable(config.max_loras)
    scheduler.config = dataclasses.replace(scheduler.config, max_loras=config.max_loras)
    adapters = Adapters(store, runner.adapters, config.lora_dir)
    for name, path in config.lora_paths.items():
        adapters.load(name, path)
    return adapters
