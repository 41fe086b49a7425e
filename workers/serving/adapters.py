"""A worker's LoRA adapters as the router's calls reach them (`LoadLoraAdapter`,
`UnloadLoraAdapter`, `LoraAdapters`): each runs between two engine steps on the engine's
adapters (`workers.engine.adapters`), so no step sees an adapter half loaded or gone under it.
No torch at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.engine.async_engine import AsyncEngine


class WorkerAdapters:
    """Loads and unloads the engine's adapters between steps; each answers the adapters loaded
    after it, sorted."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.async_engine = engine

    async def load(self, lora_name: str, lora_path: str | None) -> tuple[str, ...]:
        """Raises `LoraAdapterError` (a `ValueError`) naming what is wrong; nothing kept.
        `lora_path` None: on demand, from `lora_dir` (`LoadLoraAdapter`): a name already
        loaded is kept, `KeyError` when `lora_dir` has no such folder."""
        engine = self.async_engine.engine

        def load() -> tuple[str, ...]:
            adapters = engine.adapters
            if lora_path is not None:
                adapters.load(lora_name, lora_path)
            elif lora_name not in adapters.names():
                folder = adapters.folder_of(lora_name)
                try:
                    adapters.load(lora_name, folder)
                except ValueError as exc:  # named with the folder the request led to
                    raise type(exc)(f"{exc} (loading it on demand from {folder})") from None
            return tuple(adapters.names())
        return await self.async_engine.apply(load)

    async def unload(self, lora_name: str) -> tuple[str, ...]:
        """Raises `KeyError` for an adapter not loaded, `LoraAdapterError` while a request
        here (waiting, running, or waiting for its KV) still runs under it."""
        engine = self.async_engine.engine

        def unload() -> tuple[str, ...]:
            s = engine.scheduler
            engine.adapters.unload(lora_name, [*s.waiting, *s.running,
                                               *s.waiting_for_kv.values()])
            return tuple(engine.adapters.names())
        return await self.async_engine.apply(unload)

    def paths(self) -> dict[str, str]:
        """Each loaded adapter's name -> the folder it was read from."""
        return self.async_engine.engine.adapters.paths()
