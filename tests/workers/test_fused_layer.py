"""The fused decoder stack (`workers/models/fused_layer.py`, `csrc/decoder_layer.c`: a decode step's
layers in one C call) against the same layers run one by one: the same hidden states and the
same K/V written, bit for bit, at 1-8 rows (up to 32 over a GGUF file's blocks), on any thread
count; which models and batches take it; greedy tokens against transformers."""

from __future__ import annotations

import pytest
import torch

from tests.workers.factories import noise_paged_cache
from workers import LLM, SamplingParams
from workers.models import fused_layer as fused_module
from workers.models import fused_abi
from workers.attention.backend import AttentionMetadata
from workers.attention.registry import get_backend
from workers.models.loader import load_model
from workers.models.make_model import make_model
from workers.models.model_config import ModelConfig
from workers.models.layers import Shard
from workers.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel
from workers.models.comm import Communicator
from workers.kernels import int_gemm as int_kernels

pytestmark = pytest.mark.skipif(not fused_module.available(),
                                reason="no C compiler here to build the fused layer kernel")
PLAIN = (LlamaModel, LlamaDecoderLayer, LlamaMLP)  # what the loader hands use_fused_decoder_stack


def _model(path: str, **options: object) -> torch.nn.Module:
    return LLM(path, num_blocks=16, **options).engine.runner.executor.model


@pytest.fixture(scope="module")
def model(tiny_model):
    return _model(tiny_model)


def decode_batch(model, rows: int, kv_dtype: torch.dtype, seed: int = 0, block_size: int = 4,
                 num_decodes: int | None = None):
    """A decode step of `rows` sequences of 1-40 tokens (the new one included) over caches of
    noise (the new tokens' slots too): (ids, positions, caches, meta)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [1 + (13 * i + 7 * seed) % 40 for i in range(rows)]
    heads, dim = model.num_kv_heads, model.head_dim
    first, tables = noise_paged_cache(seq_lens, block_size, heads, dim, gen)
    caches = [first] + [torch.randn(first.shape, generator=gen)
                        for _ in range(model.num_layers - 1)]
    positions = [length - 1 for length in seq_lens]
    slots = [int(tables[i, p // block_size]) * block_size + p % block_size
             for i, p in enumerate(positions)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(rows + 1).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        num_decodes=rows if num_decodes is None else num_decodes, max_query_len=1,
        max_seq_len=max(seq_lens), query_start_loc_cpu=list(range(rows + 1)),
        seq_lens_cpu=seq_lens)
    ids = torch.randint(model.config.vocab_size, (rows,), generator=gen)
    return ids, torch.tensor(positions), [c.to(kv_dtype) for c in caches], meta


def forward(model, batch, fused: bool, threads: int | None = None):
    """The final hidden states and the caches after one forward, fused or layer by layer."""
    ids, positions, caches, meta = batch
    caches = [c.clone() for c in caches]
    stack, before = model.model.fused_stack, torch.get_num_threads()
    assert stack is not None and stack.takes(torch.empty(len(ids), 1), meta, caches)
    model.model.fused_stack = stack if fused else None
    torch.set_num_threads(threads or before)
    try:
        with torch.no_grad():
            return model(ids, positions, caches, meta), caches
    finally:
        model.model.fused_stack = stack
        torch.set_num_threads(before)


def count_calls(monkeypatch, stack) -> list[int]:
    """The row count of every fused call from now on."""
    rows: list[int] = []
    fn = stack.fn

    def counted(*args):
        rows.append(args[10])
        return fn(*args)

    monkeypatch.setattr(stack, "fn", counted)
    return rows


@pytest.mark.parametrize("rows", [*range(1, 9), 17, fused_module.MAX_ROWS])
def test_the_fused_stack_equals_the_layers_one_by_one(model, rows):
    batch = decode_batch(model, rows, torch.float32, seed=rows)
    want, want_caches = forward(model, batch, fused=False)
    for threads in (1, 2, 3):  # each kernel's result is the same on any thread count
        got, got_caches = forward(model, batch, fused=True, threads=threads)
        assert torch.equal(got, want)
        for g, w in zip(got_caches, want_caches, strict=True):
            assert torch.equal(g, w)  # the new K/V at their slots, nothing else touched
    assert not torch.equal(want_caches[0], batch[2][0])  # the step did write K/V


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_a_bf16_cache_is_read_by_the_c_kernel_where_the_layers_use_sdpa(model, rows):
    """An fp32 model over a bf16 cache: layer by layer, the cpu backend hands the mixed dtypes
    to the torch backend's SDPA; fused, the C kernel widens the cached values as it reads them.
    The same attention up to fp32 rounding; the K/V rounded to bf16 as torch's `to` does."""
    batch = decode_batch(model, rows, torch.bfloat16, seed=rows)
    want, want_caches = forward(model, batch, fused=False)
    got, got_caches = forward(model, batch, fused=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_caches[0], want_caches[0])  # the first layer's K/V: same inputs
    for g, w in zip(got_caches[1:], want_caches[1:], strict=True):  # within a bf16 rounding
        torch.testing.assert_close(g, w, rtol=8e-3, atol=1e-5)
    assert torch.equal(forward(model, batch, fused=True, threads=1)[0], got)


