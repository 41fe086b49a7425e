"""Model building blocks that shard over tensor-parallel ranks, as vLLM's layers do.

Column-parallel layers split their output features over ranks, row-parallel layers split their
input features and all-reduce the partial sums. With `tp_size == 1` no collective is called.

Parameters are created with `torch.empty` under the caller's default device and dtype (the loader
sets both). Every checkpoint-loaded parameter carries `param.weight_loader(param, loaded_weight,
shard_id=None)`, which checks the full (unsharded) shape, narrows to this rank's shard and copies,
converting dtype and device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.comm import Communicator

if TYPE_CHECKING:  # the hook's type only: workers.models.lora imports this module
    from workers.models.lora.projection import LoraProjection


@dataclass(frozen=True)
class Shard:
    """The part of the model one process holds."""

    tp_rank: int = 0
    tp_size: int = 1
    comm: Communicator | None = None  # the TP group (also the EP group); None: world if sharded
    layers: range | None = None  # this pipeline stage's layers; None for all
    expert_parallel: bool = False  # MoE experts split whole over the TP group


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape does not fit the parameter it is loaded into."""


def _check_shape(loaded: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise WeightShapeError(
            f"{what}: expected shape {list(expected)}, got {list(loaded.shape)}"
        )


def _check_divisible(total: int, tp_size: int, what: str) -> int:
    if total % tp_size != 0:
        raise ValueError(f"{what}={total} is not divisible by tp_size={tp_size}")
    return total // tp_size


def _comm_for(comm: Communicator | None, tp_size: int) -> Communicator | None:
    """The layer's communicator: the given one, else the world group when sharded."""
    if comm is None and tp_size > 1:
        return Communicator.world()
    return comm


def default_weight_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
) -> None:
    """Copies a replicated (unsharded) tensor."""
    _check_shape(loaded_weight, tuple(param.shape), "replicated tensor")
    param.data.copy_(loaded_weight)


def _make_param(shape: tuple[int, ...], loader: Callable[..., None]) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]  # a loader of its own, as vLLM's
    return param


def _sharded_copy(
    param: nn.Parameter, loaded: torch.Tensor, dim: int, start: int, size: int,
    dst_start: int = 0,
) -> None:
    """Copies `loaded[start:start+size]` along `dim` into `param[dst_start:dst_start+size]`."""
    param.data.narrow(dim, dst_start, size).copy_(loaded.narrow(dim, start, size))


def _linear(layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) with the layer's weight, full-precision or quantized, (+ its LoRA deltas)."""
    out = F.linear(x, layer.weight, bias) if layer.matmul is None else layer.matmul(layer, x)
    out = out if layer.matmul is None or bias is None else out + bias
    return _add_lora(layer, x, out)


