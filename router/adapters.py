"""The LoRA adapters a router serves as model names (a request's `model` selects one), and
loading and unloading them on every worker at run time (`POST /v1/load_lora_adapter`,
`/v1/unload_lora_adapter`). Torch-free.

The workers own their adapters; this list is the router's copy, read from the workers at start
and after each load or unload made through this router. With several router replicas a load or
unload reaches every worker through the replica that took it, and the other replicas catch up
as requests ask: a name this copy does not know is looked up on a worker before it is refused,
and a worker's refusal of a name this copy still lists drops it here (`forget`). A worker that
joins later (a replica the autoscaler started) is given the adapters the others serve before it
is routed to (`join`): the adapters named in the configuration it loads itself, the ones loaded
at run time it would not have.

On demand: a request naming an adapter no worker serves has every worker load it from its
`lora_dir` (`EngineConfig.lora_dir`, a folder of adapter folders by name) before it runs
(`resolve`), all or none as a run-time load; concurrent requests for the same name share one
load. Every worker, not only the one the request lands on: the host copy is small (a rank's
rows per projection) and the scarce device slots are still filled only where requests under it
run (`router.residency`), while "a served adapter is on every worker" keeps the handoff's decode
worker, a migration's or failover's target and a drain's receivers able to continue it. A decode
worker found without the adapter anyway (restarted, or joined while another router replica
loaded it) is given it before its handoff (`supply`).
"""

from __future__ import annotations

import asyncio
import logging

from router.errors import BadRequestError, NotFoundError, WorkerUnavailableError
from router.workers import WorkerSet
from router.worker_client import WorkerClient
from workers.contract.calls import LoadLoraAdapter, LoraAdapters, UnloadLoraAdapter

log = logging.getLogger(__name__)


