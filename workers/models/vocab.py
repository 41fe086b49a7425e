"""The vocabulary-sized tables: the input embedding and the output projection, rows split over
tensor-parallel ranks."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.layers import _check_shape, _comm_for, _linear, _make_param, _sharded_copy
from workers.models.comm import Communicator


class VocabParallelEmbedding(nn.Module):
    """Embedding table with rows split over ranks (the last rank's shard is zero-padded)."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1,
        comm: Communicator | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.comm = _comm_for(comm, tp_size)
        self.num_embeddings_per_rank = math.ceil(num_embeddings / tp_size)
        self.vocab_start = tp_rank * self.num_embeddings_per_rank
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_rank, num_embeddings)
        self.weight = _make_param((self.num_embeddings_per_rank, embedding_dim), self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        # the table, or a quantized output projection's int8 rows and per-row scales [vocab, G]
        _check_shape(loaded_weight, (self.num_embeddings, *param.shape[1:]), "vocab tensor")
        size = self.vocab_end - self.vocab_start
        if size < param.shape[0]:
            param.data[size:].zero_()
        _sharded_copy(param, loaded_weight, 0, self.vocab_start, size)

    # the rows of a table held packed, (table, input_ids) -> rows in the model's dtype
    # (workers.quant.gguf_packed); None: `weight` is the table itself
    lookup: Callable[..., torch.Tensor] | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] -> [num_tokens, embedding_dim]
        if self.lookup is not None:
            return self.lookup(self, input_ids)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_shard, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        return _tp_comm(self.comm).all_reduce(out, "embed")


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; may share its weight with the input embedding.

    Untied, it may be held quantized (`workers.quant.linear.quantize_layers`: `qweight`,
    `scales`, `zeros` split by vocabulary rows as the weight is, and `matmul` their kernel).
    """

    matmul = None  # as a linear layer's (workers.models.layers): a kernel of its own, or None
    tied = False  # whether `weight` is the input embedding's

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.tied = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, num_embeddings]
        logits = _linear(self, hidden, None)
        if self.tp_size > 1:
            logits = _tp_comm(self.comm).all_gather(logits, "lm_head", dim=-1)
        return logits[..., : self.num_embeddings]


def _tp_comm(comm: Communicator | None) -> Communicator:
    """The communicator of a layer sharded over ranks (`_comm_for` gives one when sharded)."""
    if comm is None:
        raise RuntimeError("a vocabulary layer sharded over ranks has no communicator")
    return comm
