"""A draft model in the engine: a truncated copy of the target (its first layers, then its final
norm and output head), drafting greedily, batched over the requests that draft.

It shares the target's weights and, for its layers, the target's KV cache: those layers' K/V
at a verified position are the target's own (same weights, same inputs), so the draft needs no
cache of its own and nothing to rebuild after a preemption, a prefix hit or a KV handoff. Its
drafted positions' K/V land in the slots the verification then rewrites (the scheduler counts
none of them as computed until the target has). A draft checkpoint of its own (another model
sharing the tokenizer) would need a cache of its own: not served yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engine.parallel.messages import StepMessage
from workers.engine.parallel.pipeline import MicroBatch, microbatch_tensors
from workers.engine.request import Request
from workers.models.llama import LlamaForCausalLM, LlamaModel


class TruncatedDraft:
    """The first `num_layers` layers of `model` (a single-rank Llama-family model whose decoder
    stack is `LlamaModel`'s), reading and writing `caches` (the target's, per layer)."""

    name = "draft_model"

    def __init__(self, model: LlamaForCausalLM, caches: list[torch.Tensor],
                 device: torch.device, block_size: int, num_layers: int) -> None:
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

    def _logits(self, ids: torch.Tensor, positions: torch.Tensor, meta: object) -> torch.Tensor:
        stack = self.model.model
        hidden = stack.embed_tokens(ids)  # [T, hidden]
        if stack.embed_scale is not None:
            hidden = hidden * torch.tensor(stack.embed_scale, dtype=hidden.dtype)
        residual = None
        for layer, cache in zip(self.layers, self.caches):
            hidden, residual = layer(positions, hidden, residual, cache, meta)
        return self.model.compute_logits(stack.norm(hidden, residual)[0])

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], ks: Sequence[int],
                tables: Sequence[tuple[int, ...]]) -> list[list[int]]:
        """Greedy drafts of `ks[i]` tokens for each decoding request (its last token not yet
        computed), whose block table `tables[i]` has slots up to its last drafted position."""
        drafts: list[list[int]] = [[] for _ in reqs]
        inputs = [r.all_token_ids[-1] for r in reqs]
        size = self.block_size
        for j in range(max(ks, default=0)):
            live = [i for i, k in enumerate(ks) if k > j]
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
            for i, token in zip(live, self._logits(ids, positions, meta).argmax(-1).tolist()):
                drafts[i].append(token)
                inputs[i] = token
        return drafts
