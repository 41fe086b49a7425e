"""The acceptance rule for drafts with probabilities (a draft model's), after Leviathan et al.
and Chen et al. (2023): drafted token d at a position is accepted with probability
min(1, p(d) / q(d)), p the target's distribution there and q the draft's; at the first rejection
the token is drawn from the residual max(0, p - q), renormalised; when all k are accepted a
(k + 1)-th token is drawn from the target's distribution after them. Every token so produced is
distributed exactly as the target's. A deterministic draft (n-gram) is the case q = one-hot:
accept when the target's own draw equals the drafted token (`workers.engine.speculative.verify`).

Batched over N requests of k drafted tokens each; the distributions are the ones the tokens are
sampled from (after penalties, temperature and truncation), on any device. The sampler applies
it to a step's `Verification`s (`workers.engine.sampler`); a seeded request's draws come from
(seed, output position) salted apart from the target's own draw there (`VERIFY_SALT`) and the
draft's (`DRAFT_SALT`), so the same seed gives the same text on every run.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


# xor-ed into a seeded request's position seed (`workers.engine.sampler.position_seed`): the
# draft's draw and the verification's draws at a position are streams of their own
DRAFT_SALT = 0x5DEECE66D
VERIFY_SALT = 0xB5297A4D3F84D5B5


class Verification(NamedTuple):
    """A sampled request's draft to verify by rejection sampling in a step's sampling."""

    first_row: int  # the request's first row of the step's sampling rows (k + 1 rows)
    draft: tuple[int, ...]  # the k drafted tokens
    draft_probs: torch.Tensor  # [k, V]: the distributions the draft drew them from


class Verdict(NamedTuple):
    tokens: torch.Tensor  # [N, k + 1] int64: row i's first num_accepted[i] + 1 are its tokens
    num_accepted: torch.Tensor  # [N] int64


def rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                     target_probs: torch.Tensor, generator: torch.Generator | None = None,
                     ) -> Verdict:
    """draft_tokens [N, k] int64, drawn from draft_probs [N, k, V]; target_probs [N, k + 1, V]
    (row j: the target's distribution after the first j drafted tokens)."""
    n, k = draft_tokens.shape
    p_all = target_probs[:, :k]
    p = p_all.gather(-1, draft_tokens[..., None])[..., 0]  # [N, k]
    q = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
    u = torch.rand(n, k, generator=generator, device=draft_tokens.device, dtype=p.dtype)
    accepted = u * q < p  # u < p / q without dividing by a zero q
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)
    residual = (p_all - draft_probs).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    # p == q at a position leaves no residual mass (and no rejection there to draw from)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_all)
    recovered = torch.multinomial(residual.reshape(n * k, -1), 1, generator=generator)
    bonus = torch.multinomial(target_probs[:, k], 1, generator=generator)  # [N, 1]
    last = torch.cat([recovered.view(n, k), bonus], dim=1)  # the token at each stop position
    positions = torch.arange(k + 1, device=draft_tokens.device)[None, :]
    padded = torch.cat([draft_tokens, bonus], dim=1)
    tokens = torch.where(positions < num_accepted[:, None], padded, last)
    return Verdict(tokens, num_accepted)
