"""A verification step's sampling: each drafting request samples k + 1 rows in one step, row j
as if its first j drafted tokens were already its output, so each row passes through exactly
the sampling of one-at-a-time decoding (penalties over the tokens before it, min_tokens, the
seed of its output position, logit_bias). A deterministic draft (n-gram; any greedy request's):
the drafted tokens are accepted while the target sampled them, and the first token it sampled
otherwise (or after the last draft) follows them. That is the rejection rule with the draft's
distribution a point mass q = one-hot(d): accepting with probability min(1, p(d) / 1) and
otherwise drawing from max(0, p - q) renormalised (p without d) gives each token x with
probability p(x), as the target's own draw compared with d does; the draw kept is the one
decoding without speculation makes at that position, so a seeded request's text is the same
with n-gram speculation as without. A draft with probabilities (a draft model's, sampled) is
rejection-sampled in the sampler (`workers.engine.speculative.rejection`). A constrained
request's rows are masked by its grammar at the state after their drafted prefix
(`workers.engine.speculative.grammar_draft`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, cast

from workers.engine.request import Request
from workers.engine.speculative.grammar_draft import FilledMask, draft_masks


class DraftRow:
    """Request `base` seen after its first `j` drafted tokens (`draft[:j]`), as the sampler and
    the logit adjuster read a request (its token lists are built only when read)."""

    def __init__(self, base: Request, draft: Sequence[int], j: int,
                 grammar: FilledMask | None = None) -> None:
        self.base = base
        self._extra = list(draft[:j])
        self.request_id = base.request_id
        self.params = base.params
        self.eos_token_ids = base.eos_token_ids
        self.grammar = grammar  # a constrained request's mask after draft[:j]
        self.num_output_tokens = base.num_output_tokens + j

    @property
    def output_token_ids(self) -> list[int]:
        return self.base.output_token_ids + self._extra

    @property
    def all_token_ids(self) -> list[int]:
        return self.base.all_token_ids + self._extra


def sampling_rows(req: Request, draft: Sequence[int], vocab_size: int = 0) -> list[Request]:
    """The k + 1 rows request `req` samples to verify `draft` (k tokens): itself, then itself
    after each drafted prefix; a constrained request's rows carry the grammar's mask after
    that prefix (`workers.engine.speculative.grammar_draft`; `vocab_size`: the logits'
    width)."""
    masks: list[FilledMask | None] = [None] * len(draft)
    if req.grammar is not None and draft:
        if vocab_size < 1:
            raise ValueError(f"a constrained draft's masks need the vocab size, got {vocab_size}")
        masks = [FilledMask(m) for m in draft_masks(req.grammar, draft, vocab_size)]
    # a DraftRow has every attribute the sampler and the logit adjuster read of a Request
    return [req, *cast(list[Request], [DraftRow(req, draft, j, masks[j - 1])
                                       for j in range(1, len(draft) + 1)])]


def num_accepted(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """How many leading drafted tokens the target sampled too (`sampled`: its k + 1 rows)."""
    m = 0
    while m < len(draft) and sampled[m] == draft[m]:
        m += 1
    return m


class RowSpan(NamedTuple):
    """One request's rows of a step's sampling: its new tokens are those of rows
    [first, first + num_accepted] (the accepted drafted tokens, then the last one)."""

    request_id: str
    first: int
    num_accepted: int  # drafted tokens accepted (0 for a request that did not draft)
    num_drafted: int


def row_spans(rows: Sequence[Request], drafts: dict[int, tuple[int, ...]],
              tokens: Sequence[int], accepted: dict[int, int] | None = None) -> list[RowSpan]:
    """Each sampling request's span of the step's sampling `rows` and their `tokens`;
    `drafts`: the first row of each verifying request -> its draft; `accepted`: the first row
    of each rejection-sampled one -> its count of accepted drafted tokens (the others accept
    while the target sampled the drafted token)."""
    if len(tokens) != len(rows):
        raise RuntimeError(f"{len(tokens)} tokens sampled for {len(rows)} rows")
    known = accepted or {}
    spans: list[RowSpan] = []
    i = 0
    while i < len(rows):
        draft = drafts.get(i, ())
        width = len(draft) + 1
        m = known[i] if i in known else num_accepted(draft, tokens[i:i + width])
        spans.append(RowSpan(rows[i].request_id, i, m, len(draft)))
        i += width
    return spans
