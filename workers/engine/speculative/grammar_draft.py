"""Drafts under a grammar's mask: a structured-output request drafts and verifies like any other,
with the grammar's token mask at every verified position.

The mask at verified position j is the matcher's state after the draft's first j tokens: the
matcher accepts them one at a time, fills each state's mask, and rolls back to where it was
(xgrammar matchers roll back without limit), so between steps it always stands at the request's
output. After the step the engine feeds it the accepted tokens and the one sampled after them
(`workers.engine.core`), so it ends exactly at the accepted tokens' state.

Drafts are cut before the target verifies them (saving its work on tokens the grammar would
refuse): a deterministic draft (n-gram; any greedy request's) before the first token the
grammar refuses or that ends it: the target's masked draw there is the one decoding without
speculation makes. A rejection-sampled draft (a draft model's, sampled) keeps that token as
its last: cutting where the draft drew a refused token would replace the residual draw
max(0, p - q) with a draw from p there, which is no longer the target's distribution; the
masked target gives the refused token p = 0, so it is rejected with certainty and the residual
(of the masked p) is drawn. The draft's own probability of a refused token does not matter.
A draft model drafts under the mask itself (`DraftWalk`), so its drafts hold only tokens the
grammar allows, up to one that completes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from workers.engine.grammar import MaskBuffer


def cut_draft(matcher: Any, draft: Sequence[int], keep_refused: bool) -> list[int]:
    """`draft` cut at the first token `matcher` (xgrammar's, at the request's state) refuses or
    that completes the grammar: before it, or after it with `keep_refused` (a rejection-sampled
    draft; see the module docstring). The matcher ends where it began."""
    accepted = 0
    cut = len(draft)
    for j, token in enumerate(draft):
        ok = matcher.accept_token(token)
        accepted += ok
        if not ok or matcher.is_terminated():
            cut = j + 1 if keep_refused else j
            break
    if accepted:
        matcher.rollback(accepted)
    return list(draft[:cut])


def draft_masks(matcher: Any, draft: Sequence[int], vocab_size: int) -> torch.Tensor:
    """[len(draft), ceil(vocab_size / 32)] int32 token bitmasks (xgrammar's layout): row j-1
    the mask after the draft's first j tokens. A position past a token the grammar refuses or
    that completes it is never kept (that token is rejected, or ends the request): it gets the
    mask before, so its row still samples. The matcher ends where it began."""
    import xgrammar as xgr

    masks = xgr.allocate_token_bitmask(len(draft) + 1, vocab_size)  # row 0: the request's
    matcher.fill_next_token_bitmask(masks, 0)
    accepted, live = 0, True
    for j, token in enumerate(draft, start=1):
        if live and matcher.accept_token(token):
            accepted += 1
            live = not matcher.is_terminated()
            if live:
                matcher.fill_next_token_bitmask(masks, j)
                continue
        live = False
        masks[j].copy_(masks[j - 1])
    if accepted:
        matcher.rollback(accepted)
    return masks[1:]


class FilledMask:
    """A verified position's grammar for one step: its row of bitmask, filled at the state
    after the draft's tokens before it, in the matcher interface the sampler's mask reads
    (`workers.engine.grammar.MaskBuffer`)."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask  # [ceil(vocab / 32)] int32

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].copy_(self.mask)


def advance(matcher: Any, tokens: Sequence[int]) -> bool:
    """Feed a step's new `tokens` (accepted drafted ones, then the one sampled after them) to
    `matcher`; False at the first it refuses (the mask forbids it: only a bug gets there)."""
    return all(not matcher.is_terminated() and matcher.accept_token(token) for token in tokens)


class DraftWalk:
    """A draft model's walk of its constrained requests' matchers while it drafts: each drafted
    position's logits masked at the state after the tokens drafted before it, so it drafts
    only tokens the grammar allows (the distributions it draws from are the masked ones: the
    rejection sampling's q). `close` rolls every matcher back to where it began."""

    def __init__(self, reqs: Sequence[Any]) -> None:
        self.matchers = {i: r.grammar for i, r in enumerate(reqs) if r.grammar is not None}
        self.accepted = dict.fromkeys(self.matchers, 0)
        self._ended: set[int] = set()  # refused or completed: drafts past it are cut anyway
        self._masks = MaskBuffer()

    def mask(self, logits: torch.Tensor, live: Sequence[int]) -> None:
        """Mask, in place, the rows of `logits` [len(live), V] of the `live` requests."""
        rows = [r for r, i in enumerate(live) if i in self.matchers and i not in self._ended]
        if rows:
            self._masks.apply(logits, rows, [self.matchers[live[r]] for r in rows])

    def accept(self, live: Sequence[int], tokens: Sequence[int]) -> None:
        """The `live` requests drafted `tokens`."""
        for i, token in zip(live, tokens):
            matcher = self.matchers.get(i)
            if matcher is None or i in self._ended:
                continue
            if matcher.accept_token(token):
                self.accepted[i] += 1
                if not matcher.is_terminated():
                    continue
            self._ended.add(i)

    def close(self) -> None:
        for i, matcher in self.matchers.items():
            if self.accepted[i]:
                matcher.rollback(self.accepted[i])
