"""The attention-backend contract. GPU kernels plug in here without touching the scheduler.

The KV cache of one layer is one tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 keys, 1 values). A token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

A batch is a flat list of new tokens from several sequences. The runner orders the sequences so
the `num_decodes` sequences with exactly one new token come first (they can be batched as one
kernel call); the rest are prefill chunks, which may start after cached or earlier-computed
tokens.
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
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
    # host sync or allocation that varies per step, so workers.cuda_graphs may capture it
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
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _BACKENDS[cls.name] = cls
    return cls


# Backends that need an optional package: name -> (package, module that registers it). Imported
# only when asked for, so the torch backend neither needs nor pays for the package.
_OPTIONAL_BACKENDS = {"triton": ("triton", "workers.attention.triton_backend")}


def get_backend(name: str) -> AttentionBackend:
    # import for registration side effects
    from workers.attention import cpu_backend, torch_backend  # noqa: F401

    if name in _OPTIONAL_BACKENDS and name not in _BACKENDS:
        package, module = _OPTIONAL_BACKENDS[name]
        if importlib.util.find_spec(package) is None:
            raise ValueError(f"attention backend {name!r} needs the {package!r} package, which "
                             f"is not installed")
        importlib.import_module(module)
    if name not in _BACKENDS:
        known = sorted(_BACKENDS.keys() | _OPTIONAL_BACKENDS.keys())
        raise ValueError(f"unknown attention backend {name!r}; expected one of {known}")
    return _BACKENDS[name]()
