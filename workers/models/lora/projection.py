"""LoRA on a model's projections: a step's rows grouped by adapter slot (`LoraBatch`), and the
hook each projection carries (`LoraProjection`) that adds its adapters' products to the base
output: on the CPU in fp32 by the C kernel (`workers.kernels.lora_add`; the fused CPU decoder
stack adds the same products inside its own, `workers.models.fused_layer`), elsewhere one
batched shrink and one batched expand matmul over the segments of rows sharing an adapter
(padded to the longest).

Every hooked projection holds, per slot, its adapters' A and B stacked over its PEFT modules (a
fused q/k/v projection: q_proj's, k_proj's and v_proj's side by side), each padded to
`max_rank` with zeros: A `[max_loras, num_subs * max_rank, in]` and B transposed, `bt
[max_loras, num_subs * max_rank, out]` (a row of it is one rank's output columns, which the
CPU kernel reads as vectors), already scaled (alpha / r, or alpha / sqrt(r) for rsLoRA). B is
block diagonal over the subs, so one pair of matmuls gives every sub's product (the CPU kernel
skips the zero blocks: `column_ends`); the zero padding adds exact zeros. The base projection
runs as before (its own kernel, quantized or small-batch); the hook only adds. Rows of the
base model are in no segment.

On a tensor-parallel rank each pair is sharded as its base projection is: a column-parallel
projection's (q/k/v, gate/up) B keeps this rank's output rows of each sub (`Sub.first`), A
whole; a row-parallel one's (o_proj, down_proj) A keeps this rank's input columns
(`LoraProjection.in_slice`), B whole, and its product joins the base's partial sums before
the one all-reduce that sums them (`workers.models.layers.RowParallelLinear`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.kernels import lora_add


@dataclass(frozen=True)
class Sub:
    """One PEFT module inside a (possibly fused) projection: its name and output columns."""

    name: str  # PEFT's module name, e.g. "q_proj"
    offset: int  # first output column of the fused projection (this rank's) it fills
    size: int  # its output columns on this rank
    full: int = 0  # the PEFT module's output features, all ranks (0: `size`, one rank)
    first: int = 0  # the first of them this rank holds (the row of PEFT's B it starts at)

    @property
    def out_features(self) -> int:
        """What PEFT's B of this module has as rows."""
        return self.full or self.size


class LoraBatch:
    """The current step's adapter rows, shared by every hooked projection of one model.

    `begin` is called once per step before the forward pass (the executor); `active` is False
    when no row has an adapter, and then no hook does any work."""

    def __init__(self) -> None:
        self.active = False
        self.rows = torch.empty(0, dtype=torch.int64)  # [N] adapter rows, grouped by slot
        self.segments: list[tuple[int, int, int]] = []  # (slot, first, end) into `rows`
        # the same on the host, int64 [num_segments, 3] (the fused CPU stack reads it)
        self.segment_table = torch.empty(0, 3, dtype=torch.int64)
        # each token row's slot (-1: the base model), on the device: an MoE's experts see
        # their rows in routing order, not grouped (`workers.models.lora.experts`)
        self.token_slots = torch.empty(0, dtype=torch.int64)

    def begin(self, query_start_loc: Sequence[int], seq_slots: Sequence[int],
              device: torch.device) -> None:
        """`seq_slots` [num_seqs]: each sequence's adapter slot, -1 for the base model (empty:
        none has one). Groups the step's token rows by slot with vectorized host ops (no loop
        over sequences) and uploads their indices."""
        if not seq_slots or max(seq_slots) < 0:
            self.active = False
            return
        starts = torch.tensor(query_start_loc, dtype=torch.int64)
        counts = starts[1:] - starts[:-1]  # [num_seqs] new tokens of each sequence
        slots = torch.tensor(seq_slots, dtype=torch.int64)
        token_slots = torch.repeat_interleave(slots, counts)  # [T]
        order = torch.argsort(token_slots, stable=True)
        sorted_slots = token_slots[order]
        keep = sorted_slots >= 0
        rows, kept = order[keep], sorted_slots[keep]
        ids, sizes = torch.unique_consecutive(kept, return_counts=True)
        ends = torch.cumsum(sizes, 0)
        self.segment_table = torch.stack((ids, ends - sizes, ends), 1).contiguous()
        self.segments = [(s, f, e) for s, f, e in self.segment_table.tolist()]
        self.rows = rows.to(device, non_blocking=True)
        self.token_slots = token_slots.to(device, non_blocking=True)
        # the segments padded to the longest, for one batched matmul: [S, longest] indices into
        # the grouped rows (padding: one past them, a zero row), and where the real ones sit
        span = torch.arange(int(sizes.max()))
        real = span[None, :] < sizes[:, None]
        padded = torch.where(real, (ends - sizes)[:, None] + span[None, :], rows.shape[0])
        self.padded = padded.to(device, non_blocking=True)
        self.real = real.flatten().nonzero().squeeze(1).to(device, non_blocking=True)
        self.slot_ids = ids.to(device, non_blocking=True)
        self.active = True

    def end(self) -> None:
        self.active = False


