"""A decode step's Llama decoder layers in one C call on the CPU (`csrc/decoder_layer.c`): for a
few fp32 rows, every layer's norms, projections, RoPE, K/V write, paged attention and MLP, by
the kernels the unfused path calls one by one from Python (norm_rope, small_gemm, int_gemm,
gguf_gemm, paged_decode), linked into one library, so the results are that path's bit for bit.

Decided once, at load (`use_fused_decoder_stack`): a stack takes it when every layer is a plain
Llama layer on the CPU in fp32 whose projections are fp32 weights carrying the small-batch
kernels or int8/int4 ones packed for the VNNI kernels (`EngineConfig.fp32_int_kernels`; int8
without zero points: the unfused layer subtracts those in torch; the MLP's activation product
then by `small_gemm.act_and_mul`'s C code, fused or not) or a GGUF file's Q8_0/Q4_0/Q4_1 blocks
(`EngineConfig.gguf_packed`, likewise), no biases, no q/k norm, no attention
sinks, one tensor-parallel rank and the `cpu` attention backend (a sliding window is fine: the
attention kernel takes one). bf16 activations are refused: the stack's arithmetic is fp32.
Per step (`FusedDecoderStack.takes`): at most `MAX_ROWS` rows (`MAX_PACKED_ROWS` with
int8/int4 projections, `MAX_GGUF_ROWS` with GGUF ones only) over fp32 or bf16 caches; else the
layers run one by one, unchanged.
Rows need not be one per sequence: a speculative verification's k + 1 rows (or a short prefill
chunk) are each attended as a decode row over its own prefix (`row_attention`), so a step of a
few rows reads the weights once, as a decode step does. SmolLM2's Q4_1 file served packed, one
sequence at 300 tokens, 1 thread, forward and logits, paired with a 1-row step in the same
loop on a loaded 2-core machine: 5 rows 1.7-1.9x a 1-row step (with csrc/gguf_gemm.c's wide
passes), against 3.6-4.2x layer by layer before (SDPA's prefill attention, 2 passes per block).

Measured on this 2-core machine (`benchmarks/small_gemm.py`, the engine on the `small` preset,
2 threads, fused and unfused steps alternating in the same engine, five runs while other tests
ran beside them): decode steps 1.37-1.57x as fast at 1 stream (3.2-8.7 ms a step fused against
5.1-12.5), 1.23-1.35x at 4, 1.19-1.25x at 8. Its int8 / int4 (group 32) copies packed in fp32
(one quiet run): 2.09 / 1.49 / 1.34x and 2.11 / 1.55 / 1.30x at 1 / 4 / 8 streams (int8 1.67 ms
a step at 1 stream), 1.3-2.2x the same checkpoints in a bf16 engine. Dense fp32 up to 32 rows
(the small-batch kernel's limit since it reads each weight tile once for all rows): 1.2x at 16
streams (23 ms a step against 28.5), 1.14x at 32 (40 against 46), one run beside other work.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workers.kernels import norm_rope, small_gemm
from workers.attention import cpu_backend
from workers.attention.backend import AttentionMetadata
from workers.models.attention import LlamaAttention
from workers.models.norm import RMSNorm
from workers.models.lora.projection import LoraBatch
from workers.kernels.native import build_library, loads
from workers.kernels import gguf_gemm as gguf_kernels
from workers.kernels import gguf_vnni
from workers.kernels import int_gemm as int_kernels
from workers.quant import gguf_packed
from workers.quant.gguf_packed import GGUFMatmul, GGUFVnniMatmul
from workers.quant.linear import QuantizedMatmul
from workers.models.fused_abi import (DENSE, GGUF_KINDS, GGUF_VNNI, Layer, LoraStep,
                                     layer_struct)

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parents[1] / "kernels" / "csrc" / "decoder_layer.c"
LINKED = (norm_rope.SOURCE, small_gemm.SOURCE, int_kernels.SOURCE, gguf_kernels.SOURCE,
          gguf_vnni.SOURCE, cpu_backend.SOURCE)
MAX_ROWS = small_gemm.MAX_ROWS[torch.float32]  # the fused MLP's and the fp32 matmul's limit
# a stack with int8/int4 projections: the rows the VNNI kernels are built for (more are
# compute-bound there; the layers one by one give them to `QuantizedMatmul`'s choice)
MAX_PACKED_ROWS = 8
# a stack with GGUF projections only: the rows its block kernel is ahead of dequantizing for
# (at 32 streams of SmolLM2's Q4_1 file, offline: 258-284 tokens/s against 131-143 with 8)
MAX_GGUF_ROWS = gguf_packed.DECODE_ROWS
_ERRORS = {-1: (IndexError, "a position is outside a layer's rotary cache"),
           -2: (IndexError, "a slot is outside the KV cache"),
           -3: (MemoryError, "the fused decoder layers could not allocate their scratch"),
           -4: (RuntimeError, "an int8/int4 kernel of the fused decoder layers failed")}


@functools.cache
def load_kernel() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(SOURCE, sources=LINKED)))
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.decoder_stack_f32.argtypes = [ptr, i32, ptr, i32, i64, i64, ptr, ptr, ptr, ptr, i64,
                                      ptr, ptr, ptr, i64, ptr, ctypes.POINTER(LoraStep), i32]
    lib.decoder_stack_f32.restype = i32
    return lib


@functools.cache
def available() -> bool:
    """Whether the kernel builds and loads here; warns once, with the reason, when it does not."""
    return loads(load_kernel, "the fused decoder-layer kernel is unavailable, running the "
                              "layers one kernel at a time", logger)


# The layers here are Llama's decoder layers, attention and linear layers, read by attribute:
# `workers.models.llama` imports this module, so they are typed `Any` (checked by `refusal`).


def _fusable(layer: Any) -> bool:
    """A dense fp32 CPU weight through the small-batch kernel, or an int8/int4 one packed for
    the VNNI kernels (without int8 zero points: the unfused layer subtracts those in torch),
    unbiased, on one rank."""
    if layer.bias is not None or layer.tp_size != 1:
        return False
    if isinstance(layer.matmul, QuantizedMatmul):
        return layer.matmul.c_callable
    if isinstance(layer.matmul, (GGUFMatmul, GGUFVnniMatmul)):
        return True
    if not isinstance(layer.matmul, small_gemm.SmallBatchMatmul):
        return False  # torch's linear
    w = layer.weight
    return w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous()


def refusal(layer: Any, layer_type: type[Any], mlp_type: type[Any]
            ) -> str | None:
    """Why `layer` cannot run fused; None when it can. `layer_type`, `mlp_type`: the plain
    Llama decoder layer and MLP (workers.models.llama, which imports this module's type)."""
    if type(layer) is not layer_type or type(layer.self_attn) is not LlamaAttention:
        return f"{type(layer).__name__} is not a plain Llama decoder layer"
    attn, mlp = layer.self_attn, getattr(layer, layer.mlp_name)
    if not isinstance(attn.attn_backend, cpu_backend.CpuAttentionBackend):
        return f"the {attn.attn_backend.name} attention backend, not cpu"
    dtype = layer.input_layernorm.weight.dtype
    if dtype != torch.float32:  # packed int8/int4 weights in a bf16 model are not fp32 rows
        return f"{dtype} activations, not fp32"
    if not (_fusable(attn.qkv_proj) and _fusable(attn.o_proj)):
        return ("q/k/v or o_proj is not a dense fp32 CPU weight, GGUF blocks or a VNNI-packed "
                "int8/int4 one without zero points (int8), without bias on one rank")
    if type(mlp) is not mlp_type or mlp.small_batch is None:
        return "the MLP does not take the fused small-batch MLP kernel (dense or packed)"
    if attn.qk_norm or attn.sinks is not None or attn.rope_in_backend:
        return "q/k norm, attention sinks or RoPE in the backend"
    cache = attn.rotary_emb.cos_sin_cache
    if attn.head_dim % 8 or cache.dtype != torch.float32 or cache.stride(-1) != 1:
        return "head_dim not a multiple of 8, or a rotary cache not fp32 rows"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(n) is not RMSNorm or n.weight.dtype != torch.float32
           or not n.weight.is_contiguous() for n in norms):
        return "a norm that is not a plain fp32 RMSNorm"
    return None


