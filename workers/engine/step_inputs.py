"""A whole step's device inputs from its `StepMessage`, in one asynchronous upload.

The eager path of the single-GPU executor (`workers.engine.cuda_graphs.CudaGraphExecutor`) builds
its inputs here: token ids, positions, slot mapping, query starts, sequence lengths, the padded
block tables and the logit rows go to the device as one pinned, non-blocking copy
(`host_transfer.upload`), so the step's only host wait is its token copy-back. Layers then read the
metadata as it is: nothing in a layer goes back to the host.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from workers.attention import AttentionMetadata
from workers.kernels.host_transfer import upload
from workers.engine.parallel.messages import StepMessage


class TokenFill(NamedTuple):
    """Input ids the host does not have yet: rows of a step's input ids to overwrite on the
    device with the previous step's sampled tokens (async scheduling,
    `workers.engine.async_step`)."""

    rows: torch.Tensor  # [k] int64, on the step's device
    tokens: torch.Tensor  # [k] int64, on the step's device


def fill_input_ids(ids: torch.Tensor, fill: TokenFill | None) -> None:
    """Write `fill`'s tokens into the input ids `ids` in place (on the device, no host wait);
    nothing when `fill` is None."""
    if fill is not None:
        ids.index_copy_(0, fill.rows, fill.tokens)


class StepTensors(NamedTuple):
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [len(msg.logit_rows)] int64: the rows whose logits are computed


def step_tensors(msg: StepMessage, device: torch.device) -> StepTensors:
    """Everything the step's forward reads, on `device` (block tables padded with 0 to the
    longest). One host->device transfer that does not wait for the device."""
    starts = list(msg.query_start_loc)
    seq_lens = list(msg.seq_lens)
    tables = msg.block_tables
    width = max(len(t) for t in tables)
    flat = [*msg.input_ids, *msg.positions, *msg.slot_mapping, *starts, *seq_lens,
            *msg.logit_rows]
    for table in tables:
        flat.extend(table)
        flat.extend([0] * (width - len(table)))
    staged = upload(flat, device)
    num_tokens, num_seqs = msg.num_tokens, msg.num_seqs
    ids, positions, slots, query_start, lens, rows, table_rows = staged.split(
        [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, len(msg.logit_rows),
         num_seqs * width])
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=query_start.to(torch.int32),
        seq_lens=lens.to(torch.int32),
        block_tables=table_rows.view(num_seqs, width).to(torch.int32),
        num_decodes=msg.num_decodes,
        max_query_len=max(b - a for a, b in itertools.pairwise(starts)),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    return StepTensors(ids, positions, meta, rows)
