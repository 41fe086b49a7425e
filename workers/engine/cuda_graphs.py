"""Decode steps replayed from CUDA graphs.

At small batch sizes a decode step's kernels are shorter than the Python and launch work that
issues them: a Llama-3-8B layer is a dozen kernels of a few microseconds each. Capturing the
whole forward once per batch size and replaying it removes that host work (vLLM and SGLang do
the same). A ladder of batch sizes is captured (1, 2, 4, 8, then every 8 up to the maximum);
a step's batch is padded to the next captured size and copied into persistent input buffers
the graphs read. Padded rows are one-token sequences whose K/V land in a sink block that no
request owns, so padding never touches a real sequence's cache. Larger batches, prefill and
mixed steps run eagerly, with their inputs built by `workers.engine.step_inputs` (one asynchronous
upload per step, as the static path's `_load`).

A step's block tables are uploaded incrementally: the executor remembers which prefix of each
buffer row it wrote, and a row whose table only grew (a decode appending a block every
`block_size` tokens) gets just its new entries.

Only attention backends that read sequence lengths and block tables on the device, without
host syncs (`AttentionBackend.cuda_graph_safe`), and models without data-dependent host work
(not the MoE models, whose expert dispatch reads counts on the host) can be captured.

Every graph writes its logits into one fp32 buffer sized for the largest batch (a graph's
rows are its leading rows), and all graphs share one memory pool, captured largest first so the
smaller ones reuse what the largest freed: one logits buffer, not one per size (at a 128k
vocabulary that is 0.5 GB per 1000 captured rows). `workers.engine.memory_profile` measures what the
largest graph holds before the KV cache is sized.

Without a GPU (`capture=False`) the same static-buffer path runs the forward eagerly, so the
padding, the buffers and the sink block are tested on CPU.
"""

from __future__ import annotations

import logging
import time

from typing import TYPE_CHECKING

import torch

from workers.attention import AttentionMetadata
from workers.kernels.host_transfer import upload
from workers.engine.parallel.graph_ladder import capture_sizes, padded_size
from workers.engine.parallel.local import LocalExecutor
from workers.engine.parallel.messages import StepMessage
from workers.engine.step_inputs import fill_input_ids, step_tensors

if TYPE_CHECKING:
    from workers.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

__all__ = ["CudaGraphExecutor", "capture_sizes", "graphs_supported"]


def graphs_supported(model: torch.nn.Module, backend: object, device: torch.device) -> bool:
    """Whether decode steps of `model` with attention `backend` can be captured on `device`."""
    return (device.type == "cuda" and getattr(backend, "cuda_graph_safe", False)
            and getattr(model, "cuda_graph_safe", True))


