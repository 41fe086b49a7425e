"""CUDA graphs on a rank of a tensor-parallel group: its pure-decode steps replayed.

A rank whose `RankSetup.graph_batch_size` is set allocates one KV block more than the group's
cache (the sink block: padded rows' K/V land there, never in a real sequence's blocks) and,
when the driver's `CaptureGraphs` comes (once, after every rank is ready), builds the
single-process `CudaGraphExecutor` over its shard and its caches: an eager warm-up, then every
size of the ladder captured largest first. Every rank of the group does this at the same time
with the same sizes, so the all-reduces and all-gathers of the shard's forward (NCCL, which
captures collectives when every rank captures the same sequence) run and are captured in
lockstep. A step's `graph_size` (the driver's choice) then says which graph every rank replays.

On the CPU nothing is captured: the same static buffers and padding run eagerly (tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import time

import torch

from workers.engine.cuda_graphs import CudaGraphExecutor, graphs_supported
from workers.engine.parallel.messages import CaptureGraphs, GraphsCaptured, StepMessage

if TYPE_CHECKING:
    from workers.models.llama import LlamaForCausalLM


class RankGraphs:
    """The static-buffer decode path of one rank (`None` sizes: its model cannot be captured).

    `caches`: the rank's, with block `sink_block` (the last) owned by no request."""

    def __init__(self, rank: int, model: LlamaForCausalLM, caches: list[torch.Tensor],
                 device: torch.device, sink_block: int, request: CaptureGraphs) -> None:
        sizes = list(request.sizes)
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"rank {rank}: capture sizes {request.sizes} are not ascending "
                             "positive batch sizes")
        started = time.perf_counter()
        self.rank = rank
        self.captured = device.type == "cuda"
        self.executor: CudaGraphExecutor | None = None
        if self.captured and not graphs_supported(model, model.attn_backend, device):
            self.captured = False  # e.g. MoE: the same answer on every rank (the same model)
            sizes = []
        if sizes:
            self.executor = CudaGraphExecutor(
                model, caches, device, sink_block=sink_block, max_batch_size=sizes[-1],
                max_seq_len=request.max_seq_len, capture=False)
            if self.captured:
                self.executor.warm_up()
                self.executor.capture(sizes)  # largest first, as on every other rank
        self.sizes = tuple(sizes)
        self.reply = GraphsCaptured(rank, self.sizes, self.captured,
                                    time.perf_counter() - started)

    def run(self, msg: StepMessage) -> torch.Tensor:
        """The logits of `msg.logit_rows`, the step padded to `msg.graph_size` rows."""
        if self.executor is None or msg.graph_size not in self.sizes:
            raise ValueError(f"rank {self.rank}: step {msg.step_id} asks for graph size "
                             f"{msg.graph_size}; this rank serves {self.sizes}")
        return self.executor.run_padded(msg, msg.graph_size)
