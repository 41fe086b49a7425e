"""Sampling on a worker group's last rank: the driver's record of each step, the rank's mirror.

The last pipeline stage's first TP rank runs the same `Sampler` the single-process engine runs,
over mirrors of the driver's `Request`s: `SamplingSync` (the driver) sends a request's
parameters the first time it samples there, then only the output tokens it gained since;
`RankSampler` (the rank) keeps the mirrors, so the sampler's per-request state (penalties'
token history on the device, seeds by output position, min_tokens, logit bias) is the same as
the driver's would be. Grammar matchers stay on the driver (they advance with the engine's
stop checks): it fills each constrained row's token bitmask before the step (the state the
single-process sampler would read after the forward pass) and sends it along, 1/32 of that
row's fp32 logits. The reply is the token ids (and logprobs where asked).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from workers.kernels.host_transfer import upload
from workers.engine.parallel.messages import (
    PromptLogprobRows,
    SampledTokens,
    SamplingRecord,
    SamplingRequest,
)
from workers.engine.request import Request
from workers.engine.sampler import Sampler, top_logprobs


def grammar_masks(matchers: Sequence[Any], vocab_size: int) -> torch.Tensor | None:
    """[len(matchers), ceil(vocab_size / 32)] int32 on the CPU: each matcher's next-token
    bitmask (xgrammar's layout); None without matchers. `matchers`: xgrammar's, held as
    objects by modules that do not import xgrammar (hence untyped)."""
    if not matchers:
        return None
    if vocab_size < 1:
        raise ValueError(f"grammar masks need the model's vocab size, got {vocab_size}")
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    for row, matcher in enumerate(matchers):
        matcher.fill_next_token_bitmask(bitmask, row)
    return bitmask


class SamplingSync:
    """The driver's side: builds each step's `SamplingRecord` from what the rank's mirrors
    already hold. `vocab_size`: the model's logits width (for grammar masks)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # request id -> (the driver's request, output tokens its mirror holds)
        self._sent: dict[str, tuple[weakref.ref[Request], int]] = {}

    @property
    def num_mirrored(self) -> int:
        """Requests the rank holds a mirror of (after the last record)."""
        return len(self._sent)

    def record(self, sampling: Sequence[Request],
               prompt_logprobs: Sequence[PromptLogprobRows] = ()) -> SamplingRecord:
        """The record of a step whose sampling rows are `sampling`'s, in order. Mirrors of
        finished (or dropped) requests are retired in it."""
        finished = [rid for rid, (ref, _) in self._sent.items()
                    if (req := ref()) is None or req.is_finished]
        for rid in finished:
            del self._sent[rid]
        new: list[SamplingRequest] = []
        appended: list[tuple[int, ...]] = []
        for req in sampling:
            out = req.output_token_ids
            known = self._sent.get(req.request_id)
            if known is None or known[0]() is not req or known[1] > len(out):
                new.append(_mirror_of(req))  # replaces any older mirror under the id
                appended.append(())
            else:
                appended.append(tuple(out[known[1]:]))
            self._sent[req.request_id] = (weakref.ref(req), len(out))
        masks = grammar_masks([r.grammar for r in sampling if r.grammar is not None],
                              self.vocab_size)
        return SamplingRecord(tuple(r.request_id for r in sampling), tuple(appended),
                              tuple(new), tuple(finished), masks, tuple(prompt_logprobs))


def _mirror_of(req: Request) -> SamplingRequest:
    params = req.params
    if params.structured is not None:  # the driver's matcher masks it; the schema stays here
        params = dataclasses.replace(params, structured=None)
    prompt = tuple(req.prompt_token_ids) if params.repetition_penalty != 1.0 else ()
    return SamplingRequest(req.request_id, params, req.eos_token_ids, prompt,
                           tuple(req.output_token_ids), req.grammar is not None)


class _SentMask:
    """A constrained mirror's grammar for one step: the row of bitmask the driver filled, in
    the matcher interface `workers.engine.grammar.MaskBuffer` reads."""

    def __init__(self, mask: torch.Tensor | None) -> None:
        self.mask = mask  # [ceil(vocab / 32)] int32; None before its first step

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.mask is None:
            raise RuntimeError("a constrained request sampled without its grammar mask")
        bitmask[row].copy_(self.mask)


class RankSampler:
    """The rank's side: the mirrors, and the `Sampler` (seeded `seed`, on `device`) that
    samples over them."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.sampler = Sampler(seed, device)
        self.mirrors: dict[str, Request] = {}

    def __call__(self, logits: torch.Tensor | None, record: SamplingRecord) -> SampledTokens:
        """logits: the step's `logit_rows`, [rows + prompt-logprob rows, vocab] float32 (None
        when the step has none). Applies `record` to the mirrors, then samples."""
        reqs = self._apply(record)
        num_prompt = sum(len(p.target_token_ids) for p in record.prompt_logprobs)
        num_rows = 0 if logits is None else logits.shape[0]
        if num_rows != len(reqs) + num_prompt:
            raise ValueError(f"{num_rows} logit rows for {len(reqs)} sampling rows and "
                             f"{num_prompt} prompt-logprob rows")
        if logits is None or not num_rows:
            return SampledTokens((), ())
        out = self.sampler(logits[:len(reqs)], reqs) if reqs else None
        prompt = []
        row = len(reqs)
        for span in record.prompt_logprobs:
            count = len(span.target_token_ids)
            logprobs = logits[row:row + count].log_softmax(-1)
            row += count
            targets = upload(list(span.target_token_ids), self.sampler.device)
            prompt.append(tuple(top_logprobs(logprobs, targets, span.num_top)))
        if out is None:
            return SampledTokens((), (), tuple(prompt))
        return SampledTokens(tuple(out.token_ids), tuple(out.logprobs), tuple(prompt))

    def _apply(self, record: SamplingRecord) -> list[Request]:
        """Retire, create and extend the mirrors; the mirrors of `record.rows`, in order."""
        if len(record.appended) != len(record.rows):
            raise ValueError(f"a sampling record of {len(record.rows)} rows has "
                             f"{len(record.appended)} token updates")
        for rid in record.finished:
            self.mirrors.pop(rid, None)
        for new in record.new:
            mirror = Request(new.request_id, list(new.prompt_token_ids), new.params,
                             new.eos_token_ids)
            for token in new.output_token_ids:
                mirror.append_output(token)
            mirror.grammar = _SentMask(None) if new.constrained else None
            self.mirrors[new.request_id] = mirror
        masks = record.grammar_masks
        num_masks = 0 if masks is None else masks.shape[0]
        reqs, used = [], 0
        for rid, added in zip(record.rows, record.appended):
            req = self.mirrors.get(rid)
            if req is None:
                raise ValueError(f"the step samples request {rid!r}, which this rank has no "
                                 "mirror of")
            for token in added:
                req.append_output(token)
            if req.grammar is not None:
                if masks is None or used >= num_masks:
                    raise ValueError(f"constrained request {rid!r} came without its grammar "
                                     f"mask ({num_masks} masks in the step)")
                req.grammar = _SentMask(masks[used])
                used += 1
            reqs.append(req)
        return reqs