def test_a_sliding_window_is_attended_as_the_layers_do(tiny_model):
    model = _model(tiny_model)
    for layer in model.model.layers.values():
        layer.self_attn.window = 5
    # rebuilt: the structs take the window at load
    assert fused_module.use_fused_decoder_stack(model, *PLAIN) == model.num_layers
    batch = decode_batch(model, 6, torch.float32, seed=3)
    assert max(batch[3].seq_lens_cpu) > 5
    want, want_caches = forward(model, batch, fused=False)
    got, got_caches = forward(model, batch, fused=True)
    assert torch.equal(got, want) and all(map(torch.equal, got_caches, want_caches))


def chunk_batch(model, query_lens: list[int], seed: int = 0, block_size: int = 4):
    """A step in which sequence s has `query_lens[s]` new tokens (decodes first, as the runner
    orders them) after 3-30 cached ones, over caches of noise: (ids, positions, caches, meta)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [n + 3 + (11 * i + 5 * seed) % 28 for i, n in enumerate(query_lens)]
    first, tables = noise_paged_cache(seq_lens, block_size, model.num_kv_heads, model.head_dim,
                                      gen)
    caches = [first] + [torch.randn(first.shape, generator=gen)
                        for _ in range(model.num_layers - 1)]
    positions = [p for n, length in zip(query_lens, seq_lens) for p in range(length - n, length)]
    owners = [s for s, n in enumerate(query_lens) for _ in range(n)]
    slots = [int(tables[s, p // block_size]) * block_size + p % block_size
             for s, p in zip(owners, positions)]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        num_decodes=next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens)),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens)
    ids = torch.randint(model.config.vocab_size, (len(positions),), generator=gen)
    return ids, torch.tensor(positions), caches, meta


def one_at_a_time(model, batch):
    """The rows of `batch` as decode steps, fused: step t decodes each sequence's t-th new token
    (its K/V and those of its earlier rows written by the steps before). Returns (hidden states
    in the batch's row order, caches)."""
    ids, positions, caches, meta = batch
    caches = [c.clone() for c in caches]
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    out = torch.empty(len(ids), model.config.hidden_size)
    for t in range(meta.max_query_len):
        seqs = [s for s in range(len(lens)) if starts[s] + t < starts[s + 1]]
        rows = [starts[s] + t for s in seqs]
        step = AttentionMetadata(
            slot_mapping=meta.slot_mapping[rows], query_start_loc=torch.arange(len(rows) + 1).int(),
            seq_lens=torch.tensor([lens[s] - (starts[s + 1] - starts[s]) + 1 + t for s in seqs],
                                  dtype=torch.int32),
            block_tables=meta.block_tables[seqs], num_decodes=len(rows), max_query_len=1,
            max_seq_len=max(lens), query_start_loc_cpu=list(range(len(rows) + 1)),
            seq_lens_cpu=[lens[s] - (starts[s + 1] - starts[s]) + 1 + t for s in seqs])
        with torch.no_grad():
            out[rows] = model(ids[rows], positions[rows], caches, step)
    return out, caches


@pytest.mark.parametrize("query_lens", [[5], [1, 1, 5, 3], [2, 8]])
def test_several_rows_of_a_sequence_fuse_as_decoding_them_one_at_a_time(model, query_lens):
    """A speculative verification's k + 1 rows (or a short prefill chunk) in one fused call:
    each row attended as a decode row over its own prefix, so the hidden states and K/V are
    those of decoding the rows one step at a time, bit for bit (greedy tokens then cannot
    change with speculation), and the layers one by one's (SDPA's prefill) to fp32 rounding."""
    batch = chunk_batch(model, query_lens, seed=len(query_lens))
    assert model.model.fused_stack.takes(torch.empty(len(batch[0]), 1), batch[3], batch[2])
    got, got_caches = forward(model, batch, fused=True)
    want, want_caches = one_at_a_time(model, batch)
    assert torch.equal(got, want)
    assert all(map(torch.equal, got_caches, want_caches))
    plain, plain_caches = forward(model, batch, fused=False)
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_caches, plain_caches, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_more_than_max_rows_bf16_rows_or_other_caches_run_layer_by_layer(model):
    stack = model.model.fused_stack
    assert stack.max_rows == fused_module.MAX_ROWS  # dense fp32 projections
    rows = stack.max_rows
    _, _, caches, meta = chunk_batch(model, [1, rows])  # one row too many
    assert not stack.takes(torch.empty(rows + 1, 1), meta, caches)
    _, _, caches, meta = decode_batch(model, rows + 1, torch.float32)
    assert not stack.takes(torch.empty(rows + 1, 1), meta, caches)
    _, _, caches, meta = decode_batch(model, rows, torch.float32)
    assert stack.takes(torch.empty(rows, 1), meta, caches)
    assert not stack.takes(torch.empty(rows, 1, dtype=torch.bfloat16), meta, caches)
    assert not stack.takes(torch.empty(rows, 1), meta, [c.to(torch.int8) for c in caches])


def test_engine_tokens_are_the_unfused_ones_and_only_steps_of_up_to_max_rows_fuse(
        tiny_model, monkeypatch):
    prompts = [[3 + i, 5, 7 + 2 * i] * (1 + i % 3) for i in range(10)]
    params = [SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True)
              for i in range(10)]
    fused = LLM(tiny_model, num_blocks=64, block_size=4)
    model = fused.engine.runner.executor.model
    # a limit under the batch (the dense limit is 32 rows), so both paths run in one engine
    monkeypatch.setattr(model.model.fused_stack, "max_rows", 8)
    rows = count_calls(monkeypatch, model.model.fused_stack)
    got = [o.outputs[0].token_ids for o in fused.generate(prompts, params)]
    plain = LLM(tiny_model, num_blocks=64, block_size=4)
    plain.engine.runner.executor.model.model.fused_stack = None
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    # 10 prefills of 3-27 rows, then decodes of 10 rows (layer by layer, as the prefills),
    # shrinking to 8 and below (fused)
    assert rows and max(rows) == 8 and min(rows) == 1


