"""Every step (decode, prefill, mixed, and a MoE model's) makes at most one host synchronisation:
the copy of its sampled tokens back to the host.

How it is counted. This machine has no GPU, so nothing really waits; instead every operation
that *would* make the host wait for a GPU is caught where it is issued, and attributed:

- a `TorchDispatchMode` sees every aten op of the step. Ops whose result a GPU can only hand
  back by waiting count as syncs: `_local_scalar_dense` (`.item()`, `int(t)`, `bool(t)`),
  ops with a data-dependent output shape (`nonzero`, one-argument `torch.where`, `unique`,
  `masked_select`, `bincount`, boolean-mask indexing, `repeat_interleave` without
  `output_size`), and copies between two devices (seen on a GPU run). `lift_fresh` (a tensor
  made from Python data: `torch.tensor(list)`, `torch.from_numpy`, indexing with a list)
  counts as an upload: on a GPU it is a pageable copy the host waits for.
- `Tensor.tolist`, `.cpu`, `.item` and the `bool`/`int`/`float`/`__index__` conversions are
  wrapped: on CPU tensors (`.item()` under inference mode) they do not reach the dispatch mode.

Each event is attributed by the Python stack: inside `workers.kernels.host_transfer.upload` it is the
step's sanctioned asynchronous upload (pinned, non-blocking on a GPU: not a sync); inside
`workers.kernels.host_transfer.download` it is the sanctioned token copy-back (one sync); inside
Triton's interpreter it is the interpreter's own emulation (ignored); anywhere else it is a
stray sync, reported with its file and line. The step runs its GPU forms
(`host_transfer.simulate_gpu_paths`) with the Triton backend (in the interpreter) and the
executor a GPU engine uses (`CudaGraphExecutor`, uncaptured). `test_a_new_item_in_a_layer_is_
caught` checks that the counter sees a sync added to a layer.

Not measured here: syncs the CUDA runtime makes on its own (allocator growth, a Triton
compile), and `.numpy()` (it raises on a device tensor, so a GPU path must `.cpu()` first,
which is counted).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason=("counts the host syncs a GPU step would make by simulating the GPU paths on CPU with "
            "the kernels in Triton's interpreter; on a GPU host they are compiled for the GPU "
            "and the engine would run there"))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are first imported

from workers import LLM, SamplingParams
from workers.engine import cuda_graphs
from workers.kernels import host_transfer
from workers.models.make_model import make_model
from workers.models.layers import Shard
from workers.models.moe import DENSE_MAX_TOKENS, FusedExperts, route
from workers.engine.runner import ModelRunner

triton = pytest.importorskip("triton", reason="the GPU step path runs the Triton kernels")
aten = torch.ops.aten
_SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten._unique2.default,
             aten.unique_dim.default, aten.unique_consecutive.default, aten._unique.default,
             aten.masked_select.default, aten.bincount.default, aten.nonzero_static.default,
             aten.repeat_interleave.Tensor, aten.where.default, aten.argwhere.default,
             aten.nonzero_numpy.default}  # where.default: torch.where(cond), one argument
# host reads that do not dispatch on CPU tensors (or, under inference mode, skip the dispatch)
_WRAPPED = ("tolist", "cpu", "item", "__bool__", "__int__", "__float__", "__index__")
_MASK_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
_TRITON_DIR = os.path.dirname(triton.__file__)
_UPLOAD, _DOWNLOAD = host_transfer.upload.__code__, host_transfer.download.__code__


class HostSyncCounter(TorchDispatchMode):
    """Records, per event kind, what the step did: `uploads` (sanctioned, asynchronous),
    `downloads` (sanctioned syncs) and `strays` (file:line and what, each a sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.uploads = self.downloads = 0
        self.strays: list[str] = []
        self._saved: dict[str, object] = {}
        self._quiet = 0

    @property
    def syncs(self) -> int:
        return self.downloads + len(self.strays)

    def __enter__(self) -> HostSyncCounter:
        for name in _WRAPPED:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapped(t, *args, _original=original, _name=name, **kwargs):
                if self._quiet:
                    return _original(t, *args, **kwargs)
                self._record(f"Tensor.{_name}", sync=True)
                self._quiet += 1  # the op it dispatches (if any) is this same event
                try:
                    return _original(t, *args, **kwargs)
                finally:
                    self._quiet -= 1

            setattr(torch.Tensor, name, wrapped)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._quiet:
            pass
        elif func in _SYNC_OPS and not (func is aten.repeat_interleave.Tensor
                                      and kwargs.get("output_size") is not None):
            self._record(str(func), sync=True)
        elif func in _MASK_INDEX_OPS and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in args[1]):
            self._record(f"{func} with a boolean mask", sync=True)
        elif func is aten.lift_fresh.default:
            self._record("a tensor from host data", sync=False)
        elif func in (aten._to_copy.default, aten.copy_.default):
            src, dst = (args[0], kwargs.get("device")) if func is aten._to_copy.default \
                else (args[1], args[0].device)
            if dst is not None and torch.device(dst) != src.device:
                self._record(f"{func} {src.device} -> {dst}", sync=True)
        return func(*args, **kwargs)

    def _record(self, what: str, sync: bool) -> None:
        frame = sys._getframe(2)
        where = None
        while frame is not None:
            code = frame.f_code
            if code.co_filename.startswith(_TRITON_DIR):
                return  # the interpreter emulating a kernel launch
            if code is _UPLOAD:
                self.uploads += 1
                return
            if code is _DOWNLOAD:
                self.downloads += 1
                return
            if where is None and "/workers/" in code.co_filename:
                where = f"{code.co_filename.split('/workers/')[-1]}:{frame.f_lineno}"
            frame = frame.f_back
        self.strays.append(f"{what} at workers/{where}")


