"""Which captured CUDA-graph size a decode step pads to: the one decision both the
single-process graph executor (`workers.engine.cuda_graphs`) and a worker group's driver make.

A group's driver makes it for all its ranks and sends the answer in the `StepMessage`
(`graph_size`), so every rank replays the same graph for the same step: their captured
all-reduces must pair up. Kept apart from `workers.engine.cuda_graphs` (which builds on
`LocalExecutor`) so the driver's `GroupExecutor` can import it without a cycle.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.engine.parallel.messages import StepMessage


def capture_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every multiple of 8 up to the maximum (and
    the maximum itself). Padding to the next size wastes under 8 rows above 8."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    sizes = {s for s in (1, 2, 4) if s < max_batch_size}
    sizes.update(range(8, max_batch_size + 1, 8))
    sizes.add(max_batch_size)
    return sorted(sizes)


def padded_size(msg: StepMessage, sizes: Sequence[int], max_seq_len: int,
                max_blocks: int) -> int | None:
    """The captured size (of ascending `sizes`) `msg` pads to, or None when it must run
    eagerly: not a pure decode, more sequences than the largest size, a context longer than
    `max_seq_len` tokens, or a block table wider than `max_blocks` (the graphs' table
    buffer)."""
    n = msg.num_seqs
    if not sizes or not (msg.num_decodes == n == msg.num_tokens) or n > sizes[-1] or n == 0:
        return None
    if max(msg.seq_lens) > max_seq_len:
        return None
    if max(len(t) for t in msg.block_tables) > max_blocks:
        return None  # more blocks than the context needs (never expected): stay eager
    return next(s for s in sizes if s >= n)
