"""Fused Triton kernels for a decode step's small ops on CUDA devices (vLLM-style), each with a
torch fallback the callers use elsewhere:

- `fused_norm.rms_norm`: RMSNorm, optionally after a residual add (`fused_add_rms_norm`), and
  Gemma's `1 + weight` scaling: one launch where torch issues ~8 ops;
- `rope_kv.rope_and_store`: RoPE of q and k at their positions from the shared cos/sin cache,
  and k and v stored into the paged KV cache at their slots: one launch where torch issues ~16
  ops and two `index_copy_`;
- `act_mul.act_and_mul`: silu(gate) * up (or gelu-tanh) from the fused gate_up output.

`use_triton(x)` says whether these kernels serve tensor x: on CUDA when triton is installed; on
the CPU only when a test set `interpret_on_cpu` (and TRITON_INTERPRET=1 before the kernels'
first import), so the interpreter proves the kernels there. The CPU path proper keeps its C
kernels (`workers.kernels.norm_rope`): the interpreter is orders of magnitude slower.

The modules with kernels import triton; they are imported only when `use_triton` says yes.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

# set by tests only: run the kernels on CPU tensors in Triton's interpreter
interpret_on_cpu = False


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernels here serve tensors on x's device."""
    if x.is_cuda:
        return triton_installed()
    return interpret_on_cpu and x.is_cpu and triton_installed()