def test_what_does_not_take_it(tiny_model, tmp_path):
    assert _model(tiny_model, dtype="bfloat16").model.fused_stack is None
    assert _model(tiny_model, attention_backend="torch").model.fused_stack is None
    for arch, why in (("qwen2", "without bias"), ("qwen3", "q/k norm"),
                      ("gemma3", "not a plain Llama")):
        path = str(make_model(tmp_path / arch, arch=arch, preset="tiny"))
        model = _model(path)
        assert model.model.fused_stack is None
        assert why in fused_module.refusal(model.model.layers[0], *PLAIN[1:])
    from workers.quant.writer import quantize_checkpoint

    awq = str(quantize_checkpoint(tiny_model, tmp_path / "awq", "awq", group_size=32))
    packed = _model(awq, dtype="bfloat16")  # kept packed, for its kernels, over bf16 rows
    assert packed.model.fused_stack is None
    assert "bfloat16 activations" in fused_module.refusal(packed.model.layers[0], *PLAIN[1:])
    config = ModelConfig.from_pretrained(tiny_model)
    sharded = load_model(None, config, dtype=torch.float32, device="cpu",
                         attn_backend=get_backend("cpu"), load_format="dummy",
                         shard=Shard(0, 2, Communicator(None, [0, 1], 0)))
    assert sharded.model.fused_stack is None
    assert "on one rank" in fused_module.refusal(sharded.model.layers[0], *PLAIN[1:])


def test_greedy_tokens_match_transformers(tmp_path, monkeypatch):
    from tests.workers.hf_oracle import greedy_reference, save_hf_model

    hf = save_hf_model("llama", tmp_path)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(20, 40))]
    llm = LLM(str(tmp_path), block_size=4, num_blocks=64)
    rows = count_calls(monkeypatch, llm.engine.runner.executor.model.model.fused_stack)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == greedy_reference(hf, prompt, 6).tokens
    assert rows  # the decode steps ran fused


