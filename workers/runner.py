"""Turns a scheduled step into batch tensors, runs the model and samples.

Owns the KV-cache tensors: one `[2, num_blocks, block_size, num_kv_heads, head_dim]` tensor per
layer, indexed by the block ids the KV-cache manager hands out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from workers.attention import AttentionMetadata
from workers.protocol import TokenLogprob
from workers.request import Request
from workers.sampler import Sampler, top_logprobs
from workers.scheduler import ScheduledChunk, SchedulerOutput


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, keys and values."""
        return (2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
                * torch.empty((), dtype=self.dtype).element_size())


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> next token
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # request id -> (index of the first prompt token covered, logprobs of consecutive tokens)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Batch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # row of each sampling chunk's last token, in chunk order
    prompt_rows: list[tuple[ScheduledChunk, int, int]]  # (chunk, first row, num rows)


class ModelRunner:
    def __init__(self, model: nn.Module, spec: KVCacheSpec, device: torch.device,
                 seed: int = 0) -> None:
        self.model = model
        self.spec = spec
        self.device = device
        self.sampler = Sampler(seed, device)
        self.kv_caches = [
            torch.zeros(2, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim,
                        dtype=spec.dtype, device=device)
            for _ in range(spec.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        batch = self._prepare(out)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        # hidden: [T, hidden_size]
        result = RunnerOutput()
        sampling = [c.request for c in out.chunks if c.samples]
        if sampling:
            logits = self.model.compute_logits(hidden[batch.sample_rows])
            sampled = self.sampler(logits, sampling)
            for req, token, lp in zip(sampling, sampled.token_ids, sampled.logprobs):
                result.sampled[req.request_id] = token
                if lp is not None:
                    result.logprobs[req.request_id] = lp
        for chunk, first, count in batch.prompt_rows:
            req = chunk.request
            targets = req.all_token_ids[chunk.start + 1:chunk.start + 1 + count]
            logprobs = self.model.compute_logits(hidden[first:first + count]).log_softmax(-1)
            result.prompt_logprobs[req.request_id] = (chunk.start + 1, top_logprobs(
                logprobs, torch.tensor(targets, device=self.device), req.params.prompt_logprobs))
        return result

    def _prepare(self, out: SchedulerOutput) -> _Batch:
        block_size = self.spec.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[ScheduledChunk, int, int]] = []
        for chunk in out.chunks:
            req, s, n = chunk.request, chunk.start, chunk.num_tokens
            row = starts[-1]
            input_ids.extend(req.all_token_ids[s:s + n])
            positions.extend(range(s, s + n))
            blocks = chunk.block_ids
            slots.extend(blocks[p // block_size] * block_size + p % block_size
                         for p in range(s, s + n))
            starts.append(row + n)
            seq_lens.append(s + n)
            if chunk.samples:
                sample_rows.append(row + n - 1)
            num_prompt_targets = _prompt_logprob_rows(req, s, n)
            if num_prompt_targets:
                prompt_rows.append((chunk, row, num_prompt_targets))
        max_blocks = max(len(c.block_ids) for c in out.chunks)
        tables = [list(c.block_ids) + [0] * (max_blocks - len(c.block_ids)) for c in out.chunks]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            num_decodes=out.num_decodes,
            max_query_len=max(c.num_tokens for c in out.chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        return _Batch(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                      torch.tensor(positions, dtype=torch.int64, device=dev),
                      meta, sample_rows, prompt_rows)


def _prompt_logprob_rows(req: Request, start: int, num_tokens: int) -> int:
    """How many of this chunk's rows predict a prompt token (position p predicts token p + 1)."""
    if req.prompt_logprobs is None:
        return 0
    return max(0, min(start + num_tokens, req.num_prompt_tokens - 1) - start)
