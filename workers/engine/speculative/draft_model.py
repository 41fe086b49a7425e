"""A draft model in the engine: a truncated copy of the target (its first layers, then its final
norm and output head), batched over the requests that draft: greedily for greedy requests, by
sampling (temperature, top-k, top-p, min-p as the target samples) for the others.

It shares the target's weights and, for its layers, the target's KV cache: those layers' K/V
at a verified position are the target's own (same weights, same inputs), so the draft needs no
cache of its own and nothing to rebuild after a preemption, a prefix hit or a KV handoff. Its
drafted positions' K/V land in the slots the verification then rewrites (the scheduler counts
none of them as computed until the target has). A draft checkpoint of its own (another model
sharing the tokenizer) drafts on a cache of its own (`workers.engine.speculative.own_cache`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from workers.engine.parallel.messages import StepMessage
from workers.engine.parallel.pipeline import MicroBatch, microbatch_tensors
from workers.engine.request import Request
from workers.engine.sampler import gumbel_draw, position_seed, sampling_probs
from workers.engine.speculative.grammar_draft import DraftWalk
from workers.engine.speculative.rejection import DRAFT_SALT
from workers.models.llama import LlamaForCausalLM, LlamaModel


class ChunkBatch(NamedTuple):
    """A draft's forward over several requests' chunks of positions in one batch."""

    ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: object  # the attention's metadata
    order: list[int]  # the chunks in batch order (single-position ones first)
    ends: list[int]  # each chunk's last row, by chunk index


def chunk_batch(chunks: Sequence[tuple[Sequence[int], Sequence[int]]],
                tables: Sequence[tuple[int, ...]], block_size: int,
                device: torch.device) -> ChunkBatch:
    """The batch of `chunks` ((token ids, their consecutive positions) each, the K/V of those
    positions written through block table `tables[c]`), single-position chunks first as the
    attention expects of decodes (drafts with a cache of their own catch it up this way:
    `quantized_self`, `mtp`)."""
    order = sorted(range(len(chunks)), key=lambda c: len(chunks[c][1]) > 1)
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    loc = [0]
    for c in order:
        tokens, positions = chunks[c]
        ids += tokens
        pos += positions
        slots += [tables[c][p // block_size] * block_size + p % block_size for p in positions]
        loc.append(len(ids))
    msg = StepMessage(
        step_id=0, input_ids=tuple(ids), positions=tuple(pos), slot_mapping=tuple(slots),
        query_start_loc=tuple(loc), seq_lens=tuple(chunks[c][1][-1] + 1 for c in order),
        block_tables=tuple(tables[c] for c in order),
        num_decodes=sum(len(chunks[c][1]) == 1 for c in order), logit_rows=())
    t_ids, t_pos, meta = microbatch_tensors(msg, MicroBatch(0, len(order), 0, len(ids)), device)
    back = {c: loc[r + 1] - 1 for r, c in enumerate(order)}
    return ChunkBatch(t_ids, t_pos, meta, order, [back[c] for c in range(len(chunks))])


class Draft(NamedTuple):
    """A request's drafted tokens; for a sampled request also the distribution each was drawn
    from ([V] each; empty for a greedy one)."""

    tokens: list[int]
    probs: list[torch.Tensor]


class TruncatedDraft:
    """The first `num_layers` layers of `model` (a single-rank Llama-family model whose decoder
    stack is `LlamaModel`'s), reading and writing `caches` (the target's, per layer);
    `generator`: the randomness of unseeded sampled requests' drafts."""

    name = "draft_model"

    def __init__(self, model: LlamaForCausalLM, caches: list[torch.Tensor],
                 device: torch.device, block_size: int, num_layers: int,
                 generator: torch.Generator) -> None:
        stack = model.model
        if type(stack).forward is not LlamaModel.forward or not stack.is_first:
            raise ValueError(f"a truncated draft needs a Llama-style decoder stack on one rank, "
                             f"got {type(model).__name__}")
        if not 1 <= num_layers < len(stack.layer_ids):
            raise ValueError(f"draft_num_layers must be in [1, {len(stack.layer_ids)}), got "
                             f"{num_layers}")
        self.model, self.device, self.block_size = model, device, block_size
        self.layers = list(stack.layers.values())[:num_layers]
        self.caches = caches[:num_layers]
        self.generator = generator
        self._seeded = torch.Generator(device=device)  # reseeded per seeded draw

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, meta: object) -> torch.Tensor:
        """The draft's final-normed hidden states of a step's tokens [T, hidden]."""
        stack = self.model.model
        hidden = stack.embed_tokens(ids)  # [T, hidden]
        if stack.embed_scale is not None:
            hidden = hidden * torch.tensor(stack.embed_scale, dtype=hidden.dtype)
        residual = None
        for layer, cache in zip(self.layers, self.caches):
            hidden, residual = layer(positions, hidden, residual, cache, meta)
        return stack.norm(hidden, residual)[0]

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], ks: Sequence[int],
                tables: Sequence[tuple[int, ...]]) -> list[Draft]:
        """Drafts of `ks[i]` tokens for each decoding request (its last token not yet
        computed), whose block table `tables[i]` has slots up to its last drafted position:
        greedy for a greedy request; a sampled one's drawn from the draft's distribution with
        its temperature and truncation, kept for the verification's rejection sampling; a
        constrained one's under its grammar's mask (`DraftWalk`)."""
        drafts = [Draft([], []) for _ in reqs]
        inputs = [r.all_token_ids[-1] for r in reqs]
        walk = DraftWalk(reqs)  # constrained requests draft under their grammar's mask
        try:
            for j in range(max(ks, default=0)):
                live = [i for i, k in enumerate(ks) if k > j]
                logits = self._step(reqs, live, j, inputs, tables).float()  # [n, V]
                walk.mask(logits, live)
                tokens = logits.argmax(-1)
                rows = [r for r, i in enumerate(live) if not reqs[i].params.greedy]
                if rows:
                    tokens[rows] = self._draw(logits, [reqs[live[r]] for r in rows], rows, j,
                                              drafts, [live[r] for r in rows])
                drawn = tokens.tolist()
                walk.accept(live, drawn)
                for i, token in zip(live, drawn):
                    drafts[i].tokens.append(token)
                    inputs[i] = token
        finally:
            walk.close()
        return drafts

    def _step(self, reqs: Sequence[Request], live: list[int], j: int,
              inputs: list[int], tables: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """The logits [n, V] after the `live` requests' `j`-th drafted position (input
        `inputs[i]`), one token each (a draft with a cache of its own first catches it up:
        `workers.engine.speculative.quantized_self`)."""
        size = self.block_size
        pos = [reqs[i].num_tokens - 1 + j for i in live]
        n = len(live)
        msg = StepMessage(
            step_id=0, input_ids=tuple(inputs[i] for i in live), positions=tuple(pos),
            slot_mapping=tuple(tables[i][p // size] * size + p % size
                               for i, p in zip(live, pos)),
            query_start_loc=tuple(range(n + 1)), seq_lens=tuple(p + 1 for p in pos),
            block_tables=tuple(tables[i] for i in live), num_decodes=n,
            logit_rows=tuple(range(n)))
        ids, positions, meta = microbatch_tensors(msg, MicroBatch(0, n, 0, n), self.device)
        return self.model.compute_logits(self._hidden(ids, positions, meta))

    def _draw(self, logits: torch.Tensor, reqs: list[Request], rows: list[int], j: int,
              drafts: list[Draft], at: list[int]) -> torch.Tensor:
        """Draws for the sampled `reqs` at their `j`-th drafted position from `rows` of
        `logits`; each one's distribution appended to `drafts[at[i]].probs`."""
        _, probs = sampling_probs(logits, [r.params for r in reqs], rows)
        seeds = [None if r.params.seed is None else
                 position_seed(r.params.seed, r.num_output_tokens + j) ^ DRAFT_SALT
                 for r in reqs]
        for i, row in zip(at, probs):
            drafts[i].probs.append(row)
        return gumbel_draw(probs, seeds, self.generator, self._seeded)
