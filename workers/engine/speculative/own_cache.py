"""A draft model on a KV cache of its own: the quantized self-draft (the target's int4 copy) and
a draft checkpoint (another model sharing the target's tokenizer) draft this way.

Their K/V differ from the target's (other weights), so each keeps a cache of its own: one
tensor per layer of the draft's shape, with the target's number of blocks, addressed by the
target's block tables (a request's draft K/V sit in the same block ids of the draft's cache).
`OwnCacheDraft` remembers per request how many leading positions of its cache are valid
(written by the draft with the tokens the request now has) and, before drafting, runs the
missing ones in one prefill-style chunk: the whole prompt the first time (also after a KV
handoff, a migration or a preemption), else the last verified token (and the last drafted one
when all of a draft was accepted).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.engine.request import Request
from workers.engine.speculative.draft_model import Draft, TruncatedDraft, chunk_batch
from workers.models.llama import LlamaForCausalLM


@dataclass
class _Written:
    positions: int  # leading positions of the request's draft cache written with its tokens
    preemptions: int  # the request's preemption count then (a preemption frees its blocks)


class OwnCacheDraft(TruncatedDraft):
    """Drafts with `model` (all its layers; its vocabulary the target's) over `caches` (its
    own, per layer); see the module docstring. `name`: the method, as metrics count it."""

    def __init__(self, model: LlamaForCausalLM, caches: list[torch.Tensor],
                 device: torch.device, block_size: int, generator: torch.Generator,
                 name: str) -> None:
        self.model, self.caches, self.device = model, caches, device
        self.block_size, self.generator, self.name = block_size, generator, name
        self._seeded = torch.Generator(device=device)
        self._written: weakref.WeakKeyDictionary[Request, _Written] = (
            weakref.WeakKeyDictionary())
        self._starts: list[int] = []  # this proposal's: where each request's cache is stale

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, meta: object) -> torch.Tensor:
        return self.model(ids, positions, self.caches, meta)

    def _start(self, req: Request) -> int:
        """The first position of `req` whose draft K/V is not valid."""
        state = self._written.get(req)
        if state is None or state.preemptions != req.num_preemptions:
            return 0
        return min(state.positions, req.num_computed_tokens)

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], ks: Sequence[int],
                tables: Sequence[tuple[int, ...]]) -> list[Draft]:
        """As `TruncatedDraft.propose`, each request's draft cache first caught up from what
        this draft remembers writing (`_starts`, read by the first step)."""
        self._starts = [self._start(r) for r in reqs]
        drafts = super().propose(reqs, ks, tables)
        for req, k in zip(reqs, ks):
            self._written[req] = _Written(req.num_tokens - 1 + k, req.num_preemptions)
        return drafts

    def _step(self, reqs: Sequence[Request], live: list[int], j: int,
              inputs: list[int], tables: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """After the first step, as the truncated draft's; the first: the logits after each
        live request's last token [n, V], its draft cache first filled from `_starts[i]`
        (decodes first in the batch, as the attention expects)."""
        if j > 0:
            return super()._step(reqs, live, j, inputs, tables)
        batch = chunk_batch([(reqs[i].all_token_ids[self._starts[i]:reqs[i].num_tokens],
                              range(self._starts[i], reqs[i].num_tokens)) for i in live],
                            [tables[i] for i in live], self.block_size, self.device)
        hidden = self._hidden(batch.ids, batch.positions, batch.meta)
        return self.model.compute_logits(hidden[batch.ends])
