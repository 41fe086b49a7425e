"""The inference engine: requests in, token events out, one `step()` at a time.

Three verbs: `generate` (add a request, taking the `WorkerRequest` record whole), `abort` and
`step`. Not thread-safe: one caller drives them (the async engine serialises them for you). How
the engine is built from its config (model, KV budget, executor) is `workers.engine.assembly`;
how a request is validated and split into samples, `workers.engine.intake`.

What moves KV to or from another worker (a KV handoff's halves, prefix exports, live migration,
continuations) is not here: a worker's connector (`workers.serving.connector`) builds those
verbs on the narrow interface the section "a connector's interface" below gives it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from workers.engine import adapters, assembly
from workers.engine.async_step import AsyncStepper, Recorder
from workers.engine.config import EngineConfig
from workers.engine.grammar import Grammars
from workers.engine.intake import Intake
from workers.engine.kv_cache import KVCacheManager
from workers.engine.load import engine_stats
from workers.models.dtypes import resolve_dtype
from workers.models.model_config import ModelConfig
from workers.engine.output_processor import OutputProcessor
from workers.engine.parallel.validate import check_parallel
from workers.contract.protocol import (
    EngineStats,
    FinishReason,
    InvalidRequestError,
    TokenEvent,
    WorkerRequest,
)
from workers.contract.prefix_cache import KVEvent
from workers.engine.request import Request
from workers.engine.runner import KVCacheSpec, ModelRunner, RunnerOutput
from workers.engine.scheduler import Scheduler
from workers.engine.scheduler_records import SchedulerConfig, SchedulerOutput
from workers.engine.speculative.grammar_draft import advance
from workers.engine.step_costs import StepCosts

if TYPE_CHECKING:
    from kvtransfer import AgentHostAddress
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
        # GPUs are counted only for ranks spawned here, sharing this process's view: other
        # launchers' ranks (Ray actors) each hold a GPU this process may not see, placed by Ray
        check_parallel(config, mc, torch.cuda.device_count()
                       if self.device.type == "cuda" and assembly.spawns_ranks(rank_launcher)
                       else None)
        if self.device.type == "cuda" and self.device.index is not None and config.world_size == 1:
            torch.cuda.set_device(self.device)  # Triton launches on the current device
        spec = assembly.kv_cache_spec(config, mc, self.dtype)  # of 1 block: sized below
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
        self.scheduler = Scheduler(SchedulerConfig.of(config, self.max_model_len), self.kv)
        self.runner = ModelRunner(executor, spec, self.device, seed=config.seed,
                                  num_microbatches=config.pipeline_microbatches
                                  or config.pipeline_parallel_size,
                                  vocab_size=mc.vocab_size,
                                  sample_on_ranks=config.speculative is None)
        self.adapters = adapters.attach_adapters(config, model, self.runner, self.scheduler)
        self.outputs = OutputProcessor(self.tokenizer, detokenize)
        self.speculator = assembly.speculator(config, mc, self.tokenizer, self.dtype,
                                              self.max_model_len, self.runner, self.kv)
        self.eos_token_ids = frozenset(mc.eos_token_ids) | (
            self.tokenizer.eos_token_ids if self.tokenizer is not None else frozenset())
        self.grammars = Grammars(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        self.intake = Intake(mc.vocab_size, self.max_model_len, config.max_num_batched_tokens,
                             self.kv, self.eos_token_ids, self.grammars, self.adapters)
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

    def generate(self, req: WorkerRequest) -> None:
        """Queue a request (its `params.n` samples). Raises `InvalidRequestError` and leaves
        nothing behind when the input is bad."""
        request_id, params = req.request_id, req.params
        if request_id in self._samples:
            raise InvalidRequestError(f"request id {request_id!r} is already running",
                                      param="request_id")
        self.intake.validate(list(req.prompt_token_ids), params)
        reqs = [self.intake.sample(req, i) for i in range(params.n)]
        for i, sample in enumerate(reqs):
            self.track(request_id, i, sample)
        self.scheduler.add(reqs[0])
        if len(reqs) > 1:
            # siblings join once sample 0 has computed the prompt, then hit its cached blocks
            self._forks[reqs[0].request_id] = reqs[1:]

    def abort(self, request_id: str, *, keep_blocks: bool = False) -> bool:
        """Cancel every sample of a request and free its blocks (`keep_blocks`: hold each
        sample's in the ledger under its sample id instead, as a live migration's source
        does). False for unknown ids."""
        sample_ids = self._samples.pop(request_id, None)
        if sample_ids is None:
            return False
        for sid in sample_ids:
            self.scheduler.finish(sid, FinishReason.ABORT, hold=keep_blocks or None)
            self.outputs.remove(sid)
        self._forks.pop(sample_ids[0], None)
        return True

    def has_unfinished(self) -> bool:
        """True while a request can make progress in `step()` (requests waiting for remote
        KV cannot, so they leave the step loop idle), or a step's events are still to come."""
        return self.scheduler.has_unfinished() or (
            self.async_steps is not None and self.async_steps.busy)

    # ---- the step --------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """Run one step; the token events it produced. Under async scheduling: launch the next
        step and return the events of the one before (`workers.engine.async_step`)."""
        if self.async_steps is not None:
            return self.async_steps.step()
        self.speculator.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        if out is None or out.is_empty:
            return []
        start = time.perf_counter()
        result = self.runner.execute(out)
        self.costs.record_step(time.perf_counter() - start, self.runner.executor.last_tier_copy_s,
                               out.block_copies, out.num_batched_tokens, out.num_decodes)
        return self._emit(out, result,
                          lambda o, s: self.scheduler.update(o, s, result.accepted))

    def _emit(self, out: SchedulerOutput, result: RunnerOutput, record: Recorder,
              ) -> list[TokenEvent]:
        """A step's host work: prompt logprobs, `record` (the scheduler's `update`, or its
        `record` under async scheduling), grammars, stop strings, events, and the siblings an
        n > 1 request's first token lets in."""
        for rid, (first, logprobs) in result.prompt_logprobs.items():
            req = self.scheduler.requests.get(rid)
            # None: aborted while its step ran (async scheduling); a request whose prompt
            # logprobs the step computed asked for them, so it has their list
            if req is not None and req.prompt_logprobs is not None:
                req.prompt_logprobs[first:first + len(logprobs)] = logprobs
        events: list[TokenEvent] = []
        for req in record(out, result.sampled):
            if req.grammar is not None:
                self._advance_grammar(req, 1 + len(result.accepted.get(req.request_id, ())))
            stop = self.outputs.find_stop_string(req)
            if stop is not None and not req.is_finished:
                req.stop_reason = stop
                self.scheduler.finish(req.request_id, FinishReason.STOP)
            event = self.outputs.event(req, result.new_logprobs(req.request_id))
            if event is not None:  # always, for a finished sample
                events.append(event)
                if req.is_finished:
                    self._retire(event.request_id, req.request_id)
            for sibling in self._forks.pop(req.request_id, ()):
                self.scheduler.add(sibling)
        return events

    def _advance_grammar(self, req: Request, num_new: int) -> None:
        """Feed a constrained sample's `num_new` new tokens (a verified draft's accepted ones,
        then the one sampled after them) to its matcher; a grammar that is complete (its stop
        token accepted, even under ignore_eos) ends the request."""
        if req.is_finished:
            return  # its matcher is not used again (a continuation rebuilds its own)
        matcher: Any = req.grammar  # xgrammar's matcher (held as an object: not imported here)
        accepted = advance(matcher, req.output_token_ids[-num_new:])
        if not accepted:  # the mask forbids it: only a bug gets here
            logger.error("request %s sampled tokens %s outside its grammar", req.request_id,
                         req.output_token_ids[-num_new:])
        if not accepted or matcher.is_terminated():
            self.scheduler.finish(req.request_id, FinishReason.STOP)

    def _retire(self, parent_id: str, sample_id: str) -> None:
        remaining = [s for s in self._samples.pop(parent_id, ()) if s != sample_id]
        if remaining:
            self._samples[parent_id] = remaining

    # ---- observability and the caches' tensors ------------------------------------------------

    def stats(self) -> EngineStats:
        """The engine's load now (`workers.engine.load`). Call it on the step thread, between
        steps: the async engine does after each step and publishes the copy for other threads."""
        return engine_stats(self.scheduler, self.kv, self.costs, self.speculator.method,
                            self.kv_pull_bytes_per_s, self.kv_fetch_fixed_s,
                            self.adapters.resident(), self.adapters.num_loads())

    def drain_kv_events(self) -> list[KVEvent]:
        return self.kv.events.drain()

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

    def block_ids(self, request_id: str) -> list[int]:
        """Block ids holding a (single-sample) request's KV, in token order."""
        return self.kv.block_ids(request_id)

    # ---- a connector's interface (`workers.serving.connector`) ----------------------------------

    def settle(self) -> None:
        """Under async scheduling, process the step in flight now (its events come out of the
        next `step()`): before KV leaves or enters the cache outside the device's step order,
        or a request's computed state is read."""
        if self.async_steps is not None:
            self.async_steps.drain()

    def sample_ids(self, request_id: str) -> list[str]:
        """The engine's ids of a request's samples not finished yet ([] when none)."""
        return list(self._samples.get(request_id, ()))

    def track(self, parent_id: str, index: int, sample: Request,
              sent_token_ids: Sequence[int] = ()) -> None:
        """Make `sample` (from `intake`) sample `index` of request `parent_id`: `step` emits
        its events, `abort(parent_id)` ends it; the caller queues it. A continued sample's
        detokenizer and stop-string state are primed with the tokens already sent: the first
        (appended already) whole, as a prefill worker sends it, the rest one a step, as a
        decoding worker streams them, so the text sent so far matches to the character.

        NOTE: with stop strings, text a worker held back at the first token (a possible stop
        string's start; an aggregated worker does, a prefill worker does not) is not resent."""
        self.outputs.add(sample, parent_id, index)
        for token_id in sent_token_ids[1:]:
            sample.append_output(token_id)
            self.outputs.find_stop_string(sample)
            self.outputs.event(sample)
        self._samples.setdefault(parent_id, []).append(sample.request_id)
