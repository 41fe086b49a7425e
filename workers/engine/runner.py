"""Turns a scheduled step into one `StepMessage`, has an executor run the model, and samples.

A worker group samples on its last rank instead (`workers.engine.parallel.sampling`): the
message then carries a `SamplingRecord` and the tokens come back, not the logits.

The executor (in this process, or a group of tensor/pipeline-parallel ranks) owns the KV-cache
tensors: per layer `[2, num_blocks, block_size, num_kv_heads, head_dim]`, indexed by the block
ids the KV-cache manager hands out.

`execute` runs a step start to finish. Async scheduling (`workers.engine.async_step`) splits it:
`launch` queues the step's device work and starts its tokens' copy to the host without waiting,
taking the input of each placeholder decode from the previous launched step's tokens on the
device; `collect` waits for the copy. Only an executor in this process (`LocalExecutor`) takes
such inputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.kernels.host_transfer import PendingDownload, start_download, upload
from workers.engine.kv_cache import host_memory
from workers.engine.kv_cache.spec import KVCacheSpec
from workers.engine.parallel.executor import LocalExecutor, ModelExecutor, SamplingExecutor
from workers.engine.parallel.messages import PromptLogprobRows, StepMessage
from workers.engine.parallel.sampling import SamplingSync
from workers.engine.request import Request
from workers.engine.sampler import DeviceSample, Sampler, SamplerOutput, top_logprobs
from workers.engine.scheduler_records import ScheduledChunk, SchedulerOutput, prompt_logprob_rows
from workers.engine.runner_output import RunnerOutput, record_sampled
from workers.engine.speculative.rejection import Verification
from workers.engine.speculative.verify import sampling_rows
from workers.engine.step_inputs import TokenFill
from workers.models.lora import SlotTable, SlotWrite


@dataclass
class Launched:
    """A step whose device work is queued and whose sampled tokens are on their way to the
    host (`ModelRunner.launch`); `collect` it once."""

    out: SchedulerOutput
    sampling: list[Request]  # the requests whose chunk samples, in the order of `rows`
    rows: dict[str, int]  # request id -> its row of `drawn.tokens`
    drawn: DeviceSample | None  # None: nothing samples
    pending: PendingDownload | None
    result: RunnerOutput  # the prompt logprobs (computed at launch), then the tokens
    started: float  # perf_counter at launch
    tier_copy_s: float  # of the step's KV copies between the cache's tiers


@dataclass(frozen=True)
class _Batch:
    msg: StepMessage
    sampling: list[Request]  # the rows that sample, in chunk order (k + 1 for a draft of k)
    drafts: dict[int, tuple[int, ...]]  # a verifying request's first row of `sampling` -> draft
    verifications: list[Verification]  # the drafts with probabilities (rejection-sampled)
    prompt_rows: list[tuple[ScheduledChunk, int, int]]  # (chunk, first row, num rows)


def allocate_kv_caches(spec: KVCacheSpec, device: torch.device) -> list[torch.Tensor]:
    """Per layer `[2, num_blocks, block_size, num_kv_heads, head_dim]` (a latent: `[1, ...]`),
    zeroed; on the host backed by huge pages (faster same-node KV handoffs:
    `workers.engine.kv_cache.host_memory`)."""
    shape = (spec.planes, spec.num_blocks, spec.block_size, spec.num_kv_heads,
             spec.cache_head_dim)
    return [host_memory.zeros(shape, spec.dtype, device) for _ in range(spec.num_layers)]


class ModelRunner:
    """`num_microbatches`: pipeline micro-batches per step (1 without pipeline parallelism);
    `vocab_size`: the logits' width (a group's structured-output masks need it)."""

    def __init__(self, executor: ModelExecutor, spec: KVCacheSpec, device: torch.device,
                 seed: int = 0, num_microbatches: int = 1, vocab_size: int = 0,
                 sample_on_ranks: bool = True) -> None:
        self.executor = executor
        self.spec = spec
        self.device = device
        self.num_microbatches = num_microbatches
        self.vocab_size = vocab_size
        self.sampler = Sampler(seed, device)
        # the ranks' mirrors of the requests where the executor samples (a group, unless
        # `sample_on_ranks` is False: speculation verifies drafts here); None: the logits come
        # here and `sampler` samples them (a group can do either: tests compare)
        self.sync = (SamplingSync(vocab_size)
                     if sample_on_ranks and isinstance(executor, SamplingExecutor) else None)
        self._step_id = 0
        # which adapter is in which of the model's LoRA slots, set by the engine when it
        # serves adapters
        self.adapters: SlotTable | None = None
        # called with each step after its forward, before sampling (a draft reading the
        # target's hidden states: workers.engine.speculative.mtp)
        self.after_forward: Callable[[SchedulerOutput], None] | None = None

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """Per layer, when one rank holds every head (TP=1)."""
        by_rank = self.executor.kv_caches_by_rank()
        if len(by_rank) != 1:
            raise RuntimeError(
                f"the KV cache is split over {len(by_rank)} tensor-parallel ranks; use "
                "kv_caches_by_rank() with one transfer agent per rank")
        return by_rank[0]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        with device_guard(self.device):  # the step may run on any thread (AsyncEngine's)
            return self._execute(out)

    def _execute(self, out: SchedulerOutput) -> RunnerOutput:
        batch = self._prepare(out)
        if self.sync is not None:
            return self._execute_sampled(batch)
        logits = self.executor.execute(batch.msg).to(self.device)  # [len(logit_rows), vocab]
        if self.after_forward is not None:
            self.after_forward(out)
        result = RunnerOutput()
        sampling = batch.sampling
        if sampling:
            record_sampled(result, sampling, self.sampler(
                logits[:len(sampling)], sampling, batch.verifications), batch.drafts)
        self._prompt_logprobs(result, batch, logits)
        return result

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, prev: Launched | None) -> Launched:
        """Queue the step on the device and start its tokens' copy back; the host does not
        wait (but for prompt logprobs, read here). Placeholder decodes (input position = the
        request's token count) take `prev`'s sampled token for their request."""
        started = time.perf_counter()
        with device_guard(self.device):
            batch = self._prepare(out)
            fill = self._token_fill(out, batch.msg.num_decodes, prev)
            if not isinstance(self.executor, LocalExecutor):
                raise RuntimeError(f"{type(self.executor).__name__} cannot launch a step "
                                   "asynchronously: only a LocalExecutor takes device inputs")
            self.executor.token_fill = fill
            try:
                logits = self.executor.execute(batch.msg)
            finally:
                self.executor.token_fill = None
            sampling = batch.sampling
            drawn = self.sampler.sample(logits[:len(sampling)], sampling) if sampling else None
            result = RunnerOutput()
            self._prompt_logprobs(result, batch, logits)
            return Launched(out, sampling, {r.request_id: i for i, r in enumerate(sampling)},
                            drawn, None if drawn is None else start_download(drawn.packed),
                            result, started, self.executor.last_tier_copy_s)

    @staticmethod
    def collect(launched: Launched) -> RunnerOutput:
        """Wait for a launched step's tokens (the step's one host synchronisation)."""
        result = launched.result
        if launched.drawn is not None and launched.pending is not None:
            record_sampled(result, launched.sampling,
                            Sampler.read(launched.drawn, launched.pending.wait()))
        return result

    def _token_fill(self, out: SchedulerOutput, num_decodes: int,
                    prev: Launched | None) -> TokenFill | None:
        """Where placeholder decodes' input ids come from on the device: `prev`'s tokens."""
        holes = [(row, c.request.request_id) for row, c in enumerate(out.chunks[:num_decodes])
                 if c.start == c.request.num_tokens]
        if not holes:
            return None
        if prev is None or prev.drawn is None or any(r not in prev.rows for _, r in holes):
            raise RuntimeError(f"placeholder decodes {[r for _, r in holes]} without a launched "
                               "step that samples their tokens")
        n = len(holes)
        staged = upload([*(row for row, _ in holes), *(prev.rows[r] for _, r in holes)],
                        self.device)
        return TokenFill(staged[:n], prev.drawn.tokens.index_select(0, staged[n:]))

    def _prompt_logprobs(self, result: RunnerOutput, batch: _Batch,
                         logits: torch.Tensor) -> None:
        """The prompt logprobs of the batch's prompt rows (after its sampling rows) into
        `result`: a host read of their own."""
        row = len(batch.sampling)
        for chunk, _, count in batch.prompt_rows:
            req = chunk.request
            targets = req.all_token_ids[chunk.start + 1:chunk.start + 1 + count]
            logprobs = logits[row:row + count].log_softmax(-1)
            row += count
            result.prompt_logprobs[req.request_id] = (chunk.start + 1, top_logprobs(
                logprobs, upload(targets, self.device), req.params.prompt_logprobs or 0))

    def _execute_sampled(self, batch: _Batch) -> RunnerOutput:
        """The step on an executor that samples (the group's last rank): tokens come back."""
        prompt = [PromptLogprobRows(
            tuple(chunk.request.all_token_ids[chunk.start + 1:chunk.start + 1 + count]),
            chunk.request.params.prompt_logprobs or 0) for chunk, _, count in batch.prompt_rows]
        # a runner has `sync` exactly when its executor samples (see __init__)
        record = self.sync.record(  # type: ignore[union-attr]  # set: its executor samples
            batch.sampling, prompt)
        executor: SamplingExecutor = self.executor  # type: ignore[assignment]  # it samples
        sampled = executor.execute_sampled(dataclasses.replace(batch.msg, sampling=record))
        result = RunnerOutput()
        record_sampled(result, batch.sampling,
                        SamplerOutput(list(sampled.token_ids), list(sampled.logprobs)))
        for (chunk, _, _), logprobs in zip(batch.prompt_rows, sampled.prompt_logprobs):
            result.prompt_logprobs[chunk.request.request_id] = (chunk.start + 1, list(logprobs))
        return result

    def _prepare(self, out: SchedulerOutput) -> _Batch:
        """The step's flat inputs, in one pass over the chunks: a decode (one token) appends
        one entry to each list, a prefill chunk slices and ranges."""
        block_size = self.spec.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sampling: list[Request] = []
        prompt_rows: list[tuple[ScheduledChunk, int, int]] = []
        row = num_decodes = 0
        drafts: dict[int, tuple[int, ...]] = {}
        verifications: list[Verification] = []
        for chunk in out.chunks:
            req, s, n, blocks, samples, draft = chunk
            end = s + n
            if n == 1:
                num_decodes += 1
                ids = req.all_token_ids  # past its end: a placeholder (`launch` fills it)
                input_ids.append(ids[s] if s < len(ids) else 0)
                positions.append(s)
                slots.append(blocks[s // block_size] * block_size + s % block_size)
            else:  # a prefill chunk; a verified one: the last token, then the drafted ones
                input_ids.extend((req.all_token_ids[s], *draft) if draft
                                 else req.all_token_ids[s:end])
                positions.extend(range(s, end))
                slots.extend(blocks[p // block_size] * block_size + p % block_size
                             for p in range(s, end))
            row += n
            starts.append(row)
            seq_lens.append(end)
            if draft:  # every position samples
                drafts[len(sampling)] = draft
                if req.draft_probs is not None and not req.params.greedy:
                    verifications.append(Verification(len(sampling), draft,
                                                      req.draft_probs[:len(draft)]))
                sample_rows.extend(range(row - n, row))
                sampling.extend(sampling_rows(req, draft, self.vocab_size))
            elif samples:
                sample_rows.append(row - 1)
                sampling.append(req)
            if req.prompt_logprobs is not None:
                num_prompt_targets = prompt_logprob_rows(req, s, n)
                if num_prompt_targets:
                    prompt_rows.append((chunk, row - n, num_prompt_targets))
        for _, first, count in prompt_rows:
            sample_rows.extend(range(first, first + count))
        self._step_id += 1
        lora_slots, lora_writes = self._lora_slots(out)
        msg = StepMessage(
            step_id=self._step_id, input_ids=tuple(input_ids), positions=tuple(positions),
            slot_mapping=tuple(slots), query_start_loc=tuple(starts), seq_lens=tuple(seq_lens),
            block_tables=tuple(c.block_ids for c in out.chunks), num_decodes=num_decodes,
            logit_rows=tuple(sample_rows), num_microbatches=self.num_microbatches,
            block_copies=out.block_copies, lora_slots=lora_slots, lora_writes=lora_writes)
        return _Batch(msg, sampling, drafts, verifications, prompt_rows)


    def _lora_slots(self, out: SchedulerOutput) -> tuple[tuple[int, ...], tuple[SlotWrite, ...]]:
        """Each chunk's adapter slot (-1: the base model), and the copies bringing them in."""
        if self.adapters is None:
            return (), ()
        return (self.adapters.seq_slots([c.request.lora_name for c in out.chunks]),
                self.adapters.take_writes())


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Makes `device` the thread's current CUDA device for the block (Triton launches on the
    current device, whatever its tensors' device is: on cuda:1 it would run on cuda:0); a
    no-op elsewhere, and for a CUDA device without an index."""
    if device.type == "cuda" and device.index is not None:
        return torch.cuda.device(device)
    return contextlib.nullcontext()
