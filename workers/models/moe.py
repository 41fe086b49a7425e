"""Sparse mixture-of-experts blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss) with tensor or
expert parallelism.

Routing follows transformers exactly: softmax over the router logits in fp32, top-k, optional
renormalization of the k probabilities (gpt-oss: top-k of the logits, then a softmax over those
k), then each token's output is the weighted sum of its experts' SwiGLU outputs (gpt-oss: with
biases, and its clamped SwiGLU).

Two ways to shard over the TP group (`Shard.expert_parallel`):
- tensor-parallel: every rank holds every expert with its intermediate dim split; partial outputs
  are all-reduced (as a dense MLP).
- expert-parallel: rank r holds experts [r * E/G, (r+1) * E/G) whole. The block's input is
  replicated over the group; each rank routes its contiguous chunk of tokens, sends every
  (token, expert) row to the expert's owner with an all-to-all, runs its experts on what it
  received, sends the results back with a second all-to-all, combines them with the routing
  weights, and an all-gather restores the replicated output.

Host syncs. On the CPU the experts loop over the experts present (`torch.unique`, then each
one's rows): reading those on the host costs nothing there. On a GPU each such read waits for
the device, so steps of every size run the fused kernels (`workers.kernels.fused_moe`): the
(token, expert) pairs sorted by expert and padded to whole blocks on the device, then grouped
GEMMs over the blocks, launched on a grid sized by the worst case: no host read. They also
serve decodes: each block reads only its own expert's weights, where the dense form reads every
expert's and computes E_local / k times the FLOPs. Without Triton (a GPU without the package),
steps of up to DENSE_MAX_TOKENS tokens run every local expert over every token, weighted by the
routing (0 where not picked), and larger ones the loop (one `unique` read per layer plus one per
expert present). Expert parallelism exchanges row counts on the host by design. A step with
LoRA rows on experts (`workers.models.lora.experts`) runs the loop on any device, each row's
adapter products added inside its experts.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels.host_transfer import gpu_paths
from workers.kernels import use_triton
from workers.models.layers import ReplicatedLinear, Shard, WeightShapeError, _make_param
from workers.models.moe_config import MoEConfig
from workers.models.comm import Communicator

if TYPE_CHECKING:  # the hook's type only: workers.models.lora imports this module
    from workers.models.lora.experts import ExpertLora

GATE, UP, DOWN = 0, 1, 2  # shard ids of an expert's w1/gate_proj, w3/up_proj, w2/down_proj
DENSE_MAX_TOKENS = 64  # on a GPU without Triton, steps up to this many tokens run every expert


def route(router_logits: torch.Tensor, top_k: int, normalize: bool,
          softmax_after_topk: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] -> (expert ids [T, k] int64, weights [T, k]), as HF: fp32 weights,
    or with `softmax_after_topk` (gpt-oss) in the logits' dtype."""
    if softmax_after_topk:
        values, ids = torch.topk(router_logits, top_k, dim=-1)
        return ids, F.softmax(values, dim=-1, dtype=values.dtype)
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float,
                   limit: float) -> torch.Tensor:
    """gpt-oss's gated activation: both halves clamped, a sigmoid-weighted gate, up + 1."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class FusedExperts(nn.Module):
    """The routed experts of one layer, stacked: w13 [E_local, 2 * I_local, H] (gate | up) and
    w2 [E_local, H, I_local] (and with `bias`, w13_bias [E_local, 2 * I_local] and w2_bias
    [E_local, H]). Loaded from HF's per-expert tensors with shard id (expert, GATE | UP |
    DOWN); experts another EP rank owns are skipped. `clamped_swiglu`: (alpha, limit) of
    gpt-oss's activation, else silu(gate) * up. `lora`: its adapters' expert products
    (`workers.models.lora.experts`), installed by the adapter slots where supported."""

    lora: ExpertLora | None = None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 shard: Shard, comm: Communicator | None, bias: bool = False,
                 clamped_swiglu: tuple[float, float] | None = None) -> None:
        super().__init__()
        size = shard.tp_size
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.expert_parallel = shard.expert_parallel and size > 1
        self.comm, self.tp_rank, self.tp_size = comm, shard.tp_rank, size
        if self.expert_parallel:
            if num_experts % size:
                raise ValueError(f"num_experts={num_experts} is not divisible by the expert-"
                                 f"parallel size {size}")
            self.num_local, self.inter_local = num_experts // size, intermediate_size
        else:
            if intermediate_size % size:
                raise ValueError(f"moe intermediate_size={intermediate_size} is not divisible "
                                 f"by tp_size={size}")
            self.num_local, self.inter_local = num_experts, intermediate_size // size
        self.first_expert = shard.tp_rank * self.num_local if self.expert_parallel else 0
        i, h = self.inter_local, hidden_size
        self.w13_weight = _make_param((self.num_local, 2 * i, h), self.weight_loader)
        self.w2_weight = _make_param((self.num_local, h, i), self.weight_loader)
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = _make_param((self.num_local, 2 * i), self.weight_loader)
            self.w2_bias = _make_param((self.num_local, h), self.weight_loader)
        # under TP every rank's partial output is summed: the output bias is added on one
        self.add_w2_bias = bias and (self.expert_parallel or shard.tp_rank == 0)
        self.clamped_swiglu = clamped_swiglu

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: object = None) -> None:
        match shard_id:
            case (int() as expert, int() as part):
                pass
            case _:
                raise ValueError(f"expert weight shard_id {shard_id!r}; expected (expert, part)")
        h, inter = self.hidden_size, self.intermediate_size
        is_bias = param is self.w13_bias or param is self.w2_bias
        expected: tuple[int, ...] = (h, inter) if part == DOWN else (inter, h)
        if is_bias:
            expected = expected[:1]
        if tuple(loaded.shape) != expected:
            raise WeightShapeError(f"expert {expert}: expected shape {list(expected)}, got "
                                   f"{list(loaded.shape)}")
        local = expert - self.first_expert
        if not 0 <= local < self.num_local:
            return  # another EP rank's expert
        i = self.inter_local
        start = 0 if self.expert_parallel else self.tp_rank * i
        if part == DOWN:
            param.data[local].copy_(loaded if is_bias else loaded.narrow(1, start, i))
        else:
            param.data[local].narrow(0, part * i, i).copy_(loaded.narrow(0, start, i))

    def run_local(self, x: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor | None) -> torch.Tensor:
        """x: [N, H]; ids: [N, k] local expert ids; weights [N, k] or None (k == 1, unweighted).
        Returns sum_k weight * expert(x) [N, H], this rank's partial sum under TP."""
        lora = self.lora
        if lora is not None and lora.active:  # adapter rows: the loop, their products inside
            if self.expert_parallel:
                raise RuntimeError("LoRA on experts under expert parallelism is not supported")
            return self._run_loop(x, ids, weights, lora)
        if gpu_paths(x.device) and use_triton(x):
            from workers.kernels.fused_moe import fused_moe

            return fused_moe(x, self.w13_weight, self.w2_weight, ids, weights, self.w13_bias,
                             self.w2_bias if self.add_w2_bias else None, self.clamped_swiglu)
        if gpu_paths(x.device) and x.shape[0] <= DENSE_MAX_TOKENS:
            return self._run_dense(x, ids, weights)
        return self._run_loop(x, ids, weights)

    def _run_loop(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None,
                  lora: ExpertLora | None = None) -> torch.Tensor:
        """`run_local` expert by expert (those present, read on the host); with `lora`, each
        row's adapter products added inside its experts (x's rows are the step's tokens)."""
        mask = None if lora is None else lora.row_mask()  # [N, L * R]
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            rows, slot = torch.where(ids == e)
            y = self._expert(x[rows], e, lora, None if mask is None else mask[rows])
            if weights is not None:
                y = y * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out

    def _run_dense(self, x: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor | None) -> torch.Tensor:
        """`run_local` without reading the routing on the host: every local expert over every
        row, each output scaled by the row's weight for that expert (0 where not picked) and
        summed in expert order, as the loop does."""
        if weights is None:
            weights = torch.ones(ids.shape, dtype=x.dtype, device=x.device)
        routing = torch.zeros(x.shape[0], self.num_local, dtype=weights.dtype,
                              device=x.device).scatter_add_(1, ids, weights)
        out = torch.zeros_like(x)
        for e in range(self.num_local):
            out += (self._expert(x, e) * routing[:, e, None]).to(out.dtype)
        return out

    def _expert(self, x: torch.Tensor, e: int, lora: ExpertLora | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Local expert e's output for rows x [N, H] (its bias on w2 only where added here),
        with `lora` each row's adapter products (`mask` [N, L * R] its slot's columns)."""
        b13 = self.w13_bias
        b2 = self.w2_bias if self.add_w2_bias else None
        gate_up = F.linear(x, self.w13_weight[e], None if b13 is None else b13[e])
        if lora is not None and mask is not None:
            gate_up = gate_up + lora.gate_up(x, mask, e)
        gate, up = gate_up.chunk(2, -1)
        if self.clamped_swiglu is not None:
            hidden = clamped_swiglu(gate, up, *self.clamped_swiglu)
        else:
            hidden = F.silu(gate) * up
        out = F.linear(hidden, self.w2_weight[e], None if b2 is None else b2[e])
        if lora is not None and mask is not None:
            out = out + lora.down(hidden, mask, e)
        return out

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # x: [T, H] (replicated over the group); ids, weights: [T, k] -> [T, H] replicated
        if not self.expert_parallel:
            out = self.run_local(x, ids, weights)
            if self.comm is not None and self.tp_size > 1:
                self.comm.all_reduce(out, "moe")
            return out
        return self._expert_parallel(x, ids, weights)

    def _expert_parallel(self, x: torch.Tensor, ids: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor:
        comm = self.comm
        if comm is None:
            raise RuntimeError("expert parallelism needs the TP group's communicator")
        num_tokens, top_k = ids.shape
        chunk = math.ceil(num_tokens / comm.size)
        lo, hi = min(num_tokens, comm.rank * chunk), min(num_tokens, (comm.rank + 1) * chunk)
        flat_ids = ids[lo:hi].reshape(-1)  # [n * k]
        token = torch.arange(hi - lo, device=x.device).repeat_interleave(top_k)
        dest = flat_ids // self.num_local
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=comm.size).tolist()
        recv = comm.exchange_counts(send, "moe_counts")
        rows = comm.all_to_all(x[lo:hi][token[order]], send, recv, "moe_dispatch")
        row_ids = comm.all_to_all(flat_ids[order], send, recv, "moe_dispatch_ids")
        out_rows = self.run_local(rows, (row_ids - self.first_expert).unsqueeze(1), None)
        back = comm.all_to_all(out_rows, recv, send, "moe_combine")  # [n * k, H], `order`
        contrib = torch.empty_like(back)
        contrib[order] = back
        y = torch.zeros(chunk, self.hidden_size, dtype=x.dtype, device=x.device)
        if hi > lo:
            weighted = contrib.view(hi - lo, top_k, -1) * weights[lo:hi].unsqueeze(-1)
            y[: hi - lo] = weighted.sum(dim=1).to(x.dtype)
        return comm.all_gather(y, "moe_gather")[:num_tokens]


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ Qwen2-MoE's sigmoid-gated shared expert, a dense MLP)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 normalize: bool, shard: Shard, comm: Communicator | None,
                 shared_expert: nn.Module | None = None, cast_weights: bool = False,
                 moe: MoEConfig | None = None) -> None:
        """`cast_weights`: cast the fp32 routing weights to the activations' dtype before use
        (Qwen2-MoE does, Mixtral does not). `moe`: gpt-oss's routing order, biases and
        activation, when given."""
        super().__init__()
        self.top_k, self.normalize, self.cast_weights = top_k, normalize, cast_weights
        self.softmax_after_topk = moe is not None and moe.softmax_after_topk
        bias = moe is not None and moe.bias
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, shard, comm,
                                    bias, None if moe is None else moe.clamped_swiglu)
        if shared_expert is not None:
            self.shared_expert: nn.Module | None = shared_expert
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        ids, weights = route(self.gate(x), self.top_k, self.normalize, self.softmax_after_topk)
        out = self.experts(x, ids, weights.to(x.dtype) if self.cast_weights else weights)
        if self.shared_expert is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            out = out + shared
        return out
