"""The attention-backend contract. GPU kernels plug in here without touching the scheduler;
`registry` picks one by name.

The KV cache of one layer is one tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 keys, 1 values). A token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`. Under multi-head latent attention
the cache is `[1, ...]`: one latent per token is both the key and the value (the model passes
the same tensor as k and v, and takes the part of the output it needs).

A layer may attend over a sliding window: query position p then sees keys at positions
(p - window, p], the last `window` tokens including itself, as transformers' sliding-window mask
does (Mistral, Gemma 3's local layers). The cache still holds every token; only what is read
changes.

A layer may have attention sinks (gpt-oss): one learned logit per query head that joins every
softmax's denominator and attends to nothing, so a query can put weight nowhere.

A batch is a flat list of new tokens from several sequences. The runner orders the sequences so
the `num_decodes` sequences with exactly one new token come first (they can be batched as one
kernel call); the rest are prefill chunks, which may start after cached or earlier-computed
tokens.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step batch description, built by the runner, read by every layer. Tensors on device."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token's K/V
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: prefix sums of new tokens per sequence
    seq_lens: torch.Tensor  # [num_seqs] int32: tokens in context after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    num_decodes: int  # leading sequences with exactly one new token
    max_query_len: int
    max_seq_len: int
    # host copies of the small per-sequence lists, so backends can loop without syncs
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(abc.ABC):
    """Writes the new K/V into the cache, then attends each new query token causally over its
    sequence's context (cached tokens and the new tokens up to itself)."""

    name: str
    # whether a pure-decode forward reads lengths and block tables only on the device, with no
    # host sync or allocation that varies per step, so workers.engine.cuda_graphs may capture it
    cuda_graph_safe: bool = False

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,  # sliding window in tokens; None attends the whole context
        sinks: torch.Tensor | None = None,  # [num_heads] fp32 sink logits, in scaled units
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