class CudaGraphExecutor(LocalExecutor):
    """A `LocalExecutor` whose pure-decode steps of up to `max_batch_size` sequences replay a
    captured graph. `caches` must hold one block more than the KV manager hands out: block
    `sink_block` takes the padded rows' K/V. `max_seq_len`: the longest context a captured
    step may attend over (the model's context length)."""

    def __init__(self, model: LlamaForCausalLM, caches: list[torch.Tensor],
                 device: torch.device, *,
                 sink_block: int, max_batch_size: int, max_seq_len: int,
                 capture: bool = True, host_blocks: int = 0) -> None:
        super().__init__(model, caches, device, host_blocks)
        self._backend_graph_safe = model.attn_backend.cuda_graph_safe
        self.sizes = capture_sizes(max_batch_size)
        self.max_seq_len = max_seq_len
        _, num_blocks, self.block_size, _, _ = caches[0].shape
        if not 0 <= sink_block < num_blocks:
            raise ValueError(f"sink_block={sink_block} is outside the cache's {num_blocks} blocks")
        self.sink_block = sink_block
        width = -(-max_seq_len // self.block_size)
        rows = self.sizes[-1]
        # The persistent inputs. Rows past a step's batch keep the padding values: a one-token
        # sequence at position 0 whose K/V go to the sink block.
        self._input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self._positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self._slots = torch.full((rows,), sink_block * self.block_size, dtype=torch.int64,
                                 device=device)
        self._seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self._tables = torch.full((rows, width), sink_block, dtype=torch.int32, device=device)
        self._query_start = torch.arange(rows + 1, dtype=torch.int32, device=device)
        # per buffer row: the table prefix it holds (what `_load` wrote; the rest is stale)
        self._written: list[tuple[int, ...]] = [(sink_block,) * width] * rows
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: torch.Tensor | None = None  # [rows, vocab] fp32, every graph's output
        self.replayed_steps = 0  # steps served from the static buffers (graphs or, on CPU, eager)
        if capture:
            self.warm_up()  # the variants the ladder's capture would not compile
            self.capture()

    # ---- ModelExecutor (kv_caches_by_rank: LocalExecutor's) ---------------------------------

    def execute(self, msg: StepMessage) -> torch.Tensor:
        size = self._graph_size(msg)
        self.copy_tiers(msg)
        if size is None:
            ids, positions, meta, rows = step_tensors(msg, self.device)
            fill_input_ids(ids, self.token_fill)
            hidden = self.model(ids, positions, self.caches, meta)  # [T, hidden]
            return self.model.compute_logits(hidden.index_select(0, rows))
        return self.run_padded(msg, size)

    def run_padded(self, msg: StepMessage, size: int) -> torch.Tensor:
        """Runs pure-decode step `msg` padded to `size` rows (a size of the ladder, at least
        `msg.num_seqs`: what `padded_size` chose) from the static buffers (a graph's replay
        where captured); the logits of `msg.logit_rows`. No tier copies: the caller's."""
        if size not in self.sizes or size < msg.num_seqs:
            raise ValueError(f"step {msg.step_id} of {msg.num_seqs} sequences cannot be padded "
                             f"to {size} rows; the ladder is {self.sizes}")
        rows = self._load(msg, size)
        fill_input_ids(self._input_ids, self.token_fill)
        if self._graphs and self._logits is not None:  # the graphs write `_logits`
            self._graphs[size].replay()
            logits = self._logits[:size]
        elif self._backend_graph_safe:
            logits = self._forward(size, self._meta(size))  # exactly what a capture bakes in
        else:
            logits = self._forward(size, self._meta(size, list(msg.seq_lens)))
        self.replayed_steps += 1
        # a copy: the graph's output buffer is overwritten by the next replay
        return logits.index_select(0, rows)

    # ---- the static path -------------------------------------------------------------------

    def _graph_size(self, msg: StepMessage) -> int | None:
        """The captured size this step pads to, or None when it must run eagerly."""
        return padded_size(msg, self.sizes, self.max_seq_len, self._tables.shape[1])

    def _load(self, msg: StepMessage, size: int) -> torch.Tensor:
        """Copies the step into the persistent buffers with one asynchronous host->device
        transfer; rows [n, size) are reset to padding (a previous, larger step may have used
        them). Returns the step's logit rows on the device."""
        n = msg.num_seqs
        sink_slot = self.sink_block * self.block_size
        pad = size - n
        cells, values = self._table_updates(msg.block_tables, size)
        num_rows, num_cells = len(msg.logit_rows), len(cells)
        staged = upload([*msg.input_ids, *([0] * pad), *msg.positions, *([0] * pad),
                         *msg.slot_mapping, *([sink_slot] * pad), *msg.seq_lens, *([1] * pad),
                         *msg.logit_rows, *cells, *values], self.device)
        ids, positions, slots, lens, rows, cells_d, values_d = staged.split(
            [size, size, size, size, num_rows, num_cells, num_cells])
        self._input_ids[:size].copy_(ids)
        self._positions[:size].copy_(positions)
        self._slots[:size].copy_(slots)
        self._seq_lens[:size].copy_(lens)
        if num_cells:
            self._tables.view(-1).index_copy_(0, cells_d, values_d.to(torch.int32))
        return rows

    def _table_updates(self, tables: tuple[tuple[int, ...], ...],
                       size: int) -> tuple[list[int], list[int]]:
        """(flat cell indices, block ids) to write so rows [0, size) of the table buffer begin
        with the step's tables (padding rows with the sink block); updates `_written`. Only
        the columns a row reads matter: a row's columns past its length are never read."""
        width = self._tables.shape[1]
        cells: list[int] = []
        values: list[int] = []
        written = self._written
        for row in range(size):
            table = tables[row] if row < len(tables) else (self.sink_block,)
            old = written[row]
            if table is old or table == old[:len(table)]:
                continue  # the row already begins with it (a padding row: with the sink)
            start = len(old) if table[:len(old)] == old else 0
            cells.extend(range(row * width + start, row * width + len(table)))
            values.extend(table[start:])
            written[row] = table
        return cells, values

    def _meta(self, size: int, seq_lens: list[int] | None = None) -> AttentionMetadata:
        """Metadata over the persistent buffers. Captured graphs bake in the host fields, so
        for capture they hold the bound (`max_seq_len`), which graph-safe backends never read
        per row; the eager CPU path passes the real lengths."""
        if seq_lens is None:
            host_lens = [self.max_seq_len] * size
        else:
            host_lens = seq_lens + [1] * (size - len(seq_lens))
        return AttentionMetadata(
            slot_mapping=self._slots[:size], query_start_loc=self._query_start[:size + 1],
            seq_lens=self._seq_lens[:size], block_tables=self._tables[:size],
            num_decodes=size, max_query_len=1, max_seq_len=max(host_lens),
            query_start_loc_cpu=list(range(size + 1)), seq_lens_cpu=host_lens)

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(self._input_ids[:size], self._positions[:size], self.caches, meta)
        return self.model.compute_logits(hidden)

    def warm_up(self) -> None:
        """Runs one padded row eagerly twice: with the attention split over the longest context
        (`max_seq_len`) and unsplit (a one-token context), so that on a GPU every decode kernel
        variant the engine can launch (split and merge, or direct) is compiled now, not while
        serving. Writes only the sink block."""
        with torch.inference_mode():
            self._forward(1, self._meta(1))
            self._forward(1, self._meta(1, [1]))

    @torch.inference_mode()
    def capture(self, sizes: list[int] | None = None) -> None:
        """Captures `sizes` (default: every size of the ladder; each must be on it), largest
        first, into one memory pool, so the later, smaller graphs reuse what the first one
        freed. Each size runs twice eagerly before capture (Triton compiles its kernels on
        first launch; capture must not). Every graph writes its logits into `_logits`, one
        buffer for the largest size, allocated before the first capture outside the pool."""
        sizes = sorted(self.sizes if sizes is None else sizes, reverse=True)
        if not set(sizes) <= set(self.sizes):
            raise ValueError(f"sizes {sizes} are not all on the ladder {self.sizes}")
        started = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        pool = None
        for size in sizes:
            meta = self._meta(size)
            with torch.cuda.stream(stream):
                for _ in range(2):
                    logits = self._forward(size, meta)
            stream.synchronize()
            if self._logits is None:
                self._logits = torch.empty(self.sizes[-1], logits.shape[1],
                                           dtype=logits.dtype, device=self.device)
            del logits
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._logits[:size].copy_(self._forward(size, meta))
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch %d-%d) in %.1f s", len(sizes),
                    sizes[-1], sizes[0], time.perf_counter() - started)
