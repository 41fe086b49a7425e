"""When to speculate: the per-step policy that sets each running request's draft.

Before each step the engine asks the speculator to `propose`: every running request gets its
`draft_token_ids` for the step (empty: it decodes one token as without speculation). A request
drafts when it is decoding (its prompt computed), asked for speculation and is not a
prefill-only request; a structured-output request's draft is cut where its grammar refuses a
token (`workers.engine.speculative.grammar_draft`). No request drafts while more than
`disable_by_batch_size` run; otherwise each request's draft is as long as pays best for its
measured acceptance and the measured cost of a drafted token, none where drafting does not pay
(`workers.engine.speculative.draft_length`; `"draft_length": "fixed"`: always the most). An
n-gram draft's acceptance is that of the server's drafts copied after matches as long as its own
(`MatchSpeculator`); a draft model's, its request's.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.engine.kv_cache import KVCacheManager
from workers.engine.parallel.local import LocalExecutor
from workers.engine.request import Request
from workers.engine.runner import ModelRunner, allocate_kv_caches
from workers.engine.speculative.draft_model import TruncatedDraft
from workers.engine.speculative.config import MTP_METHODS, SpeculativeConfig
from workers.engine.speculative.drafter import Drafter, NgramDrafter
from workers.engine.speculative.draft_length import (ACCEPTANCE_WEIGHT, PAUSE_STEPS,
                                                       PRIOR_ACCEPTANCE, MatchAcceptance,
                                                       StepClock, best_length, decoding,
                                                       reached)
from workers.engine.speculative.grammar_draft import cut_draft
from workers.engine.speculative.mtp import MTPDraft
from workers.engine.speculative.own_cache import OwnCacheDraft
from workers.engine.speculative.quantized_self import quantized_copy


class NoSpeculation:
    """The speculator of a server without speculation: nothing drafts."""

    method: str | None = None

    def propose(self, running: Sequence[Request]) -> None:
        """Nothing: drafts stay empty."""


@dataclass
class _DraftState:
    acceptance: float = PRIOR_ACCEPTANCE  # p: of the drafted tokens its drafts reached, accepted
    seen_drafted: int = 0  # the request's counters when last looked at
    seen_accepted: int = 0
    pause: int = 0  # decode steps left without drafting


class Speculator:
    """Sets running requests' drafts from `drafter` (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, drafter: Drafter, max_model_len: int) -> None:
        self.config = config
        self.drafter = drafter
        self.method: str | None = drafter.name
        self.max_model_len = max_model_len
        self.clock = StepClock()
        self._states: weakref.WeakKeyDictionary[Request, _DraftState] = (
            weakref.WeakKeyDictionary())

    def propose(self, running: Sequence[Request]) -> None:
        """Set `draft_token_ids` of every request in `running` for the next step."""
        self.clock.lap(running)
        batched = len(running) > self.config.disable_by_batch_size
        for req in running:
            draft = [] if batched else self._draft(req)
            req.draft_token_ids = (cut_draft(req.grammar, draft, keep_refused=False)
                                   if draft and req.grammar is not None else draft)
        self.clock.mark(running)

    def _draft(self, req: Request) -> list[int]:
        k = self._length(req, self._num_to_draft(req))
        return self.drafter.propose(req.all_token_ids, k) if k else []

    def _num_to_draft(self, req: Request) -> int:
        """Tokens the request may draft now: 0 unless it is decoding and wants speculation;
        fewer near `max_tokens` (a step appends up to k + 1) and the context's end. A
        structured-output request ignoring EOS whose draft is rejection-sampled does not draft:
        its draft would keep a drafted token that completes the grammar, and tokens after it
        (`workers.engine.speculative.grammar_draft`)."""
        if (not decoding(req) or not req.params.speculative or req.hold_kv
                or (req.grammar is not None and req.params.ignore_eos
                    and self._keeps_refused(req))):
            return 0
        return min(self.config.num_speculative_tokens,
                   req.params.max_tokens - req.num_output_tokens - 1,
                   self.max_model_len - req.num_tokens)

    def _keeps_refused(self, req: Request) -> bool:
        """Whether `req`'s draft is rejection-sampled: cut after the first token its grammar
        refuses rather than before (`workers.engine.speculative.grammar_draft`)."""
        return False

    def _length(self, req: Request, k: int) -> int:
        """The request's draft length this step, at most `k`: folds its last verified draft
        into its acceptance, then `best_length` at the measured token cost (`draft_length`)."""
        if k <= 0:
            return 0
        state = self._states.get(req)
        if state is None:
            state = self._states[req] = _DraftState()
        drafted = req.num_draft_tokens - state.seen_drafted
        if drafted:
            accepted = req.num_accepted_tokens - state.seen_accepted
            state.acceptance += ACCEPTANCE_WEIGHT * (accepted / reached(accepted, drafted)
                                                     - state.acceptance)
            state.seen_drafted, state.seen_accepted = req.num_draft_tokens, req.num_accepted_tokens
        if self.config.draft_length == "fixed":
            return k
        if state.pause:
            state.pause -= 1
            return 0
        length = best_length(state.acceptance, self.clock.token_cost, k)
        if not length:  # tried afresh after the pause
            state.pause, state.acceptance = PAUSE_STEPS - 1, PRIOR_ACCEPTANCE
        return length


@dataclass
class _Copied:
    """A request's n-gram draft awaiting verification: its match's length, where it was copied
    from, and the request's counters when it was drafted."""

    match: int
    start: int
    drafted: int
    accepted: int


