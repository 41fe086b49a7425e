"""How many device kernels one decode step of the tiny Llama issues per decoder layer on the GPU
code path (Triton attention backend, no CPU-only C kernels), counted on CPU.

What counts as a kernel:
- every aten op the step dispatches (recorded under a `TorchDispatchMode`), except the ops in
  `NON_LAUNCHING`: views and metadata (`view`, `_unsafe_view`, `reshape` and `t` of what needs no
  copy, `slice`, `select`, `split`, `unsqueeze`, `expand`, `as_strided`, `detach`, ...) and bare
  allocations (`empty`, `empty_like`, `empty_strided`), which launch nothing on a GPU;
- every Triton kernel launch (`JITFunction.run`, or the interpreter's `InterpretedFunction.run`
  here, patched to count); the aten ops the interpreter itself issues to run a kernel on CPU
  are not counted (on a GPU the launch is one kernel).

The count covers the model's forward and its logits (`compute_logits`) for a batch of two
decoding sequences, divided by the number of decoder layers; the embedding, the final norm and
the LM head are shared out over the layers. The C kernels that serve the CPU path
(`workers.kernels.norm_rope`, `workers.kernels.small_gemm`) are switched off and the CUDA path's Triton kernels
(`workers.kernels`) switched on, so the ops are those a GPU runs.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason=("counts launches of the kernels run in Triton's CPU interpreter on a CPU model; on a "
            "GPU host they are compiled for the GPU and cannot take CPU tensors"))

if not torch.cuda.is_available():
    # before the kernels are imported: triton reads it when @triton.jit decorates
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="the GPU code path's kernels need triton")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from workers import kernels
from workers.kernels import norm_rope  # noqa: E402
from workers.attention import AttentionMetadata, get_backend  # noqa: E402
from workers.models.loader import load_model  # noqa: E402
from workers.models.model_config import ModelConfig  # noqa: E402

MAX_KERNELS_PER_LAYER = 12
BLOCK_SIZE = 16

_aten = torch.ops.aten
# ops that launch no kernel on a GPU: views, metadata, allocations without a fill
NON_LAUNCHING = {
    _aten.view, _aten._unsafe_view, _aten.reshape, _aten.t, _aten.transpose, _aten.permute,
    _aten.slice, _aten.select, _aten.split, _aten.split_with_sizes, _aten.chunk,
    _aten.unsqueeze, _aten.squeeze, _aten.expand, _aten.as_strided, _aten.alias,
    _aten.detach, _aten.unbind, _aten.narrow, _aten.flatten, _aten.unflatten,
    _aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty,
    _aten.new_empty_strided, _aten.lift_fresh, _aten.sym_size, _aten.sym_stride,
    _aten.sym_numel, _aten.is_same_size, _aten.resolve_conj, _aten.resolve_neg,
}


class KernelCounter(TorchDispatchMode):
    """Counts launching aten ops and Triton launches (by name) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: Counter[str] = Counter()
        self._in_triton = 0
        self.active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._in_triton and func.overloadpacket not in NON_LAUNCHING:
            self.kernels[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    def triton_launch(self, name: str):
        counter = self

        class _Launch:
            def __enter__(self_inner):
                counter.kernels[f"triton:{name}"] += 1
                counter._in_triton += 1

            def __exit__(self_inner, *exc):
                counter._in_triton -= 1

        return _Launch()


@pytest.fixture
def counter(monkeypatch):
    """A KernelCounter whose Triton launches are counted by patching the launchers' `run`."""
    count = KernelCounter()
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for cls in (InterpretedFunction, JITFunction):
        real = cls.run

        def run(self, *args, _real=real, **kwargs):
            if kwargs.get("warmup") or not count.active:
                return _real(self, *args, **kwargs)
            with count.triton_launch(getattr(self, "__name__", "kernel")):
                return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "run", run)
    return count


def gpu_path(model: torch.nn.Module, monkeypatch) -> None:
    """Switches off the CPU-only C kernels and runs the CUDA path's Triton kernels here, in the
    interpreter, so the model issues the ops a GPU would."""
    monkeypatch.setattr(norm_rope, "_functions", lambda: {})
    monkeypatch.setattr(kernels, "interpret_on_cpu", True)
    for module in model.modules():
        if getattr(module, "matmul", None) is not None:
            module.matmul = None


def _meta(prompt_lens: list[int], new: list[int]) -> AttentionMetadata:
    """Sequence i at `prompt_lens[i]` cached tokens with `new[i]` new ones; block tables give
    each sequence its own consecutive blocks."""
    lens = [p + n for p, n in zip(prompt_lens, new)]
    per_seq = max(-(-n // BLOCK_SIZE) for n in lens)
    tables = torch.tensor([[i * per_seq + b for b in range(per_seq)] for i in range(len(lens))],
                          dtype=torch.int32)
    slots = [int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
             for i, (start, n) in enumerate(zip(prompt_lens, new)) for p in range(start, start + n)]
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
        num_decodes=sum(1 for n in new if n == 1), max_query_len=max(new),
        max_seq_len=max(lens), query_start_loc_cpu=starts, seq_lens_cpu=lens)


def decode_step_kernels(tiny_model: str, dtype: torch.dtype, monkeypatch,
                        counter: KernelCounter) -> tuple[float, Counter[str]]:
    """(kernels per decoder layer, kernels by name) of one decode step of two sequences."""
    config = ModelConfig.from_pretrained(tiny_model)
    model = load_model(tiny_model, config, dtype=dtype, device="cpu",
                       attn_backend=get_backend("triton"))
    gpu_path(model, monkeypatch)
    prompts = [torch.arange(1, 6), torch.arange(7, 10)]
    caches = [torch.zeros(2, 8, BLOCK_SIZE, model.num_kv_heads, model.head_dim, dtype=dtype)
              for _ in range(model.num_layers)]
    with torch.no_grad():
        ids = torch.cat(prompts)
        positions = torch.cat([torch.arange(len(p)) for p in prompts])
        model(ids, positions, caches, _meta([0, 0], [len(p) for p in prompts]))
        meta = _meta([len(p) for p in prompts], [1, 1])
        ids, positions = torch.tensor([11, 12]), torch.tensor([len(p) for p in prompts])
        with counter:
            model.compute_logits(model(ids, positions, caches, meta))
    return sum(counter.kernels.values()) / model.num_layers, counter.kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_issues_at_most_12_kernels_per_layer(tiny_model, dtype, monkeypatch,
                                                           counter):
    per_layer, kernels = decode_step_kernels(tiny_model, dtype, monkeypatch, counter)
    print(f"{dtype}: {per_layer} kernels per layer: {dict(kernels)}")
    assert per_layer <= MAX_KERNELS_PER_LAYER, dict(kernels)


def test_the_counter_counts_aten_ops_and_triton_launches(counter):
    """A view launches nothing; an add and a Triton launch are one kernel each."""
    from workers.attention.triton_decode import paged_decode_attention

    q = torch.randn(1, 2, 16)
    cache = torch.randn(2, 1, BLOCK_SIZE, 1, 16)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with counter:
        q.view(2, 16).t()
        _ = q + 1
        paged_decode_attention(q, cache, table, lens, 0.25, 1)
    assert counter.kernels == Counter({"add": 1, "triton:_decode_split_kernel": 1})