def _kind(out) -> str:
    lens = {chunk.num_tokens for chunk in out.chunks}
    return "decode" if lens == {1} else "prefill" if 1 not in lens else "mixed"


def count_steps(llm: LLM, monkeypatch) -> list[tuple[str, HostSyncCounter]]:
    """Wraps `llm`'s runner so each step runs under its own counter, in the GPU forms."""
    runner = llm.engine.runner
    steps: list[tuple[str, HostSyncCounter]] = []
    execute = ModelRunner.execute

    def counted(out):
        with host_transfer.simulate_gpu_paths(), HostSyncCounter() as counter:
            result = execute(runner, out)
        steps.append((_kind(out), counter))
        return result

    monkeypatch.setattr(runner, "execute", counted)
    return steps


PARAMS = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=3, max_tokens=6,
                         ignore_eos=True, logprobs=2),
          SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5,
                         frequency_penalty=0.4, logit_bias={5: 3.0}, min_tokens=4, max_tokens=6),
          SamplingParams(temperature=0.7, top_p=0.8, max_tokens=6, ignore_eos=True)]
PROMPTS = [[1, 2, 3], list(range(10, 40)), [7] * 9, list(range(50, 75))]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("tiny-mixtral"), arch="mixtral",
                          preset="tiny"))


def _gpu_like_llm(model: str, monkeypatch) -> LLM:
    monkeypatch.setattr(cuda_graphs, "graphs_supported", lambda *a: True)
    # a small token budget: the long prompts prefill in chunks beside the short ones' decodes
    return LLM(model, num_blocks=64, attention_backend="triton", max_num_batched_tokens=16,
               max_cuda_graph_batch_size=4, max_model_len=128)


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_every_step_syncs_once(arch, tiny_model, tiny_moe, monkeypatch):
    llm = _gpu_like_llm(tiny_model if arch == "llama" else tiny_moe, monkeypatch)
    steps = count_steps(llm, monkeypatch)
    llm.generate(PROMPTS, PARAMS)
    assert {kind for kind, _ in steps} == {"decode", "prefill", "mixed"}
    strays = Counter(s for _, c in steps for s in c.strays)
    assert not strays, f"stray host syncs (count over {len(steps)} steps): {dict(strays)}"
    assert all(c.downloads == 1 for _, c in steps)
    assert all(c.uploads >= 1 for _, c in steps)


