"""Where an embedding request runs: one worker of the prefill pool (the aggregated pool where
there is none), chosen by the routing policy on the first input's blocks as a prompt is, asked
with one `Embed` call (no decode, no handoff). A worker that does not answer is marked
unhealthy and the call goes to another (`RouterConfig.start_retries` more). What both front
ends do before: `router.embedding_inputs`. Torch-free."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from router.errors import BadRequestError, NoHealthyWorkerError, WorkerUnavailableError
from router.failover import DECODE_POOL
from router.orchestrator import PREFILL_POOL
from router.policy import NoHealthyWorker, RoutingPolicy
from router.workers import WorkerSet
from workers.contract.calls import Embed, Embeddings
from workers.contract.prefix_cache import hash_prompt_blocks
from workers.contract.protocol import InvalidRequestError

logger = logging.getLogger(__name__)


class Embedder:
    def __init__(self, workers: WorkerSet, policy: RoutingPolicy, retries: int) -> None:
        self.workers, self.policy, self.retries = workers, policy, retries

    async def embed(self, token_ids: Sequence[Sequence[int]], pooling: str,
                    normalize: bool) -> Embeddings:
        """The inputs' pooled vectors, in order. Raises `BadRequestError` (the worker refused
        the call) or `NoHealthyWorkerError`."""
        w = self.workers
        loads = w.pool_loads(*PREFILL_POOL) or w.pool_loads(*DECODE_POOL)
        hashes = hash_prompt_blocks(token_ids[0], w.any_info.block_size, None)
        call = Embed(tuple(tuple(ids) for ids in token_ids), pooling, normalize)
        tried: set[str] = set()
        for _ in range(1 + self.retries):
            try:
                wid = self.policy.choose(hashes, loads.without(tried), w.index).worker_id
            except NoHealthyWorker as exc:
                raise NoHealthyWorkerError(f"no healthy worker can embed: {exc}") from None
            try:
                return await w.clients[wid].call(call)
            except InvalidRequestError as exc:
                raise BadRequestError(exc.message, param=exc.param) from None
            except WorkerUnavailableError as exc:
                logger.warning("embedding on %s failed: %r", wid, exc)
                w.mark_unhealthy(wid)
                tried.add(wid)
        raise NoHealthyWorkerError(f"no worker answered the embedding call (tried "
                                   f"{', '.join(sorted(tried))})")
