"""Multi-token-prediction drafts (issue 48's method 4): the checkpoint's own MTP layer
(DeepSeek-V3's `model.layers.{num_hidden_layers}`, `workers.models.deepseek.DeepseekMTPLayer`)
drafts for the target, as vLLM's `deepseek_mtp` / `mtp` methods do.

The layer at position i reads the target's hidden state there before its final norm, h[i], and
token i + 1, and predicts token i + 2. So the draft needs the target's hidden states of every
position it has not yet run: the target's forward keeps them (`LlamaModel.keep_prenorm`) and the
runner hands each step to `MTPDraft.record` (`ModelRunner.after_forward`), which keeps, per
request, the rows of positions the MTP layer has not consumed (prefill chunks, decodes, a
verification's k + 1 positions; a verification's rejected positions are dropped when the next
step recomputes them). Drafting a request of n tokens (its last one not yet computed): one
prefill-style chunk over the positions from where its MTP cache is stale to n - 2 with their
kept rows and the tokens one further on, whose last row's logits draft token n; each further
drafted token runs the same layer at the next position on the layer's own output h' and the
drafted token (as vLLM drafts past a checkpoint's MTP layers).

The layer's K/V live in a cache of its own (one layer shaped as the target's, addressed by the
target's block tables, as the quantized self-draft's). Where the target computed no hidden
state for a position (a prefix-cache hit, a KV handoff, a migration), the layer's K/V there are
whatever its cache holds: worse drafts, never other output (verification decides every token).
A decode-role worker refuses this method: every request it decodes arrived that way
(`workers.serving.roles`).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from workers.engine.request import Request
from workers.engine.scheduler_records import SchedulerOutput
from workers.engine.speculative.config import MTP_METHODS, SpeculativeConfig
from workers.engine.speculative.draft_model import Draft, TruncatedDraft, chunk_batch
from workers.models.llama import LlamaForCausalLM
from workers.models.model_config import ModelConfig

# hidden-state rows kept per request for the MTP layer at most (a request that does not draft
# for long, e.g. in large batches, keeps only its latest; the older positions' MTP K/V stay
# stale: worse drafts only)
MAX_KEPT_ROWS = 2048


def mtp_model_config(config: SpeculativeConfig | None, mc: ModelConfig, model: str
                     ) -> ModelConfig:
    """`mc` with its multi-token-prediction layer built and loaded when `config` drafts with
    it; ValueError naming the method and the checkpoint when it carries none."""
    if config is None or config.method not in MTP_METHODS:
        return mc
    if mc.model_type != "deepseek_v3" or mc.num_nextn_predict_layers < 1:
        raise ValueError(
            f"speculative_config method {config.method!r} drafts with the checkpoint's "
            f"multi-token-prediction layer, but {model!r} ({mc.architecture}) has none "
            f"(num_nextn_predict_layers={mc.num_nextn_predict_layers}; DeepSeek-V3 checkpoints "
            f"carry one)")
    return dataclasses.replace(mc, mtp_layers=1)


@dataclass
class _Kept:
    """A request's target hidden states the MTP layer has not consumed: consecutive rows
    from position `start`; `done`: positions below it have the layer's K/V."""

    start: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)  # [L_i, hidden] each, in order
    done: int = 0

    @property
    def end(self) -> int:
        return self.start + sum(r.shape[0] for r in self.rows)

    def keep(self, start: int, rows: torch.Tensor) -> None:
        """The target's rows of positions [start, start + len(rows)); those it kept from
        `start` on are replaced (a verification's rejected positions, a recomputation)."""
        if self.rows and self.start <= start <= self.end:
            self.cut(self.start, start)
        else:  # none kept, or a gap (positions the target did not compute here)
            self.start, self.rows = start, []
        self.rows.append(rows.clone())
        self.done = min(self.done, start)
        while self.end - self.start > MAX_KEPT_ROWS and len(self.rows) > 1:
            self.start += self.rows.pop(0).shape[0]

    def cut(self, first: int, end: int) -> torch.Tensor:
        """The rows of positions [first, end) (within the kept ones), now the only ones kept."""
        whole = torch.cat(self.rows) if len(self.rows) > 1 else self.rows[0]
        part = whole[first - self.start:end - self.start]
        self.start, self.rows = first, [part]
        return part


