"""Embedding requests, as both front ends answer them (`embed_inputs`: tokenized, checked,
admitted, pooled as the request or the model says), and where one runs: one worker of the
prefill pool (the aggregated pool where there is none), chosen by the routing policy on the
first input's blocks as a prompt is, asked with one `Embed` call (no decode, no handoff). A
worker that does not answer is marked unhealthy and the call goes to another
(`RouterConfig.start_retries` more). Torch-free."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from router.errors import BadRequestError, NoHealthyWorkerError, WorkerUnavailableError
from router.failover import DECODE_POOL
from router.orchestrator import PREFILL_POOL
from router.policy import NoHealthyWorker, RoutingPolicy
from router.workers import WorkerSet
from workers.contract.calls import Embed, Embeddings
from workers.contract.prefix_cache import hash_prompt_blocks
from workers.contract.protocol import InvalidRequestError

if TYPE_CHECKING:
    from router.app import Router

logger = logging.getLogger(__name__)


def model_pooling(model_path: str) -> str:
    """The model folder's sentence-transformers pooling (`1_Pooling/config.json`: `last` or
    `mean`), else `last`, as vLLM pools a causal LM."""
    config = Path(model_path) / "1_Pooling" / "config.json"
    if not config.is_file():
        return "last"
    modes = json.loads(config.read_text())
    return "mean" if modes.get("pooling_mode_mean_tokens") else "last"


async def embed_inputs(router: Router, inputs: Sequence[str | Sequence[int]],
                       pooling: str | None, normalize: bool
                       ) -> tuple[tuple[tuple[float, ...], ...], int]:
    """The inputs' vectors, in order, and their prompt tokens in all. Raises
    `BadRequestError` naming `input` (empty, too many, too long, ids outside the vocabulary)
    or `pooling`, `OverloadedError`, `NoHealthyWorkerError`."""
    if not inputs:
        raise BadRequestError("input must not be empty", param="input")
    if len(inputs) > router.config.max_prompts_per_request:
        raise BadRequestError(f"at most {router.config.max_prompts_per_request} inputs per "
                              f"request, got {len(inputs)}", param="input")
    with router.admit():
        token_ids = [await router.tokenize_async(x) if isinstance(x, str) else list(x)
                     for x in inputs]
        for ids in token_ids:
            router.check_prompt(ids, param="input")
        found = await router.embed(token_ids, pooling or model_pooling(router.config.model_path),
                                   normalize)
    return found.vectors, sum(len(ids) for ids in token_ids)


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