def test_a_new_item_in_a_layer_is_caught(tiny_model, monkeypatch):
    llm = _gpu_like_llm(tiny_model, monkeypatch)
    layer = next(iter(llm.engine.runner.executor.model.model.layers.values()))
    forward = type(layer).forward

    def with_item(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        _ = args[0].abs().max().item()  # a host read of a device value, as a bug would add
        return out

    monkeypatch.setattr(type(layer), "forward", with_item)  # every decoder layer's
    num_layers = len(llm.engine.runner.executor.model.model.layers)
    steps = count_steps(llm, monkeypatch)
    llm.generate(PROMPTS[:1], PARAMS[:1])
    assert steps and all(c.syncs == 1 + num_layers for _, c in steps)
    assert all(len(c.strays) == num_layers and "Tensor.item" in c.strays[0] for _, c in steps)


def test_uploads_and_list_indexing_outside_the_helper_are_caught():
    x = torch.arange(6.0)
    with HostSyncCounter() as counter:
        x[[0, 2]]
        torch.tensor([1, 2], device=x.device)
        torch.unique(x)
        x[x > 2]
        with torch.inference_mode():  # where CPU tensors skip the dispatch of these
            torch.where(x > 2)
            bool(x[1])
        host_transfer.download(host_transfer.upload([1, 2], x.device))
    assert len(counter.strays) == 6 and counter.uploads == 1 and counter.downloads == 1


@pytest.mark.parametrize("bias", [False, True])
def test_moe_dense_gpu_form_matches_the_expert_loop(bias):
    """The sync-free form (every expert over every row, weighted) equals the CPU loop."""
    torch.manual_seed(0)
    experts = FusedExperts(6, 16, 24, Shard(), None, bias=bias,
                           clamped_swiglu=(1.7, 7.0) if bias else None)
    for param in experts.parameters():
        param.data.normal_()
    x = torch.randn(9, 16)
    ids, weights = route(torch.randn(9, 6), 2, normalize=True)
    loop = experts.run_local(x, ids, weights)
    with host_transfer.simulate_gpu_paths(), HostSyncCounter() as counter:
        dense = experts.run_local(x, ids, weights)
        unweighted = experts.run_local(x, ids[:, :1], None)
    assert not counter.strays
    torch.testing.assert_close(dense, loop, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(unweighted, experts.run_local(x, ids[:, :1], None),
                               rtol=1e-4, atol=1e-4)
    assert x.shape[0] <= DENSE_MAX_TOKENS


def test_a_moe_step_of_more_than_64_tokens_syncs_once(tiny_moe, monkeypatch):
    """A prefill past DENSE_MAX_TOKENS runs the fused MoE kernels (in the interpreter here):
    the step's one sync is its token copy-back, where the expert loop read the routing on the
    host once per layer plus once per expert present."""
    from workers import kernels

    monkeypatch.setattr(cuda_graphs, "graphs_supported", lambda *a: True)
    monkeypatch.setattr(kernels, "interpret_on_cpu", True)
    llm = LLM(tiny_moe, num_blocks=64, attention_backend="triton", max_num_batched_tokens=128,
              max_cuda_graph_batch_size=4, max_model_len=128)
    steps = count_steps(llm, monkeypatch)
    prompt = list(range(1, 1 + DENSE_MAX_TOKENS + 36))  # 100 tokens, one prefill step
    llm.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)])
    assert steps[0][0] == "prefill"
    assert [c.syncs for _, c in steps] == [1] * len(steps)
    assert all(c.downloads == 1 and not c.strays for _, c in steps)
