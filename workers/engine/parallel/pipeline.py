"""Pipeline parallelism: layers split into stages, a batch into micro-batches of sequences.

Stage s runs micro-batch m as soon as it has received m's hidden states from stage s - 1, and
sends its output to stage s + 1 without waiting, so with M micro-batches and P stages the
stages idle for (P - 1) of the (M + P - 1) slots of a step: the bubble.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from workers.attention import AttentionMetadata
from workers.kernels.host_transfer import upload
from workers.engine.parallel.messages import StepMessage


def stage_layers(num_layers: int, pp_size: int) -> list[range]:
    """Contiguous layer ranges, one per stage; earlier stages take the remainder."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} must be between 1 and the model's "
                         f"num_hidden_layers={num_layers}")
    base, extra = divmod(num_layers, pp_size)
    ranges, start = [], 0
    for stage in range(pp_size):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


@dataclass(frozen=True)
class MicroBatch:
    """Sequences [first_seq, end_seq) of a step, tokens [first_row, end_row)."""

    first_seq: int
    end_seq: int
    first_row: int
    end_row: int

    @property
    def num_tokens(self) -> int:
        return self.end_row - self.first_row


def split_microbatches(msg: StepMessage) -> list[MicroBatch]:
    """Up to `msg.num_microbatches` groups of whole sequences with about equal token counts."""
    starts = msg.query_start_loc
    count = max(1, min(msg.num_microbatches, msg.num_seqs))
    target = msg.num_tokens / count
    batches: list[MicroBatch] = []
    first = 0
    for seq in range(msg.num_seqs):
        remaining_seqs = msg.num_seqs - seq - 1
        remaining_batches = count - len(batches) - 1
        full = starts[seq + 1] - starts[first] >= target
        if remaining_batches > 0 and (full or remaining_seqs <= remaining_batches):
            batches.append(MicroBatch(first, seq + 1, starts[first], starts[seq + 1]))
            first = seq + 1
    batches.append(MicroBatch(first, msg.num_seqs, starts[first], starts[msg.num_seqs]))
    return [b for b in batches if b.end_seq > b.first_seq]


def ideal_bubble_fraction(pp_size: int, num_microbatches: int) -> float:
    """Idle fraction of a GPipe-style forward: (P - 1) / (M + P - 1)."""
    return (pp_size - 1) / (num_microbatches + pp_size - 1)


def measured_bubble_fraction(step_wall_s: float, stage_busy_s: list[float]) -> float:
    """1 - (busy stage-seconds) / (stages x step wall time)."""
    if step_wall_s <= 0 or not stage_busy_s:
        return 0.0
    return max(0.0, 1.0 - sum(stage_busy_s) / (len(stage_busy_s) * step_wall_s))


def microbatch_tensors(
    msg: StepMessage, mb: MicroBatch, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The micro-batch's token ids [T], positions [T] and attention metadata, on `device`.

    Every integer goes to the device in one host->device copy that the host does not wait for
    (`host_transfer.upload`); the fields are views or casts of that one tensor."""
    rows = slice(mb.first_row, mb.end_row)
    seqs = slice(mb.first_seq, mb.end_seq)
    starts = [s - mb.first_row for s in msg.query_start_loc[mb.first_seq:mb.end_seq + 1]]
    seq_lens = list(msg.seq_lens[seqs])
    tables = msg.block_tables[seqs]
    width = max(len(t) for t in tables)
    flat = [*msg.input_ids[rows], *msg.positions[rows], *msg.slot_mapping[rows], *starts,
            *seq_lens]
    for table in tables:
        flat.extend(table)
        flat.extend([0] * (width - len(table)))
    staged = upload(flat, device)  # pinned and without a host wait on a GPU
    num_tokens, num_seqs = mb.num_tokens, len(seq_lens)
    ids, positions, slots, query_start, lens, table_rows = staged.split(
        [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs * width])
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=query_start.to(torch.int32),
        seq_lens=lens.to(torch.int32),
        block_tables=table_rows.view(num_seqs, width).to(torch.int32),
        num_decodes=max(0, min(msg.num_decodes, mb.end_seq) - mb.first_seq),
        max_query_len=max(b - a for a, b in itertools.pairwise(starts)),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    return ids, positions, meta