# int8 and int4 weights kept packed for the VNNI kernels in an fp32 model: the projections and
# the MLP's int8/int4 matmuls run inside the fused call too
PACKED = {"int8": dict(bits=8, group_size=None), "int4": dict(bits=4, group_size=32),
          "int4-asym": dict(bits=4, group_size=32, symmetric=False)}
vnni = pytest.mark.skipif(not int_kernels.available(), reason="no AVX-512 VNNI here")


def _quantized(tiny_model: str, root, name: str) -> str:
    from workers.quant.writer import quantize_checkpoint

    return str(quantize_checkpoint(tiny_model, root / name, "compressed-tensors", **PACKED[name]))


@pytest.fixture(scope="module", params=list(PACKED))
def packed(request, tiny_model, tmp_path_factory):
    path = _quantized(tiny_model, tmp_path_factory.mktemp("packed"), request.param)
    return request.param, path, _model(path, dtype="float32", fp32_int_kernels=True)


@vnni
def test_packed_int8_int4_layers_fuse_and_equal_the_layers_one_by_one(packed):
    name, _, model = packed
    kinds = {fused_abi.INT8 if name == "int8" else fused_abi.INT4}
    structs = model.model.fused_stack.structs
    assert {getattr(s, p).kind for s in structs for p in ("qkv", "o", "gate_up", "down")} == kinds
    assert all(bool(s.qkv.offsets) == (name == "int4-asym") for s in structs)
    assert model.model.fused_stack.max_rows == fused_module.MAX_PACKED_ROWS
    for rows in range(1, 9):
        batch = decode_batch(model, rows, torch.float32, seed=rows)
        want, want_caches = forward(model, batch, fused=False)
        for threads in (1, 2, 3):
            got, got_caches = forward(model, batch, fused=True, threads=threads)
            assert torch.equal(got, want), (name, rows, threads)
            assert all(map(torch.equal, got_caches, want_caches)), (name, rows, threads)