class LoraProjection:
    """The LoRA stacks of one projection and the product it adds (`add`)."""

    def __init__(self, batch: LoraBatch, subs: tuple[Sub, ...], in_features: int,
                 out_features: int, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, in_slice: tuple[int, int] | None = None) -> None:
        """`in_features`, `out_features`: this rank's; `in_slice`: (first, count) of PEFT's A
        columns this rank holds (a row-parallel projection's), None: all."""
        self.batch, self.subs, self.max_rank, self.in_slice = batch, subs, max_rank, in_slice
        self.in_features, self.out_features = in_features, out_features
        width = len(subs) * max_rank
        self.a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)
        self.ends = torch.tensor(self.column_ends, dtype=torch.int64)  # the C kernel's

    @property
    def column_ends(self) -> tuple[int, ...]:
        """Where each sub's output columns end, when the subs fill the output in order (sub j's
        columns then take only stack rows [j * max_rank, (j + 1) * max_rank)); else one sub of
        every column and every row."""
        ends, start = [], 0
        for sub in self.subs:
            if sub.offset != start:
                return (self.out_features,)
            start = sub.offset + sub.size
            ends.append(start)
        return tuple(ends) if start == self.out_features else (self.out_features,)

    def host_stacks(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One adapter's padded (A, B transposed) of this projection on the host, this rank's
        shard, from its subs' whole (A [r, in], B scaled [out, r]); subs it does not target stay
        zero."""
        width = len(self.subs) * self.max_rank
        a = torch.zeros(width, self.in_features, dtype=self.a.dtype)
        bt = torch.zeros(width, self.out_features, dtype=self.bt.dtype)
        for j, sub in enumerate(self.subs):
            if sub.name not in weights:
                continue
            lora_a, lora_b = weights[sub.name]
            if self.in_slice is not None:
                lora_a = lora_a.narrow(1, *self.in_slice)
            lora_b = lora_b.narrow(0, sub.first, sub.size)
            rank, col = lora_a.shape[0], j * self.max_rank
            a[col:col + rank] = lora_a
            bt[col:col + rank, sub.offset:sub.offset + sub.size] = lora_b.t()
        return a, bt

    def write_slot(self, slot: int, stacks: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Puts an adapter's host stacks into `slot` (None: zeros, the adapter skips this
        projection)."""
        if stacks is None:
            self.a[slot].zero_()
            self.bt[slot].zero_()
        else:
            self.a[slot].copy_(stacks[0], non_blocking=True)
            self.bt[slot].copy_(stacks[1], non_blocking=True)

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[rows] += (x[rows] A^T) B^T of each row's adapter, in place; returns `out`.
        x: [T, in], out: [T, out] (the base projection's fresh output). On the CPU in fp32, by
        the C kernel (`workers.kernels.lora_add`: ~3x less time than these matmuls at a
        prefill of 32 x 64 tokens under 8 adapters)."""
        batch = self.batch
        if lora_add.takes(x, out, self.a):
            return lora_add.lora_add(x, out, self.a, self.bt, self.ends, batch.rows,
                                     batch.segment_table)
        xs = x.index_select(0, batch.rows)  # [N, in], grouped by slot
        if len(batch.segments) == 1:
            slot = batch.segments[0][0]
            delta = torch.mm(torch.mm(xs, self.a[slot].t()), self.bt[slot])
        else:  # every segment at once, padded to the longest: [S, longest, in]
            xs = torch.cat((xs, xs.new_zeros(1, xs.shape[1])))[batch.padded]
            a, bt = self.a[batch.slot_ids], self.bt[batch.slot_ids]  # [S, width, in | out]
            delta = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), bt)
            delta = delta.flatten(0, 1).index_select(0, batch.real)  # [N, out], grouped
        # the rows are distinct: gathered, added, written back (index_add_ took ~40 ms a call
        # on CPU here, against well under 1 ms for these three)
        return out.index_copy_(0, batch.rows, out.index_select(0, batch.rows).add_(delta))


def lora_active(batch: LoraBatch | None) -> bool:
    """Whether the step has adapter rows (a fused fast path that skips the hooks must not run)."""
    return batch is not None and batch.active