class MTPDraft(TruncatedDraft):
    """Drafts with `model.mtp` (a DeepSeek-V3 target's MTP layer) over `cache` (its own, one
    layer shaped as the target's); see the module docstring. `name`: the method's name."""

    def __init__(self, model: LlamaForCausalLM, cache: torch.Tensor, device: torch.device,
                 block_size: int, generator: torch.Generator, name: str) -> None:
        mtp = getattr(model, "mtp", None)
        if mtp is None:
            raise ValueError(f"{type(model).__name__} has no multi-token-prediction layer built")
        self.model, self.mtp, self.cache, self.device = model, mtp, cache, device
        self.block_size, self.generator, self.name = block_size, generator, name
        self._seeded = torch.Generator(device=device)
        self._kept: weakref.WeakKeyDictionary[Request, _Kept] = weakref.WeakKeyDictionary()
        self._previous: dict[int, torch.Tensor] = {}  # this proposal's h' by request index
        model.model.keep_prenorm = True

    def record(self, out: SchedulerOutput) -> None:
        """Keeps the step's target hidden states (before the final norm) of each request that
        may draft, by position (`ModelRunner.after_forward`)."""
        hidden = self.model.model.prenorm
        if hidden is None:
            raise RuntimeError("the target's forward kept no hidden states for the MTP draft")
        row = 0
        for chunk in out.chunks:
            req, n = chunk.request, chunk.num_tokens
            if req.params.speculative:
                kept = self._kept.get(req)
                if kept is None:
                    kept = self._kept[req] = _Kept()
                kept.keep(chunk.start, hidden[row:row + n])
            row += n

    def _ready(self, req: Request) -> bool:
        """Whether the target's hidden state of `req`'s last computed position is kept."""
        kept = self._kept.get(req)
        return kept is not None and kept.start <= req.num_tokens - 2 < kept.end

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], ks: Sequence[int],
                tables: Sequence[tuple[int, ...]]) -> list[Draft]:
        """As `TruncatedDraft.propose`; a request whose last hidden state the target has not
        computed here (just handed off) drafts nothing this step."""
        ks = [k if self._ready(r) else 0 for r, k in zip(reqs, ks)]
        try:
            return super().propose(reqs, ks, tables)
        finally:
            self._previous = {}

    def _step(self, reqs: Sequence[Request], live: list[int], j: int,
              inputs: list[int], tables: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """The logits [n, V] of the `live` requests' `j`-th drafted token: the first from the
        target's kept hidden states (catching the layer's cache up), the next from the layer's
        own output at the position before."""
        chunks: list[tuple[list[int], list[int], torch.Tensor]] = []
        for i in live:
            req = reqs[i]
            last = req.num_tokens - 2 + j  # the position the layer runs at (predicting last + 2)
            if j > 0:
                chunks.append(([inputs[i]], [last], self._previous[i][None]))
                continue
            kept = self._kept[req]
            first = max(kept.done, kept.start)
            rows = kept.cut(first, last + 1)
            # consumed; the rows of drafted positions come with their verification
            kept.start, kept.rows, kept.done = last + 1, [], last + 1
            chunks.append((req.all_token_ids[first + 1:last + 2], list(range(first, last + 1)),
                           rows))
        hidden, ends = self._run(chunks, [tables[i] for i in live])
        out = hidden[ends]
        self._previous = dict(zip(live, out))
        return self.mtp.compute_logits(out)

    def _run(self, chunks: list[tuple[list[int], list[int], torch.Tensor]],
             tables: list[tuple[int, ...]]) -> tuple[torch.Tensor, list[int]]:
        """The layer over `chunks` (tokens t[i + 1], positions i, target rows h[i] each) in one
        batch -> (h' of every row, each chunk's last row)."""
        batch = chunk_batch([(tokens, positions) for tokens, positions, _ in chunks], tables,
                            self.block_size, self.device)
        stack = self.model.model
        embeds = stack.embed_tokens(batch.ids)
        if stack.embed_scale is not None:
            embeds = embeds * torch.tensor(stack.embed_scale, dtype=embeds.dtype)
        previous = torch.cat([chunks[c][2] for c in batch.order]).to(embeds.dtype)
        return (self.mtp.predict(batch.positions, embeds, previous, self.cache, batch.meta),
                batch.ends)
