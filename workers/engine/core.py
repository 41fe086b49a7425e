"""The inference engine: requests in, token events out, one `step()` at a time.

One verb per operation, each taking the request record (`WorkerRequest`) whole: `generate`,
`prefill`, `decode_from_handoff` + `kv_landed`, `resume`, `abort`. Not thread-safe: one caller
drives them and `step` (the async engine serialises them for you). How the engine is built
from its config (model, KV budget, executor) is `workers.engine.assembly`.

Long because every request verb, the handoff's halves included, sits beside the step that serves
them: one file shows a request's whole life in the engine.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from workers.engine import assembly
from workers.engine.async_step import AsyncStepper, Recorder
from workers.kernels.kv_quant import KV_QUANT_DTYPES
from workers.engine.config import EngineConfig
from workers.engine.grammar import Grammars
from workers.engine.kv_cache import KVCacheManager
from workers.models.model_config import ModelConfig, resolve_dtype
from workers.engine.output_processor import OutputProcessor
from workers.engine.parallel.validate import check_parallel
from workers.contract.protocol import (
    EngineStats,
    FinishReason,
    InvalidRequestError,
    KVCacheFull,
    SamplingParams,
    TokenEvent,
    WorkerRequest,
)
from workers.contract.prefix_cache import HotPrefix, KVEvent, KVSnapshot
from workers.engine.request import Continuation, Request, RequestStatus
from workers.engine.runner import KVCacheSpec, ModelRunner, RunnerOutput
from workers.engine.sampler import sample_seed
from workers.engine.scheduler import Scheduler
from workers.engine.scheduler_records import SchedulerConfig, SchedulerOutput
from workers.engine.step_costs import StepCosts

if TYPE_CHECKING:
    from kvtransfer import AgentHostAddress, KVLayout
    from workers.engine.parallel.group import RankLauncher

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig, rank_launcher: RankLauncher | None = None, *,
                 detokenize: bool = True) -> None:
        """`rank_launcher`: starts the ranks when `config.world_size > 1` (default: spawned
        processes; the cluster passes Ray actors). `detokenize` False: events carry token ids
        and no text, and stop strings are not looked for (a router does both)."""
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.device = torch.device(config.resolved_device)
        self.dtype = resolve_dtype(config.dtype, self.model_config)
        self.tokenizer = assembly.load_tokenizer(config.model)
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        # GPUs are counted only for ranks spawned here, which share this process's view:
        # other launchers' ranks (Ray actors) each hold their own GPU, which this process (an
        # engine actor that holds none) may not see, and Ray has already placed them
        check_parallel(config, mc, torch.cuda.device_count()
                       if self.device.type == "cuda" and assembly.spawns_ranks(rank_launcher)
                       else None)
        if self.device.type == "cuda" and self.device.index is not None and config.world_size == 1:
            torch.cuda.set_device(self.device)  # Triton launches on the current device
        kv_dtype = (self.dtype if config.kv_cache_dtype == "auto"
                    else KV_QUANT_DTYPES.get(config.kv_cache_dtype)
                    or resolve_dtype(config.kv_cache_dtype, mc))
        spec = KVCacheSpec(mc.num_hidden_layers, 1, config.block_size, mc.kv_cache_heads,
                           mc.kv_cache_head_dim, kv_dtype, latent=mc.mla is not None)
        # loaded first: on a GPU the KV budget is what the weights and a profiled step leave
        model = (assembly.load_local_model(config, mc, self.dtype, self.device)
                 if config.world_size == 1 else None)
        host_blocks = assembly.num_host_blocks(config, spec)
        if model is not None:
            spec = dataclasses.replace(spec, num_blocks=assembly.num_kv_blocks(
                config, spec, model, self.device, self.max_model_len))
            executor = assembly.local_executor(config, model, spec, self.device,
                                               self.max_model_len, host_blocks)
        else:  # a GPU group's ranks measure their memory: the cache's size comes back
            executor, self.device, spec = assembly.group_executor(
                config, spec, rank_launcher, self.device, self.dtype, host_blocks,
                self.max_model_len)
        self.costs = StepCosts(config.block_size)
        self.kv_pull_bytes_per_s = 0.0  # measured by the worker's transfer layer, reported
        self.kv_fetch_fixed_s = 0.0  # a prefix fetch's cost beyond its bytes (`PrefixFetcher`)
        self.kv = KVCacheManager(spec.num_blocks, config.block_size, config.enable_prefix_caching,
                                 window=mc.uniform_window, host_blocks=host_blocks)
        self.scheduler = Scheduler(SchedulerConfig(
            config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len), self.kv)
        self.runner = ModelRunner(executor, spec, self.device, seed=config.seed,
                                  num_microbatches=config.pipeline_microbatches
                                  or config.pipeline_parallel_size,
                                  vocab_size=mc.vocab_size)
        self.outputs = OutputProcessor(self.tokenizer, detokenize)
        self.eos_token_ids = frozenset(mc.eos_token_ids) | (
            self.tokenizer.eos_token_ids if self.tokenizer is not None else frozenset())
        self.grammars = Grammars(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        self._samples: dict[str, list[str]] = {}  # request id -> its samples' internal ids
        self._forks: dict[str, list[Request]] = {}  # sample 0's id -> siblings not yet added
        self.async_steps = (AsyncStepper(self.scheduler, self.runner, self.costs, self._emit)
                            if config.async_scheduling else None)
        logger.info("engine ready: %s on %s, %d KV blocks of %d tokens", mc.architecture,
                    self.device, spec.num_blocks, config.block_size)

    def close(self) -> None:
        """Stop the rank processes, if any (idempotent). The engine cannot step afterwards."""
        self.runner.executor.close()

    # ---- requests ------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a text prompt (token ids pass through): for callers building a
        `WorkerRequest`, whose prompt is always token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt must be token ids: the model has no tokenizer",
                                          param="prompt")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt contains token ids outside [0, {vocab}): {bad[:5]}", param="prompt")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
                f"{params.max_tokens} in the completion).", param="max_tokens")
        bad = [t for t in params.logit_bias or () if t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"logit_bias has token ids outside [0, {vocab}): {bad[:5]}", param="logit_bias")
        tokens = len(ids) + params.max_tokens
        if self.kv.window is not None:  # older blocks return: a step's chunk and the window
            tokens = min(tokens, self.config.max_num_batched_tokens + self.kv.window)
        needed = self.kv.num_blocks_for(tokens) + (self.kv.window is not None)
        if needed > self.kv.pool.num_blocks:  # could never run, even alone
            raise InvalidRequestError(
                f"{len(ids)} prompt tokens plus max_tokens={params.max_tokens} need {needed} KV "
                f"blocks; the cache has only {self.kv.pool.num_blocks}", param="max_tokens")

    def generate(self, req: WorkerRequest) -> None:
        """Queue a request (its `params.n` samples). Raises `InvalidRequestError` and leaves
        nothing behind when the input is bad."""
        request_id, params, cache_salt = req.request_id, req.params, req.cache_salt
        if request_id in self._samples:
            raise InvalidRequestError(f"request id {request_id!r} is already running",
                                      param="request_id")
        ids = list(req.prompt_token_ids)
        self._validate(ids, params)
        reqs = []
        for i in range(params.n):
            sample = Request(_sample_id(request_id, params.n, i), ids, _sample_params(params, i),
                             self.eos_token_ids, cache_salt=cache_salt)
            self._constrain(sample, ())
            reqs.append(sample)
        for i, sample in enumerate(reqs):
            self.outputs.add(sample, request_id, i)
        self._samples[request_id] = [r.request_id for r in reqs]
        self.scheduler.add(reqs[0])
        if len(reqs) > 1:
            # siblings join once sample 0 has computed the prompt, then hit its cached blocks
            self._forks[reqs[0].request_id] = reqs[1:]

    def abort(self, request_id: str) -> bool:
        """Cancel every sample of a request and free its blocks. False for unknown ids."""
        sample_ids = self._samples.pop(request_id, None)
        if sample_ids is None:
            return False
        for sid in sample_ids:
            self.scheduler.finish(sid, FinishReason.ABORT)
            self.outputs.remove(sid)
        self._forks.pop(sample_ids[0], None)
        return True

    def has_unfinished(self) -> bool:
        """True while a request can make progress in `step()` (requests waiting for remote
        KV cannot, so they leave the step loop idle), or a step's events are still to come."""
        return self.scheduler.has_unfinished() or (
            self.async_steps is not None and self.async_steps.busy)

    def _settle(self) -> None:
        """Under async scheduling, process the step in flight now (its events come out of the
        next `step()`): before KV leaves or enters the cache outside the device's step order,
        or a request's computed state is read."""
        if self.async_steps is not None:
            self.async_steps.drain()

    # ---- the step --------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """Run one step; the token events it produced. Under async scheduling: launch the next
        step and return the events of the one before (`workers.engine.async_step`)."""
        if self.async_steps is not None:
            return self.async_steps.step()
        out = self.scheduler.schedule()
        if out is None or out.is_empty:
            return []
        start = time.perf_counter()
        result = self.runner.execute(out)
        self.costs.record_step(time.perf_counter() - start, self.runner.executor.last_tier_copy_s,
                               out.block_copies, out.num_batched_tokens, out.num_decodes)
        return self._emit(out, result, self.scheduler.update)

    def _emit(self, out: SchedulerOutput, result: RunnerOutput, record: Recorder,
              ) -> list[TokenEvent]:
        """A step's host work: prompt logprobs, `record` (the scheduler's `update`, or its
        `record` under async scheduling), grammars, stop strings, events, and the siblings an
        n > 1 request's first token lets in."""
        for rid, (first, logprobs) in result.prompt_logprobs.items():
            req = self.scheduler.requests.get(rid)
            if req is not None:  # else aborted while its step ran (async scheduling)
                req.prompt_logprobs[first:first + len(logprobs)] = logprobs
        events: list[TokenEvent] = []
        for req in record(out, result.sampled):
            if req.grammar is not None:
                self._advance_grammar(req)
            stop = self.outputs.find_stop_string(req)
            if stop is not None and not req.is_finished:
                req.stop_reason = stop
                self.scheduler.finish(req.request_id, FinishReason.STOP)
            event = self.outputs.event(req, result.logprobs.get(req.request_id))
            if event is not None:
                events.append(event)
            if req.is_finished:
                self._retire(event.request_id, req.request_id)
            for sibling in self._forks.pop(req.request_id, ()):
                self.scheduler.add(sibling)
        return events

    def _advance_grammar(self, req: Request) -> None:
        """Feed a constrained sample's new token to its matcher; a grammar that is complete
        (its stop token accepted, even under ignore_eos) ends the request."""
        if req.is_finished:
            return  # its matcher is not used again (a continuation rebuilds its own)
        matcher = req.grammar
        accepted = matcher.accept_token(req.output_token_ids[-1])  # type: ignore[attr-defined]
        if not accepted:  # the mask forbids it: only a bug gets here
            logger.error("request %s sampled token %d outside its grammar", req.request_id,
                         req.output_token_ids[-1])
        if not accepted or matcher.is_terminated():  # type: ignore[attr-defined]
            self.scheduler.finish(req.request_id, FinishReason.STOP)

    def _retire(self, parent_id: str, sample_id: str) -> None:
        remaining = [s for s in self._samples.get(parent_id, ()) if s != sample_id]
        if remaining:
            self._samples[parent_id] = remaining
        else:
            self._samples.pop(parent_id, None)

    # ---- observability and the transfer layer's hooks ----------------------------------------

    def stats(self) -> EngineStats:
        """The engine's load now, from the scheduler's and the block pool's own counters (O(1),
        no scan). Call it on the step thread, between steps: the async engine does after each
        step and publishes the copy for other threads."""
        sched, pool = self.scheduler, self.kv.pool
        return EngineStats(len(sched.waiting), len(sched.running), pool.usage,
                           pool.num_free_blocks, pool.num_cached_blocks, pool.num_blocks,
                           len(sched.waiting_for_kv), sched.num_pending_prompt_tokens,
                           self.costs.host_hit_cost if self.kv.host is not None else 0.0,
                           self.costs.prefill_s_per_token or 0.0, self.kv_pull_bytes_per_s,
                           kv_fetch_fixed_s=self.kv_fetch_fixed_s,
                           recent_hit_blocks=self.kv.hot.recent_hit_blocks(),
                           num_prompt_tokens_computed=self.costs.num_prompt_tokens_computed)

    def drain_kv_events(self) -> list[KVEvent]:
        return self.kv.events.drain()

    def kv_snapshot(self) -> KVSnapshot:
        """The prefix cache's hashes, consistent with the events emitted so far."""
        host = self.kv.host
        return KVSnapshot(self.kv.events.epoch, self.kv.events.next_seq,
                          frozenset(self.kv.pool.cached_hashes()),
                          frozenset(host.cached_hashes()) if host is not None else frozenset())

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return self.runner.spec

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """Per layer `[2, num_blocks, block_size, num_kv_heads, head_dim]` (TP = 1 only)."""
        return self.runner.kv_caches

    def kv_caches_by_rank(self) -> list[list[torch.Tensor]]:
        """Per tensor-parallel rank, per layer: that rank's heads of the KV cache."""
        return self.runner.executor.kv_caches_by_rank()

    def kv_agent_hosts(self) -> list[AgentHostAddress] | None:
        """Per TP rank, where that rank's own transfer agent is hosted (a worker group's
        ranks serve their shards); None: this process's agents serve `kv_caches_by_rank()`."""
        return self.runner.executor.agent_hosts()

    def kv_layouts(self) -> list[KVLayout]:
        """The transfer layer's view of each TP rank's cache (one agent per rank)."""
        from kvtransfer import KVLayout

        by_rank = self.kv_caches_by_rank()
        return [KVLayout.from_caches(caches, tp_rank=r, tp_size=len(by_rank))
                for r, caches in enumerate(by_rank)]

    def block_ids(self, request_id: str) -> list[int]:
        """Block ids holding a (single-sample) request's KV, in token order."""
        return self.kv.block_ids(request_id)

    # ---- the KV handoff: prefill side ------------------------------------------------------

    def prefill(self, req: WorkerRequest) -> None:
        """Queue the prompt of a request another worker will decode: it samples the first token
        only (with `req.params`), then its blocks are held for the KV handoff until `free_held`
        (an abort frees them at once). Validated against the whole request. n must be 1."""
        request_id, params = req.request_id, req.params
        if params.n != 1:
            raise InvalidRequestError(f"n must be 1 for a prefill-only request, got {params.n}",
                                      param="n")
        if request_id in self._samples or self.kv.held_block_ids(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already running or held",
                                      param="request_id")
        ids = list(req.prompt_token_ids)
        self._validate(ids, params)
        first_only = dataclasses.replace(params, max_tokens=1,
                                         min_tokens=min(params.min_tokens, 1))
        # max_tokens=1: the whole request, nothing to hand off
        sample = Request(request_id, ids, first_only, self.eos_token_ids,
                         cache_salt=req.cache_salt, hold_kv=params.max_tokens > 1)
        self._constrain(sample, ())
        self.outputs.add(sample, request_id, 0)
        self._samples[request_id] = [request_id]
        self.scheduler.add(sample)

    # ---- a prefix pulled from another worker (either side) -----------------------------------

    def export_prefix(self, hold_id: str, block_hashes: Sequence[int]) -> list[int]:
        """Hold the device blocks of the leading `block_hashes` this prefix cache has (up to the
        first miss) for another worker to pull, until `free_held(hold_id)`; their ids."""
        self._settle()
        return self.kv.hold_prefix(hold_id, block_hashes)

    def hot_prefixes(self, max_blocks: int) -> list[HotPrefix]:
        """The prefixes requests hit here lately, most worth first, still in the device pool,
        within `max_blocks` in all (what a worker leaving the pool hands to the others)."""
        pool = self.kv.pool
        return self.kv.hot.top(max_blocks, lambda h: pool.lookup(h) is not None)

    def reserve_prefix(self, hold_id: str, num_blocks: int) -> list[int]:
        """Fresh blocks for a pulled prefix, held until `land_prefix` or `free_held`. Raises
        `KVCacheFull` (nothing held) when they are not free."""
        self._settle()
        block_ids = self.kv.reserve(hold_id, num_blocks)
        if block_ids is None:
            raise KVCacheFull(f"no {num_blocks} KV blocks free for the prefix of {hold_id!r}")
        return block_ids

    def land_prefix(self, hold_id: str, block_hashes: Sequence[int],
                    token_ids: Sequence[int]) -> None:
        """The reserved blocks hold the prefix `token_ids` (hashing to `block_hashes`): they
        join the prefix cache, so the request sent next finds them."""
        self.kv.cache_reserved(hold_id, block_hashes, token_ids)

    def held_block_ids(self, request_id: str) -> list[int]:
        """Blocks of a finished prefill-only request, in token order ([] when none are held)."""
        return self.kv.held_block_ids(request_id)

    def free_held(self, request_id: str) -> bool:
        """The handoff is over (pulled, cancelled or expired): free the held blocks."""
        return self.kv.free_held(request_id)

    # ---- the KV handoff and continuations: decode side ---------------------------------------

    def _continuations(self, req: WorkerRequest, samples: Sequence[Continuation],
                       with_kv: bool) -> list[Request]:
        """The validated samples of a request continued here after the output other workers
        sampled and streamed (each holds the first of its sent tokens; the rest join in
        `_replay`); `with_kv`: each brings the KV of some of its tokens. Registered nowhere
        yet. max_tokens, min_tokens and penalties count the sent tokens as output."""
        request_id, params = req.request_id, req.params
        indexes = [c.index for c in samples]
        if not samples or len(set(indexes)) != len(indexes) or not all(
                0 <= i < params.n for i in indexes):
            raise InvalidRequestError(f"a continuation of samples {indexes}: expected distinct "
                                      f"indexes in [0, n={params.n})", param="samples")
        if request_id in self._samples:
            raise InvalidRequestError(f"request id {request_id!r} is already running",
                                      param="request_id")
        ids = list(req.prompt_token_ids)
        self._validate(ids, params)
        vocab = self.model_config.vocab_size
        out = []
        for c in samples:
            sent = c.sent_token_ids
            if not 1 <= len(sent) < params.max_tokens:
                raise InvalidRequestError(
                    f"a continued request needs between 1 and max_tokens-1="
                    f"{params.max_tokens - 1} tokens already sent, got {len(sent)}",
                    param="max_tokens")
            bad = [t for t in sent if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"sent token ids outside [0, {vocab}): {bad[:5]}",
                                          param="sent_token_ids")
            total = len(ids) + len(sent)
            if with_kv and not 0 < c.num_kv_tokens < total:
                raise InvalidRequestError(
                    f"the KV of {c.num_kv_tokens} tokens of a {total}-token continuation: "
                    "expected at least 1 and fewer than all (the last is computed here)",
                    param="num_kv_tokens")
            sample = Request(_sample_id(request_id, params.n, c.index), ids,
                             _sample_params(params, c.index), self.eos_token_ids,
                             cache_salt=req.cache_salt)
            self._constrain(sample, sent)
            sample.append_output(sent[0])
            out.append(sample)
        return out

    def _constrain(self, sample: Request, sent_token_ids: Sequence[int]) -> None:
        """Give a structured-output sample its grammar matcher, at the state after the tokens
        already sent (compiled here unless the async engine compiled it off the step thread)."""
        spec = sample.params.structured
        if spec is not None:
            sample.grammar = self.grammars.matcher(spec, sent_token_ids)

    def _replay(self, parent_id: str, index: int, sample: Request,
                sent_token_ids: Sequence[int]) -> None:
        """Track a continued sample, priming its detokenizer and stop-string state with the
        tokens already sent: the first as a prefill worker sends it (whole), the rest as a
        decoding worker streams them, one a step, so the text sent so far matches to the
        character.

        NOTE: with stop strings, text a worker held back at the first token (a possible stop
        string's start; an aggregated worker does, a prefill worker does not) is not resent."""
        self.outputs.add(sample, parent_id, index)
        for token_id in sent_token_ids[1:]:
            sample.append_output(token_id)
            self.outputs.find_stop_string(sample)
            self.outputs.event(sample, None)
        self._samples.setdefault(parent_id, []).append(sample.request_id)

    def decode_from_handoff(self, req: WorkerRequest, first_token_id: int) -> list[int]:
        """Allocate blocks for a prompt whose KV another worker computed; returns the block ids
        to fill. The request waits for its KV (no step schedules it) until `kv_landed`, then
        decodes after `first_token_id` (already sent to the client by that worker). `abort`
        frees it. Raises `KVCacheFull` (nothing allocated) when the blocks are not free."""
        c = Continuation(0, [first_token_id], len(req.prompt_token_ids))
        return self.continue_with_kv(req, [c])[0]

    def continue_with_kv(self, req: WorkerRequest,
                         samples: Sequence[Continuation]) -> dict[int, list[int]]:
        """The continuation of a request's `samples`, each after its sent tokens, whose first
        `num_kv_tokens` tokens' KV another worker computed: blocks are allocated for them, and
        each sample's block ids to fill returned by index, but for blocks already filled and
        held under its `hold_id` (a live migration's first pull), which it takes first. They
        wait (no step schedules them) until `kv_landed`, then compute the tokens after that
        KV. `abort` frees them. Raises `KVCacheFull` (nothing kept, the held blocks freed)."""
        self._settle()
        rid = req.request_id
        try:
            conts = self._continuations(req, samples, with_kv=True)
        except InvalidRequestError:
            for c in samples:
                if c.hold_id is not None:
                    self.kv.free_held(c.hold_id)
            raise
        to_fill: dict[int, list[int]] = {}
        for i, (c, sample) in enumerate(zip(samples, conts)):
            if c.hold_id is not None:
                self.kv.adopt(c.hold_id, sample.request_id)
            filled = len(self.kv.block_ids(sample.request_id))
            if not self.scheduler.add_waiting_for_kv(sample, c.num_kv_tokens):
                self.kv.free(sample)
                self.abort(rid)  # the samples added before
                for later in samples[i + 1:]:
                    if later.hold_id is not None:
                        self.kv.free_held(later.hold_id)
                raise KVCacheFull(f"no KV blocks free for the {c.num_kv_tokens}-token handoff "
                                  f"of {rid!r}")
            self._replay(rid, c.index, sample, c.sent_token_ids)
            to_fill[c.index] = self.kv.block_ids(sample.request_id)[filled:]
        return to_fill

    # ---- a live migration's source side -------------------------------------------------------

    def export_running(self, request_id: str,
                       hold_id: Callable[[int], str]) -> dict[int, list[int]]:
        """Hold the full blocks of each sample's computed tokens of a running request (which it
        never writes again) for a live migration's target to pull while the request decodes on
        here, until `free_held(hold_id(index))`; their ids by sample index."""
        self._settle()
        bs = self.config.block_size
        return {index: self.kv.hold_leading(hold_id(index), sample.request_id,
                                            sample.num_computed_tokens // bs)
                for index, sample in self._running_samples(request_id)}

    def pause(self, request_id: str) -> list[PausedHere]:
        """Stop a running request here, between steps and with no further event, keeping each
        sample's blocks held until `free_held(sample_id)`: per sample still running, its
        output tokens so far, how many of its tokens' KV its blocks hold, and their ids (a live
        migration's target pulls what it lacks and continues)."""
        self._settle()
        paused = []
        for index, sample in self._running_samples(request_id):
            sid = sample.request_id
            tokens, num_kv = list(sample.output_token_ids), sample.num_computed_tokens
            self.scheduler.finish(sid, FinishReason.ABORT, hold=True)
            self.outputs.remove(sid)
            paused.append(PausedHere(index, sid, tokens, num_kv, self.kv.held_block_ids(sid)))
        self._samples.pop(request_id, None)
        return paused

    def _running_samples(self, request_id: str) -> list[tuple[int, Request]]:
        """A running request's unfinished samples, by index; each must have output."""
        sample_ids = self._samples.get(request_id)
        if not sample_ids:
            raise InvalidRequestError(f"request {request_id!r} is not running here",
                                      param="request_id")
        samples = [self.scheduler.requests.get(sid) for sid in sample_ids]
        if any(s is None or s.status is RequestStatus.WAITING_FOR_REMOTE_KV
               or not s.output_token_ids for s in samples):
            raise InvalidRequestError(f"request {request_id!r} has a sample with no output yet",
                                      param="request_id")
        return [(self.outputs.index(s.request_id), s) for s in samples]  # type: ignore[union-attr]

    def kv_landed(self, request_id: str) -> None:
        """The handed-off KV has landed in the request's blocks: start decoding it. KeyError
        when the request is not waiting for its KV."""
        for sid in self._samples.get(request_id, [request_id]):
            self.scheduler.kv_landed(sid)

    def resume(self, req: WorkerRequest, samples: Sequence[Continuation]) -> None:
        """Queue a request's `samples`, whose first output tokens other workers sampled (and
        sent) but whose KV is not here (a failed KV pull, or a decode worker lost mid-stream):
        the prompt and those tokens are computed here, then each decodes on from its next
        token. Greedy and seeded output equal an uninterrupted run (a seeded draw depends only
        on the seed, the sample's index and the output position)."""
        conts = self._continuations(req, samples, with_kv=False)
        for c, sample in zip(samples, conts):
            self._replay(req.request_id, c.index, sample, c.sent_token_ids)
            self.scheduler.add(sample)


@dataclasses.dataclass(frozen=True)
class PausedHere:
    """A sample `Engine.pause` stopped: its blocks are held under `sample_id`."""

    index: int
    sample_id: str
    output_token_ids: list[int]
    num_kv_tokens: int
    block_ids: list[int]


def _sample_id(request_id: str, n: int, index: int) -> str:
    """The engine's id of a request's sample: the request's own when it has one."""
    return request_id if n == 1 else f"{request_id}/{index}"


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """A sample's own parameters: one sample, its own seed, prompt logprobs with sample 0."""
    if params.n == 1:
        return params
    return dataclasses.replace(
        params, n=1, seed=None if params.seed is None else sample_seed(params.seed, index),
        prompt_logprobs=params.prompt_logprobs if index == 0 else None)