def _add_lora(layer: Any, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` with the layer's LoRA deltas of the step's adapter rows added in place."""
    lora = getattr(layer, "lora", None)  # the linear layers' (vocab layers have none)
    return out if lora is None or not lora.batch.active else lora.add(x, out)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split over ranks; output stays sharded."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False,
        tp_rank: int = 0, tp_size: int = 1,
    ) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.output_size_per_rank = _check_divisible(output_size, tp_size, "output_size")
        self.weight = _make_param((self.output_size_per_rank, input_size), self.weight_loader)
        self.bias = _make_param((self.output_size_per_rank,), self.weight_loader) if bias else None

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        expected = (self.output_size, *param.shape[1:])
        _check_shape(loaded_weight, expected, "column-parallel tensor")
        size = param.shape[0]
        _sharded_copy(param, loaded_weight, 0, self.tp_rank * size, size)

    # x W^T by a kernel of its own, (layer, x, out dtype or None for x's) -> out: a quantized
    # weight's (workers.quant.linear), a few CPU rows' (workers.kernels.small_gemm); None: F.linear
    matmul: Callable[..., torch.Tensor] | None = None
    lora: LoraProjection | None = None  # its adapters' stacks (workers.models.lora); None: none

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, input_size] -> [num_tokens, output_size / tp_size]
        return _linear(self, x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (gate_up); shard_id is the index."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = False,
        tp_rank: int = 0, tp_size: int = 1,
    ) -> None:
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            _check_divisible(size, tp_size, "merged output size")
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"shard_id {shard_id!r} is not an index into {len(self.output_sizes)} outputs"
            )
        full = self.output_sizes[shard_id]
        _check_shape(loaded_weight, (full, *param.shape[1:]), f"merged shard {shard_id}")
        size = full // self.tp_size
        dst = sum(self.output_sizes[:shard_id]) // self.tp_size
        _sharded_copy(param, loaded_weight, 0, self.tp_rank * size, size, dst_start=dst)


class ReplicatedLinear(nn.Module):
    """y = x W^T (+ b), the same W on every rank (routers, gates, DeepSeek's down-projections
    into its latents)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _make_param((output_size, input_size), default_weight_loader)
        self.bias = _make_param((output_size,), default_weight_loader) if bias else None

    matmul: Callable[..., torch.Tensor] | None = None  # as ColumnParallelLinear's
    lora: LoraProjection | None = None  # as ColumnParallelLinear's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self, x, self.bias)


def kv_heads_per_rank(total_num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(KV heads each rank holds, ranks holding each KV head): heads are split over ranks while
    there are enough, then replicated (tp_size must be a multiple of the head count)."""
    if tp_size >= total_num_kv_heads:
        return 1, _check_divisible(tp_size, total_num_kv_heads, "tp_size")
    return _check_divisible(total_num_kv_heads, tp_size, "num_key_value_heads"), 1


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; heads split over ranks, KV heads replicated when tp_size > them.

    Output per rank: [q (num_heads * head_dim) | k (num_kv_heads * head_dim) | v (same)].
    """

    def __init__(
        self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
        bias: bool = False, tp_rank: int = 0, tp_size: int = 1,
    ) -> None:
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = _check_divisible(total_num_heads, tp_size, "num_attention_heads")
        self.num_kv_heads, self.num_kv_head_replicas = kv_heads_per_rank(
            total_num_kv_heads, tp_size
        )
        self.q_size = self.num_heads * head_dim  # per rank
        self.kv_size = self.num_kv_heads * head_dim  # per rank
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias, tp_rank, tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        d = self.head_dim
        if shard_id == "q":
            full, size, dst, rank = self.total_num_heads * d, self.q_size, 0, self.tp_rank
        elif shard_id in ("k", "v"):
            full, size = self.total_num_kv_heads * d, self.kv_size
            dst = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            rank = self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"shard_id {shard_id!r} is not one of 'q', 'k', 'v'")
        _check_shape(loaded_weight, (full, *param.shape[1:]), f"{shard_id}_proj")
        _sharded_copy(param, loaded_weight, 0, rank * size, size, dst_start=dst)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split over ranks; sums the partials over ranks.

    `comm`: the TP group (default: the world group when tp_size > 1); `site` tags its bytes.
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False,
        tp_rank: int = 0, tp_size: int = 1, comm: Communicator | None = None, site: str = "row",
    ) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.comm, self.site = _comm_for(comm, tp_size), site
        self.input_size_per_rank = _check_divisible(input_size, tp_size, "input_size")
        self.weight = _make_param((output_size, self.input_size_per_rank), self.weight_loader)
        self.bias = _make_param((output_size,), default_weight_loader) if bias else None

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        # the weight, or a quantized weight's per-group scales: split along the same columns
        size = param.shape[1]
        full = (self.output_size, size * self.tp_size)
        _check_shape(loaded_weight, full, "row-parallel tensor")
        _sharded_copy(param, loaded_weight, 1, self.tp_rank * size, size)

    matmul: Callable[..., torch.Tensor] | None = None  # as ColumnParallelLinear's
    lora: LoraProjection | None = None  # as ColumnParallelLinear's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, input_size / tp_size] -> [num_tokens, output_size]
        # with LoRA, this rank's share of each adapter row's product (its A columns, B whole)
        # joins the partial sums: the one all-reduce sums both
        if self.comm is None or self.tp_size == 1:
            out = _linear(self, x, None)
        elif self.matmul is not None:
            # a kernel's fp32 partial sums are summed in fp32, then rounded once, as one rank's
            # are (bf16 partials rounded before the sum change greedy tokens of a small model)
            out = _add_lora(self, x, self.matmul(self, x, torch.float32))
            self.comm.all_reduce(out, self.site)
            out = out.to(x.dtype)
        else:
            out = self.comm.all_reduce(_add_lora(self, x, F.linear(x, self.weight)), self.site)
        if self.bias is not None:
            out = out + self.bias
        return out


# the layers whose weights a quantized checkpoint may keep quantized (workers.quant.linear)
LINEAR_LAYERS = (ColumnParallelLinear, ReplicatedLinear, RowParallelLinear)