class FusedDecoderStack:
    """A stage's decoder layers as one kernel call for a few decode rows (`takes`). Holds the
    weights' addresses, taken at load: the weights must stay where they are (loading into them
    again copies in place, which is fine; replacing a parameter is not)."""

    def __init__(self, layers: list[Any]) -> None:
        self.layers = layers  # keeps the weights the structs point at alive
        self.structs = self.link()
        attn = layers[0].self_attn
        self.kv_shape = (attn.num_kv_heads, attn.head_dim)
        self.kv_pointers = ctypes.c_void_p * len(layers)
        self.fn = load_kernel().decoder_stack_f32
        kinds = {getattr(s, p).kind for s in self.structs for p in Layer.PROJECTIONS}
        self.max_rows = (MAX_ROWS if kinds == {DENSE} else
                         MAX_GGUF_ROWS if kinds <= {*GGUF_KINDS.values(), GGUF_VNNI}
                         else MAX_PACKED_ROWS)

    def link(self) -> ctypes.Array[Layer]:
        """The layers' structs, their LoRA stacks included: called again (`structs`) when
        workers.models.lora hooks the projections after load."""
        self.structs = (Layer * len(self.layers))(*(layer_struct(x) for x in self.layers))
        return self.structs

    def takes(self, hidden: torch.Tensor, meta: AttentionMetadata,
              kv_caches: list[torch.Tensor]) -> bool:
        """Whether this step runs fused: 1..`max_rows` rows in all, fp32, over contiguous fp32
        or bf16 caches of the layers' shape. A sequence may have several rows (a speculative
        verification's k + 1, a short prefill chunk): each is attended as a decode row of its
        own (`row_attention`)."""
        rows = hidden.shape[0]
        if not 0 < rows <= self.max_rows or hidden.dtype != torch.float32:
            return False
        first = kv_caches[0]
        shape, dtype = first.shape, first.dtype
        return (dtype in cpu_backend.KV_DTYPES and shape[0] == 2
                and tuple(shape[3:]) == self.kv_shape
                and all(c.shape == shape and c.dtype == dtype and c.is_contiguous()
                        for c in kv_caches))

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor,
                 kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                 lora: LoraBatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after the stack, as the layers one by one return them, from the
        stack's input `hidden` [rows, H] (not written). K/V land in `kv_caches`. `lora`: the
        step's adapter rows (their products added in the kernel), or None / inactive."""
        hidden = hidden.contiguous()
        out, residual = torch.empty_like(hidden), torch.empty_like(hidden)
        first = kv_caches[0]
        tables, lens = row_attention(meta, hidden.shape[0])
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        if tables.stride(-1) != 1:
            tables = tables.contiguous()
        rc = self.fn(self.structs, len(self.layers),
                     self.kv_pointers(*(c.data_ptr() for c in kv_caches)),
                     int(first.dtype == torch.bfloat16), first.shape[1] * first.shape[2],
                     first.shape[2], hidden.data_ptr(), None, out.data_ptr(),
                     residual.data_ptr(), hidden.shape[0], positions.data_ptr(),
                     slots.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
                     _step(lora), torch.get_num_threads())
        if rc != 0:
            error, what = _ERRORS.get(rc, (RuntimeError, f"the fused layers failed ({rc})"))
            raise error(what)
        return out, residual