@vnni
def test_packed_engine_tokens_are_the_unfused_ones(packed, monkeypatch):
    _, path, _ = packed
    prompts = [[3 + i, 5, 7 + 2 * i] * (1 + i % 3) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    fused = LLM(path, num_blocks=64, block_size=4, dtype="float32", fp32_int_kernels=True)
    rows = count_calls(monkeypatch, fused.engine.runner.executor.model.model.fused_stack)
    got = [o.outputs[0].token_ids for o in fused.generate(prompts, params)]
    plain = LLM(path, num_blocks=64, block_size=4, dtype="float32", fp32_int_kernels=True)
    plain.engine.runner.executor.model.model.fused_stack = None
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert rows


def test_what_quantized_takes_without_the_packed_fused_path(tiny_model, tmp_path, monkeypatch):
    """fp32 without `fp32_int_kernels` (or without VNNI): dequantized, the dense fused stack.
    int8 with zero points: packed, but its zero terms are torch's, so the stack refuses it.
    bf16: packed, over bf16 activations the stack does not take."""
    path = _quantized(tiny_model, tmp_path, "int4")
    kinds = {s.qkv.kind for s in _model(path).model.fused_stack.structs}
    assert kinds == {fused_abi.DENSE}
    bf16 = _model(path, dtype="bfloat16")
    assert bf16.model.fused_stack is None
    assert "bfloat16 activations" in fused_module.refusal(bf16.model.layers[0], *PLAIN[1:])
    if int_kernels.available():
        from workers.quant.writer import quantize_checkpoint

        asym8 = str(quantize_checkpoint(tiny_model, tmp_path / "i8a", "compressed-tensors",
                                        bits=8, group_size=None, symmetric=False))
        model = _model(asym8, dtype="float32", fp32_int_kernels=True)
        assert model.model.fused_stack is None
        assert "zero points" in fused_module.refusal(model.model.layers[0], *PLAIN[1:])
    monkeypatch.setattr(int_kernels, "available", lambda: False)
    model = _model(path, dtype="float32", fp32_int_kernels=True)
    assert {s.qkv.kind for s in model.model.fused_stack.structs} == {fused_abi.DENSE}


@pytest.fixture(scope="module")
def gguf_model(tiny_model, tmp_path_factory):
    """The tiny llama written as a Q4_1 GGUF file (its embedding Q4_1 too), served packed."""
    pytest.importorskip("gguf")
    from pathlib import Path

    from tests.workers.gguf_files import write_gguf

    path = write_gguf(Path(tiny_model), tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf", "Q4_1")
    return _model(str(path), dtype="float32")


def test_a_gguf_stack_fuses_up_to_its_block_kernels_rows_and_equals_the_layers(gguf_model):
    """A GGUF file's stack takes up to `MAX_GGUF_ROWS` rows (32 streams, a verification's
    k + 1 past 8), each the unfused layers' result bit for bit; one more goes layer by layer."""
    stack = gguf_model.model.fused_stack
    assert {getattr(s, p).kind for s in stack.structs for p in ("qkv", "o", "gate_up", "down")
            } == {fused_abi.GGUF_KINDS["Q4_1"]}
    assert stack.max_rows == fused_module.MAX_GGUF_ROWS > fused_module.MAX_PACKED_ROWS
    for rows in (1, 9, 17, stack.max_rows):
        batch = decode_batch(gguf_model, rows, torch.float32, seed=rows)
        want, want_caches = forward(gguf_model, batch, fused=False)
        for threads in (1, 2):
            got, got_caches = forward(gguf_model, batch, fused=True, threads=threads)
            assert torch.equal(got, want), (rows, threads)
            assert all(map(torch.equal, got_caches, want_caches)), (rows, threads)
    _, _, caches, meta = decode_batch(gguf_model, stack.max_rows + 1, torch.float32)
    assert not stack.takes(torch.empty(stack.max_rows + 1, 1), meta, caches)


@pytest.mark.parametrize("kind", ["int8", "gguf"])
def test_lora_over_packed_weights_in_the_stack_is_torch_s_products(kind, tiny_model, tmp_path,
                                                                    monkeypatch):
    """Adapters over packed projections (int8; a GGUF file's Q4_1 blocks): their products added
    inside the fused stack after each packed matmul (`lora_add_f32`, in a mixed batch with the
    base model) give the tokens, and logprobs within 1e-5, of the layers one by one with the
    products as torch's matmuls."""
    from pathlib import Path

    from workers.kernels import lora_add
    from workers.models.lora.make_adapter import ATTENTION, MLP, make_adapter

    if kind == "int8":
        if not int_kernels.available():
            pytest.skip("no AVX-512 VNNI here")
        path, options = _quantized(tiny_model, tmp_path, "int8"), {"fp32_int_kernels": True}
    else:
        pytest.importorskip("gguf")
        from tests.workers.gguf_files import write_gguf

        path, options = str(write_gguf(Path(tiny_model), tmp_path / "q4_1.gguf", "Q4_1")), {}
    folders = {n: make_adapter(tiny_model, tmp_path / n, rank=8, seed=s, targets=ATTENTION + MLP)
               for s, n in enumerate(("a", "b"))}
    modules = tuple(f"{n}={f}" for n, f in folders.items())
    prompts = [[3 + i, 5, 7 + 2 * i] * (1 + i % 3) for i in range(6)]
    loras = [None, "a", "b", "a", None, "b"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)

    def run(fused: bool) -> list:
        llm = LLM(path, num_blocks=64, block_size=4, dtype="float32", enable_lora=True,
                  max_loras=2, max_lora_rank=8, lora_modules=modules, **options)
        stack = llm.engine.runner.executor.model.model.fused_stack
        assert {s.qkv.kind for s in stack.structs} != {fused_abi.DENSE}
        if not fused:
            llm.engine.runner.executor.model.model.fused_stack = None
            monkeypatch.setattr(lora_add, "takes", lambda *args: False)
        else:
            fn, with_adapters = stack.fn, []

            def counted(*args):
                with_adapters.append(args[16] is not None)  # the step's adapter rows, or NULL
                return fn(*args)

            monkeypatch.setattr(stack, "fn", counted)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, lora_name=loras)]
        if fused:
            assert any(with_adapters), "no step with adapter rows ran fused"
        return outs

    got, want = run(fused=True), run(fused=False)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert [lp.logprob for lp in g.logprobs] == pytest.approx(
            [lp.logprob for lp in w.logprobs], abs=1e-5)