class MatchSpeculator(Speculator):
    """N-gram drafts (`NgramDrafter.lookup`), each as long as pays at the acceptance measured
    for drafts copied after matches as long as its own (`MatchAcceptance`) rather than at its
    request's average, and copied, where the match occurs more than once, from the first
    occurrence at or after where the request's last draft reached in its source (its accepted
    tokens and the target's own one past them). Replayed on SmolLM2's greedy outputs repeating
    code, at most 8 tokens (`benchmarks/speculative_replay.py`): by match length 1.67x against
    1.65x by the request's average at a drafted token's cost of 0.21 of a step; following the
    source 1.635x against 1.593x at 0.21 on the VNNI kernel's texts.
    """

    drafter: NgramDrafter

    def __init__(self, config: SpeculativeConfig, drafter: NgramDrafter,
                 max_model_len: int) -> None:
        super().__init__(config, drafter, max_model_len)
        self.matches = MatchAcceptance()
        self._copied: weakref.WeakKeyDictionary[Request, _Copied] = weakref.WeakKeyDictionary()
        # where each request's copying had reached in its history: its last verified draft's
        # source position one past its accepted tokens and the target's own
        self._source: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()

    def _draft(self, req: Request) -> list[int]:
        copied = self._copied.pop(req, None)
        if copied is not None and req.num_draft_tokens > copied.drafted:  # verified
            accepted = req.num_accepted_tokens - copied.accepted
            self.matches.record(copied.match, accepted, req.num_draft_tokens - copied.drafted)
            self._source[req] = copied.start + accepted + 1
        k = self._num_to_draft(req)
        if k <= 0:
            return []
        draft, match, start = self.drafter.lookup(req.all_token_ids, k, self._source.get(req))
        if draft and self.config.draft_length == "cost":
            draft = draft[:self.matches.length(match, self.clock.token_cost, len(draft))]
        if draft:
            self._copied[req] = _Copied(match, start, req.num_draft_tokens,
                                        req.num_accepted_tokens)
        return draft


class DraftModelSpeculator(Speculator):
    """Drafts with a model, batched over the drafting requests: a sampled request's draft
    carries the draft's distributions (`Request.draft_probs`), which the verification's
    rejection sampling needs (`workers.engine.speculative.rejection`). The slots of a request's
    drafted positions are allocated before the draft writes them; none free: it does not
    draft."""

    def __init__(self, config: SpeculativeConfig, draft: TruncatedDraft, kv: KVCacheManager,
                 max_model_len: int) -> None:
        self.config, self.draft, self.kv = config, draft, kv
        self.method = draft.name
        self.max_model_len = max_model_len
        self.clock = StepClock()
        self._states = weakref.WeakKeyDictionary()

    def propose(self, running: Sequence[Request]) -> None:
        self.clock.lap(running)
        reqs: list[Request] = []
        ks: list[int] = []
        batched = len(running) > self.config.disable_by_batch_size
        for req in running:
            req.draft_token_ids, req.draft_probs = [], None
            k = 0 if batched else self._length(req, self._num_to_draft(req))
            if k > 0 and self.kv.allocate_slots(req, 1 + k):
                reqs.append(req)
                ks.append(k)
        drafts = self.draft.propose(reqs, ks, [self.kv.block_table(r.request_id) for r in reqs])
        for req, draft in zip(reqs, drafts):
            req.draft_token_ids = (draft.tokens if req.grammar is None else
                                   cut_draft(req.grammar, draft.tokens, self._keeps_refused(req)))
            if draft.probs:
                req.draft_probs = torch.stack(draft.probs)  # [k, V]
        self.clock.mark(running)


    def _keeps_refused(self, req: Request) -> bool:
        return not req.params.greedy  # a sampled request's draft carries probabilities


def build_speculator(config: SpeculativeConfig | None, max_model_len: int,
                     runner: ModelRunner, kv: KVCacheManager,
                     draft: TruncatedDraft | None = None) -> Speculator | NoSpeculation:
    """The speculator `config` asks for (`NoSpeculation` for None). `draft`: one built beside
    the target (a checkpoint of its own, `assembly.speculator`), whatever runs the target; the
    other draft models draft on `runner`'s model (one rank in this process): a truncated copy
    on its KV cache, a quantized self-draft on a cache of its own shaped as the target's, the
    checkpoint's MTP layer on a cache of its own of one layer, fed the target's hidden states
    after each forward."""
    if config is None:
        return NoSpeculation()
    if config.method == "ngram":
        return MatchSpeculator(config, NgramDrafter(config.prompt_lookup_min,
                                                    config.prompt_lookup_max), max_model_len)
    if draft is not None:
        return DraftModelSpeculator(config, draft, kv, max_model_len)
    executor = runner.executor
    if not isinstance(executor, LocalExecutor):
        raise ValueError(f"a draft model needs the target in this process, got "
                         f"{type(executor).__name__}")
    if config.method in MTP_METHODS:
        spec = dataclasses.replace(runner.spec, num_layers=1)
        mtp = MTPDraft(executor.model, allocate_kv_caches(spec, runner.device)[0],
                       runner.device, spec.block_size, runner.sampler.generator, config.method)
        runner.after_forward = mtp.record
        draft = mtp
    elif config.method == "quantized_self":
        draft = OwnCacheDraft(quantized_copy(executor.model),
                              allocate_kv_caches(runner.spec, runner.device), runner.device,
                              runner.spec.block_size, runner.sampler.generator, "quantized_self")
    else:
        draft = TruncatedDraft(executor.model, executor.caches, runner.device,
                               runner.spec.block_size, config.draft_num_layers,
                               runner.sampler.generator)
    return DraftModelSpeculator(config, draft, kv, max_model_len)