def row_attention(meta: AttentionMetadata, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block tables [rows, W] int32, context lengths [rows] int32) of the step's query rows,
    each attended as a decode row: row j of a sequence with n new tokens and context length L
    reads its sequence's blocks up to length L - n + 1 + j, itself included. The kernel writes
    every row's K/V before any row attends, so that is the causal attention of a
    prefill-style chunk, and a verification's rows are computed as decoding them one at a time
    computes them. A decode-only step's own tensors."""
    tables = meta.block_tables.to(torch.int32)
    if meta.num_decodes == rows:
        return tables, meta.seq_lens.to(torch.int32).contiguous()
    starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    owners: list[int] = []
    lens: list[int] = []
    for seq, length in enumerate(seq_lens):
        n = starts[seq + 1] - starts[seq]
        owners += [seq] * n
        lens += range(length - n + 1, length + 1)
    if len(lens) != rows:
        raise ValueError(f"the step's metadata has {len(lens)} query rows, the hidden states "
                         f"{rows}")
    index = torch.tensor(owners, device=tables.device)
    return (tables.index_select(0, index),
            torch.tensor(lens, dtype=torch.int32, device=tables.device))


def _step(lora: LoraBatch | None) -> Any:
    """A pointer to the step's adapter rows for the kernel; None (NULL) without any."""
    if lora is None or not lora.active:
        return None
    rows, table = lora.rows, lora.segment_table
    return ctypes.byref(LoraStep(rows.data_ptr(), table.data_ptr(), table.shape[0],
                                 rows.shape[0], None))


def use_fused_decoder_stack(model: nn.Module, stack_type: type[nn.Module],
                            layer_type: type[nn.Module], mlp_type: type[nn.Module]) -> int:
    """Gives every `stack_type` (LlamaModel) in `model` whose layers all take it (`refusal`) the
    fused stack (its `fused_stack`), when the kernel builds here. Returns how many layers took
    it."""
    count = 0
    for module in model.modules():
        if not isinstance(module, stack_type):
            continue
        stack: Any = module  # a LlamaModel (see above)
        layers = list(stack.layers.values())
        if not layers or any(refusal(layer, layer_type, mlp_type) is not None
                             for layer in layers):
            continue
        if not available():
            return 0
        stack.fused_stack = FusedDecoderStack(layers)
        count += len(layers)
    return count
