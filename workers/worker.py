"""A worker: one engine behind an asyncio face, serving one role in the cluster.

Importing this module does not import torch; building a `Worker` does (it builds an engine). The
router reaches a worker through `router.worker_client.WorkerClient` (in process:
`router.inprocess.InProcessWorkerClient`), never by calling the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator

from workers.protocol import KVEvent, KVSnapshot, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from workers.async_engine import AsyncEngine
    from workers.config import EngineConfig
    from workers.engine import EngineStats

# "both": prefill and decode here (aggregated). "prefill" and "decode" join with the KV handoff.
ROLES = ("both",)


class Worker:
    """One engine serving requests for the router. Owns the engine: `shutdown()` stops it."""

    def __init__(self, worker_id: str, engine: AsyncEngine, role: str = "both") -> None:
        if role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {role!r}")
        self.worker_id = worker_id
        self.role = role
        self.async_engine = engine
        self.engine = engine.engine

    @classmethod
    def from_config(cls, worker_id: str, config: EngineConfig, role: str = "both") -> Worker:
        from workers.async_engine import AsyncEngine

        return cls(worker_id, AsyncEngine.from_config(config), role)

    @property
    def block_size(self) -> int:
        return self.engine.config.block_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def num_blocks(self) -> int:
        return self.engine.kv.pool.num_blocks

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 cache_salt: str | None = None) -> AsyncIterator[TokenEvent]:
        """Token events of the request; leaving the iteration early aborts it (see AsyncEngine)."""
        return self.async_engine.generate(prompt_token_ids, params, request_id,
                                          cache_salt=cache_salt)

    def abort(self, request_id: str) -> None:
        self.async_engine.abort(request_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def drain_kv_events(self) -> list[KVEvent]:
        return await self.async_engine.run_between_steps(self.engine.drain_kv_events)

    async def kv_snapshot(self) -> KVSnapshot:
        return await self.async_engine.run_between_steps(self.engine.kv_snapshot)

    async def shutdown(self) -> None:
        await self.async_engine.shutdown()