class ServedAdapters:
    """The adapter names this router routes (sorted in `names`). Event-loop thread only."""

    def __init__(self, workers: WorkerSet, base: str) -> None:
        self.workers = workers
        self.base = base  # the base model's served name
        self._names: set[str] = set()
        self._loading: dict[str, asyncio.Future[None]] = {}  # name -> its load on demand

    @property
    def names(self) -> list[str]:
        return sorted(self._names)

    async def refresh(self) -> None:
        """Re-read the list from the workers: the adapters every reachable worker has (a
        request may land on any of them)."""
        answers = await asyncio.gather(
            *(c.call(LoraAdapters()) for c in self.workers.clients.values()),
            return_exceptions=True)
        lists = [set(a) for a in answers if not isinstance(a, BaseException)]
        self._names = set.intersection(*lists) if lists else set()

    async def join(self, client: WorkerClient) -> None:
        """Load onto a worker about to be routed to the adapters every routed worker serves
        and it lacks, from the folders they were read from. One it cannot load (no
        `enable_lora`, a folder it cannot reach) is logged; requests naming that adapter then
        keep to the workers that have it (`refresh` lists only what all of them serve)."""
        answers = await asyncio.gather(
            *(c.call(LoraAdapters()) for c in self.workers.clients.values()),
            return_exceptions=True)
        held = [a for a in answers if isinstance(a, dict)]
        if not held:
            return
        served = {name: held[0][name] for name in set.intersection(*(set(h) for h in held))}
        try:
            have = await client.call(LoraAdapters())
        except WorkerUnavailableError:  # adding it marks it unhealthy
            return
        for name, path in sorted(served.items()):
            if name in have:
                continue
            try:
                await client.call(LoadLoraAdapter(name, path))
            except ValueError as exc:
                log.warning("worker %s joins without LoRA adapter %r: %s", client.worker_id,
                            name, exc)

    async def resolve(self, model: str | None) -> str | None:
        """The adapter a request's `model` names (None: the base model, named or not at all),
        loaded on demand from the workers' `lora_dir` when none serves it yet (one load for
        concurrent requests). Raises `NotFoundError` (404, param `model`) for a name no worker
        serves nor finds there, `BadRequestError` (400) naming what is wrong with its folder."""
        if model is None or model == self.base:
            return None
        if model not in self._names:
            await self.refresh()
        if model not in self._names:
            loading = self._loading.get(model)
            if loading is None:
                loading = self._loading[model] = asyncio.ensure_future(self._load_on_demand(model))
                loading.add_done_callback(self._loaded)
            await asyncio.shield(loading)
        return model

    def _loaded(self, loading: asyncio.Future[None]) -> None:
        """A load on demand ended: the next request for a name it failed on tries again."""
        for name in [n for n, f in self._loading.items() if f is loading]:
            del self._loading[name]
        if not loading.cancelled():
            loading.exception()  # retrieved: its requests (if still waiting) raise it

    async def _load_on_demand(self, name: str) -> None:
        try:
            await self._load_everywhere(LoadLoraAdapter(name), "model")
        except KeyError:  # no folder of that name on some worker (or no `lora_dir`)
            raise NotFoundError(f"The model `{name}` does not exist; this server serves "
                                f"`{self.base}` and the LoRA adapters {self.names}",
                                param="model") from None

    async def supply(self, client: WorkerClient, name: str) -> None:
        """Make sure worker `client` has adapter `name` before a request under it is sent
        there (a handoff's decode worker): asked, and when it lacks it, given it from the
        folder the other workers read it from (else its own `lora_dir`). Never raises for a
        worker that cannot: logged, and the worker refuses the request as it would have."""
        try:
            if name in await client.call(LoraAdapters()):
                return
            held = await asyncio.gather(
                *(c.call(LoraAdapters()) for c in self.workers.clients.values()),
                return_exceptions=True)
            path = next((h[name] for h in held if isinstance(h, dict) and name in h), None)
            await client.call(LoadLoraAdapter(name, path))
            log.info("worker %s lacked LoRA adapter %r; loaded it from %s", client.worker_id,
                     name, path or "its lora_dir")
        except (KeyError, ValueError, WorkerUnavailableError) as exc:
            log.warning("worker %s is without LoRA adapter %r: %s", client.worker_id, name, exc)

    def lora_of(self, model: str | None) -> str | None:
        """The adapter a request's `model` (checked by `resolve`) runs under; None: base."""
        return None if model is None or model == self.base else model

    def forget(self, name: str) -> None:
        """A worker refused `name` as unknown: another router replica unloaded it."""
        self._names.discard(name)

    async def load(self, name: str, path: str) -> None:
        """Load the adapter at `path` as `name` on every worker, or on none: a worker that
        refuses it (`BadRequestError` 400 naming why: a bad folder, a rank over
        `max_lora_rank`, no `enable_lora`) has the others unload it again."""
        if not name or not path:
            raise BadRequestError(f"lora_name and lora_path must both be given, got "
                                  f"lora_name={name!r}, lora_path={path!r}",
                                  param="lora_name" if not name else "lora_path")
        await self.refresh()
        if name in self._names:
            raise BadRequestError(f"The LoRA adapter `{name}` is already loaded; unload it "
                                  f"first", param="lora_name")
        await self._load_everywhere(LoadLoraAdapter(name, path), "lora_path")

    async def _load_everywhere(self, load: LoadLoraAdapter, param: str) -> None:
        """`load` on every worker, or on none (the others unload it again): a refusal raised
        as the client's error on `param` (`_refusal`; a missing folder's `KeyError` as is)."""
        clients = list(self.workers.clients.values())
        answers = await asyncio.gather(*(c.call(load) for c in clients), return_exceptions=True)
        failed = [a for a in answers if isinstance(a, BaseException)]
        if failed:
            loaded = [c for c, a in zip(clients, answers) if not isinstance(a, BaseException)]
            await asyncio.gather(*(c.call(UnloadLoraAdapter(load.lora_name)) for c in loaded),
                                 return_exceptions=True)
            raise _refusal(failed[0], param)
        self._names.add(load.lora_name)

    async def unload(self, name: str) -> None:
        """Unload `name` from every worker, or from none. `NotFoundError` (404) when no worker
        has it; `BadRequestError` (400) while requests still run under it on some worker (the
        workers that had dropped it load it again from its folder)."""
        clients = list(self.workers.clients.values())
        held = await asyncio.gather(*(c.call(LoraAdapters()) for c in clients),
                                    return_exceptions=True)
        path = next((h[name] for h in held if isinstance(h, dict) and name in h), None)
        answers = await asyncio.gather(*(c.call(UnloadLoraAdapter(name)) for c in clients),
                                       return_exceptions=True)
        missing = [a for a in answers if isinstance(a, KeyError)]
        failed = [a for a in answers if isinstance(a, BaseException) and a not in missing]
        if failed:
            dropped = [c for c, a in zip(clients, answers) if not isinstance(a, BaseException)]
            if path is not None:
                await asyncio.gather(*(c.call(LoadLoraAdapter(name, path)) for c in dropped),
                                     return_exceptions=True)
            raise _refusal(failed[0], "lora_name")
        self._names.discard(name)
        if len(missing) == len(answers):
            raise NotFoundError(f"The LoRA adapter `{name}` is not loaded (loaded: "
                                f"{self.names})", param="lora_name")


def _refusal(exc: BaseException, param: str) -> Exception:
    """A worker's refusal as the client's error; an unreachable worker or a crash as is."""
    if isinstance(exc, ValueError):
        return BadRequestError(str(exc), param=param)
    if isinstance(exc, Exception):  # `WorkerUnavailableError`, a missing folder's `KeyError`,
        # or a crash: the log has it
        return exc
    raise exc  # a cancel
