"""Embeddings (`Embed`): whole prompts through the worker's model, each prompt's final hidden
states (the final norm's output, what transformers returns as `last_hidden_state`) pooled into
one vector.

It runs between two engine steps (`AsyncEngine.apply`), as one more forward pass of the loaded
model, over scratch KV blocks of its own (the engine's cache, its blocks and the prefix cache
are not touched; nothing is kept). Prompts are batched up to `max_num_batched_tokens` tokens
per forward pass (a longer prompt alone). A worker whose model is split over ranks (a TP or PP
group) refuses the call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from workers.contract.calls import POOLINGS, Embeddings
from workers.contract.errors import InvalidRequestError
from workers.engine.core import Engine
from workers.engine.parallel.local import LocalExecutor
from workers.engine.parallel.messages import StepMessage
from workers.engine.parallel.pipeline import MicroBatch, microbatch_tensors
from workers.engine.runner import allocate_kv_caches, device_guard


def embed(engine: Engine, token_ids: Sequence[Sequence[int]], pooling: str,
          normalize: bool) -> Embeddings:
    """`Embed` answered on `engine`'s model; call it on the engine's thread, between steps."""
    if pooling not in POOLINGS:
        raise InvalidRequestError(f"pooling must be one of {', '.join(POOLINGS)}, got "
                                  f"{pooling!r}", param="pooling")
    executor = engine.runner.executor
    if not isinstance(executor, LocalExecutor):
        raise InvalidRequestError("embeddings need a worker whose model runs whole in its own "
                                  "process (no tensor or pipeline parallelism)", param="model")
    vectors: list[tuple[float, ...]] = []
    for batch in _batches(token_ids, engine.config.max_num_batched_tokens):
        vectors.extend(_embed_batch(engine, executor, batch, pooling, normalize))
    return Embeddings(tuple(vectors))


def _batches(prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[Sequence[int]]]:
    """`prompts` in order, in batches of at most `max_tokens` tokens (a longer one alone)."""
    out: list[list[Sequence[int]]] = []
    size = max_tokens
    for ids in prompts:
        if not ids:
            raise InvalidRequestError("an input to embed is empty", param="input")
        if size + len(ids) > max_tokens:
            out.append([])
            size = 0
        out[-1].append(ids)
        size += len(ids)
    return out


@torch.inference_mode()
def _embed_batch(engine: Engine, executor: LocalExecutor, prompts: list[Sequence[int]],
                 pooling: str, normalize: bool) -> list[tuple[float, ...]]:
    spec = engine.runner.spec
    block = spec.block_size
    msg = _prefill_message(prompts, block)
    scratch = dataclasses.replace(spec, num_blocks=sum(len(t) for t in msg.block_tables))
    with device_guard(executor.device):
        caches = allocate_kv_caches(scratch, executor.device)
        ids, positions, meta = microbatch_tensors(
            msg, MicroBatch(0, msg.num_seqs, 0, msg.num_tokens), executor.device)
        hidden = executor.model(ids, positions, caches, meta).float()  # [T, hidden]
        pooled = []
        for start, end in zip(msg.query_start_loc, msg.query_start_loc[1:]):
            rows = hidden[start:end]
            pooled.append(rows[-1] if pooling == "last" else rows.mean(dim=0))
        vectors = torch.stack(pooled)  # [num_prompts, hidden]
        if normalize:
            vectors = torch.nn.functional.normalize(vectors, dim=-1)
        return [tuple(v) for v in vectors.cpu().tolist()]


def _prefill_message(prompts: list[Sequence[int]], block: int) -> StepMessage:
    """One step prefilling every prompt whole into scratch blocks numbered from 0."""
    starts, tables, slots = [0], [], list[int]()
    next_block = 0
    for ids in prompts:
        n = -(-len(ids) // block)
        tables.append(tuple(range(next_block, next_block + n)))
        slots.extend(next_block * block + j for j in range(len(ids)))
        next_block += n
        starts.append(starts[-1] + len(ids))
    return StepMessage(
        step_id=-1, input_ids=tuple(t for ids in prompts for t in ids),
        positions=tuple(j for ids in prompts for j in range(len(ids))),
        slot_mapping=tuple(slots), query_start_loc=tuple(starts),
        seq_lens=tuple(len(ids) for ids in prompts), block_tables=tuple(tables),
        num_decodes=0, logit_rows=())
