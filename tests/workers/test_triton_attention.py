"""The Triton paged-attention kernels and backend against plain softmax attention and the torch
backend. Without a GPU the kernels run in Triton's CPU interpreter, so shapes stay small."""

from __future__ import annotations

import importlib.util
import os
from typing import NamedTuple

import pytest
import torch

if not torch.cuda.is_available():
    # before the kernels are imported: triton reads it when @triton.jit decorates
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the Triton attention kernels need the triton package")

from tests.workers.factories import dequantized_cache, noise_paged_cache, quantized_cache
from workers.attention import AttentionMetadata, get_backend
from workers.attention.decode_splits import DecodeScratch
from workers.kernels import kv_quant
from workers.kernels.kv_quant import quantize_kv, rotate
from workers.attention.triton_backend import TritonAttentionBackend
from workers.attention.triton_decode import paged_decode_attention
from workers.attention.triton_prefill import paged_prefill_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DIM = 16
KV_HEADS = 2
SCALE = DIM ** -0.5
# fp16/bf16 round the probabilities before P @ V and the output; fp32 accumulates throughout
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


class Paged(NamedTuple):
    cache: torch.Tensor  # [2, num_blocks, block_size, KV_HEADS, DIM]
    tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0

    def context(self, seq: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` keys and values of a sequence, contiguous fp32: [length, Hkv, D]."""
        blocks = self.tables[seq].long()
        k, v = (self.cache[i].index_select(0, blocks).flatten(0, 1)[:length] for i in (0, 1))
        return k.float(), v.float()


def make_paged(seq_lens: list[int], block_size: int, dtype: torch.dtype, seed: int = 0) -> Paged:
    """A cache of noise (spare blocks too, so a masking bug reads wrong values) and shuffled,
    disjoint block tables for sequences of `seq_lens` tokens."""
    cache, tables = noise_paged_cache(seq_lens, block_size, KV_HEADS, DIM,
                                      torch.Generator().manual_seed(seed))
    return Paged(cache.to(dtype).to(DEVICE), tables.to(DEVICE))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int,
              window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain softmax attention in fp32. q: [Lq, Hq, D]; k, v: [L, Hkv, D], the whole context;
    query i sees positions <= num_cached + i (and > num_cached + i - window); sinks [Hq]: a
    column per head that joins the softmax and is dropped after it."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q.float(), k) * SCALE
    key_pos, query_pos = torch.arange(k.shape[0])[None, :], torch.arange(q.shape[0])[:, None]
    visible = key_pos <= num_cached + query_pos
    if window is not None:
        visible &= key_pos > num_cached + query_pos - window
    scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    if sinks is None:
        return torch.einsum("hql,lhd->qhd", scores.softmax(-1), v)
    sink = sinks.float().to(scores.device)[:, None, None].expand(-1, q.shape[0], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hql,lhd->qhd", probs, v)


def random_queries(num_tokens: int, num_heads: int, dtype: torch.dtype,
                   seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_heads, DIM, generator=gen).to(dtype).to(DEVICE)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# (seq_lens, block_size, group, dtype). Lengths: 1, exact block multiples and one past them,
# and 200 / 300 tokens so that 3 and 4 splits have work (64-token tiles) and some splits are empty.
DECODE_CASES = [
    ([1, 16, 17, 70, 200], 16, 1, torch.float32),
    ([200, 3, 129], 32, 2, torch.float32),
    ([1], 16, 4, torch.float32),
    ([40, 300], 128, 2, torch.float32),  # a tile inside one large block
    ([5, 64, 65, 150], 16, 4, torch.float16),
    ([190, 31], 32, 2, torch.float16),
    ([1, 77, 160], 32, 2, torch.bfloat16),
]


@pytest.mark.parametrize("seq_lens,block_size,group,dtype", DECODE_CASES)
def test_decode_matches_softmax_attention_for_any_split_count(seq_lens, block_size, group, dtype):
    paged = make_paged(seq_lens, block_size, dtype)
    q = random_queries(len(seq_lens), KV_HEADS * group, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    want = torch.cat([reference(q[i:i + 1], *paged.context(i, n), n - 1)
                      for i, n in enumerate(seq_lens)])
    outs = {}
    for num_splits in (1, 3, 4):
        outs[num_splits] = paged_decode_attention(q, paged.cache, paged.tables, lens, SCALE,
                                                  num_splits)
        assert outs[num_splits].dtype == dtype
        assert_close(outs[num_splits], want, dtype)
    # splitting only changes the order of summation
    assert_close(outs[3], outs[1], dtype)
    assert_close(outs[4], outs[1], dtype)


@pytest.mark.parametrize("tile,num_warps", [(16, 2), (128, 8)])
def test_decode_launch_shapes_match_softmax_attention_at_short_contexts(tile, num_warps):
    """The tiles and warps `benchmarks/gpu_all.py` sweeps at short contexts (issue 52) compute
    the same attention as the default launch: contexts of one to a few tiles, a tile past a
    sequence's end, unsplit and split (an empty split at 16-token tiles)."""
    seq_lens = [1, 33, 70]
    paged = make_paged(seq_lens, 16, torch.float32)
    q = random_queries(len(seq_lens), KV_HEADS * 2, torch.float32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    want = torch.cat([reference(q[i:i + 1], *paged.context(i, n), n - 1)
                      for i, n in enumerate(seq_lens)])
    for num_splits in (1, 2):
        got = paged_decode_attention(q, paged.cache, paged.tables, lens, SCALE, num_splits,
                                     tile=tile, num_warps=num_warps)
        assert_close(got, want, torch.float32)


def test_decode_rejects_a_tile_tl_dot_cannot_take():
    paged = make_paged([20], 16, torch.float32)
    q = random_queries(1, KV_HEADS, torch.float32)
    lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    for tile in (8, 48):
        with pytest.raises(ValueError, match=f"got {tile}"):
            paged_decode_attention(q, paged.cache, paged.tables, lens, SCALE, tile=tile)
    with pytest.raises(ValueError, match="num_warps"):
        paged_decode_attention(q, paged.cache, paged.tables, lens, SCALE, num_warps=3)


@pytest.mark.parametrize("window", [1, 16, 70])  # one token; a block; across tiles and splits
def test_decode_over_a_sliding_window_for_any_split_count(window):
    seq_lens = [1, 16, 17, 70, 200]
    paged = make_paged(seq_lens, 16, torch.float32)
    q = random_queries(len(seq_lens), KV_HEADS * 2, torch.float32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    want = torch.cat([reference(q[i:i + 1], *paged.context(i, n), n - 1, window)
                      for i, n in enumerate(seq_lens)])
    for num_splits in (1, 3):
        got = paged_decode_attention(q, paged.cache, paged.tables, lens, SCALE, num_splits,
                                     window=window)
        assert_close(got, want, torch.float32)


@pytest.mark.parametrize("window", [None, 16])
def test_decode_with_attention_sinks_counts_each_sink_once_over_splits(window):
    seq_lens = [1, 17, 200]
    paged = make_paged(seq_lens, 16, torch.float32)
    q = random_queries(len(seq_lens), KV_HEADS * 2, torch.float32)
    sinks = (torch.randn(KV_HEADS * 2, generator=torch.Generator().manual_seed(3)) * 2).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    want = torch.cat([reference(q[i:i + 1], *paged.context(i, n), n - 1, window, sinks)
                      for i, n in enumerate(seq_lens)])
    for num_splits in (1, 3):
        got = paged_decode_attention(q, paged.cache, paged.tables, lens, SCALE, num_splits,
                                     window=window, sinks=sinks)
        assert_close(got, want, torch.float32)


def test_decode_reads_a_cache_stored_in_another_dtype():
    seq_lens = [33, 100]
    paged = make_paged(seq_lens, 16, torch.float16)  # kv_cache_dtype=float16 under an fp32 model
    q = random_queries(2, 4, torch.float32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    got = paged_decode_attention(q, paged.cache, paged.tables, lens, SCALE, num_splits=2)
    assert got.dtype == torch.float32
    for i, n in enumerate(seq_lens):
        assert_close(got[i:i + 1], reference(q[i:i + 1], *paged.context(i, n), n - 1),
                     torch.float32)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_an_8_bit_cache_dequantized(cache_dtype, dtype):
    """Each token's values times the scale stored after them (`workers.kernels.kv_quant`),
    over every split count: softmax attention over the dequantized cache."""
    seq_lens = [1, 17, 70, 200]
    paged = make_paged(seq_lens, 16, torch.float32)
    stored = Paged(quantized_cache(paged.cache, cache_dtype), paged.tables)  # fp8: int8 keys
    values = Paged(dequantized_cache(stored.cache), paged.tables)
    q = random_queries(len(seq_lens), KV_HEADS * 2, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    want = torch.cat([reference(q[i:i + 1], *values.context(i, n), n - 1)
                      for i, n in enumerate(seq_lens)])
    for num_splits in (1, 3):
        got = paged_decode_attention(q, stored.cache, stored.tables, lens, SCALE, num_splits)
        assert_close(got, want, dtype)
    with pytest.raises(ValueError, match="expected 32"):  # no room for the scales
        paged_decode_attention(q, stored.cache[..., :DIM].contiguous(), stored.tables, lens,
                               SCALE)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("window", [None, 7])
def test_backend_forward_over_an_8_bit_cache_matches_the_torch_backend(cache_dtype, window):
    """Decodes and prefill chunks (cached and new keys all read through the block tables) over
    an int8 or fp8 cache: what the torch backend computes from the same bytes."""
    q, k, v, cache, meta = mixed_batch([(30, 1), (4, 1), (0, 12), (21, 9)], 16, num_heads=4)
    cache = quantized_cache(cache, cache_dtype)
    torch_cache = cache.clone()
    got = get_backend("triton").forward(q, k, v, cache, meta, SCALE, window=window)
    want = get_backend("torch").forward(q, k, v, torch_cache, meta, SCALE, window=window)
    assert torch.equal(cache.view(torch.uint8), torch_cache.view(torch.uint8))
    assert_close(got, want, torch.float32)
    with pytest.raises(ValueError, match="needs the step's k and v"):  # fresh prompts read them
        paged_prefill_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                SCALE, meta.query_start_loc_cpu, first_seq=meta.num_decodes)


def test_decode_into_preallocated_buffers_as_a_graph_replay_would():
    seq_lens = [90, 7, 150]
    paged = make_paged(seq_lens + [0], 16, torch.float32)
    q = random_queries(4, 4, torch.float32)
    # one scratch with room for batch x splits, one output buffer, reused across calls
    scratch = DecodeScratch.allocate(4 * 4, 4, DIM, DEVICE)
    out = torch.full_like(q, float("nan"))
    backend = TritonAttentionBackend()
    for lens_now in (seq_lens, [n + 1 for n in seq_lens]):  # the next step's lengths
        lens = torch.tensor(lens_now + [0], dtype=torch.int32, device=DEVICE)  # 0: padding row
        got = backend.decode(q, paged.cache, paged.tables, lens, SCALE, out, num_splits=4,
                             scratch=scratch)
        assert got.data_ptr() == out.data_ptr()
        for i, n in enumerate(lens_now):
            assert_close(out[i:i + 1], reference(q[i:i + 1], *paged.context(i, n), n - 1),
                         torch.float32)
        assert torch.equal(out[3], torch.zeros_like(out[3]))  # padding gets zeros, not NaN


def test_decode_rejects_a_scratch_too_small_for_the_split_count():
    paged = make_paged([20], 16, torch.float32)
    q = random_queries(1, 4, torch.float32)
    lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="scratch"):
        paged_decode_attention(q, paged.cache, paged.tables, lens, SCALE, num_splits=4,
                               scratch=DecodeScratch.allocate(2, 4, DIM, DEVICE))


@pytest.mark.parametrize("window,with_sinks", [(1, False), (9, False), (50, False),
                                               (None, True), (9, True)])
def test_prefill_over_a_sliding_window_and_with_sinks(window, with_sinks):
    chunks = [(0, 70), (37, 30), (100, 80)]  # fresh; after cached tokens; two query tiles
    seq_lens = [cached + new for cached, new in chunks]
    paged = make_paged(seq_lens, 16, torch.float32)
    starts = [0, 70, 100, 180]
    q = random_queries(starts[-1], KV_HEADS * 2, torch.float32)
    sinks = torch.linspace(-3, 3, KV_HEADS * 2).to(DEVICE) if with_sinks else None
    got = paged_prefill_attention(
        q, paged.cache, torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), paged.tables, SCALE, starts,
        window=window, sinks=sinks)
    for i, (cached, _) in enumerate(chunks):
        s, e = starts[i], starts[i + 1]
        want = reference(q[s:e], *paged.context(i, seq_lens[i]), cached, window, sinks)
        assert_close(got[s:e], want, torch.float32)


# (chunks as (cached tokens, new tokens), block_size, group, dtype)
PREFILL_CASES = [
    ([(0, 5), (0, 70), (0, 1)], 16, 2, torch.float32),  # fresh prompts; 70 spans two q tiles
    ([(16, 9), (37, 30), (5, 1), (100, 80)], 16, 4, torch.float32),  # after cached tokens
    ([(0, 20), (33, 40)], 32, 1, torch.float16),
    ([(50, 20)], 32, 2, torch.bfloat16),
]


@pytest.mark.parametrize("chunks,block_size,group,dtype", PREFILL_CASES)
def test_prefill_is_causal_from_each_chunks_offset(chunks, block_size, group, dtype):
    seq_lens = [cached + new for cached, new in chunks]
    paged = make_paged(seq_lens, block_size, dtype)
    starts = [0]
    for _, new in chunks:
        starts.append(starts[-1] + new)
    q = random_queries(starts[-1], KV_HEADS * group, dtype)
    got = paged_prefill_attention(
        q, paged.cache, torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), paged.tables, SCALE, starts)
    for i, (cached, _) in enumerate(chunks):
        s, e = starts[i], starts[i + 1]
        assert_close(got[s:e], reference(q[s:e], *paged.context(i, seq_lens[i]), cached), dtype)


def mixed_batch(seqs: list[tuple[int, int]], block_size: int, num_heads: int,
                seed: int = 0) -> tuple:
    """(q, k, v, cache, meta): K/V already cached for each (cached, new) sequence, the new
    tokens' q/k/v, and metadata; list one-token sequences first, as the runner orders them."""
    gen = torch.Generator().manual_seed(seed)
    paged = make_paged([cached + new for cached, new in seqs], block_size, torch.float32, seed)
    k_new, v_new = [], []
    for _, new in seqs:
        k_new.append(torch.randn(new, KV_HEADS, DIM, generator=gen))
        v_new.append(torch.randn(new, KV_HEADS, DIM, generator=gen))
    meta = _mixed_meta(seqs, paged.tables.tolist(), block_size, paged.tables)
    q = torch.randn(meta.query_start_loc_cpu[-1], num_heads, DIM, generator=gen).to(DEVICE)
    return q, torch.cat(k_new).to(DEVICE), torch.cat(v_new).to(DEVICE), paged.cache, meta


@pytest.mark.parametrize("seqs,block_size", [
    ([(30, 1), (4, 1), (0, 1), (0, 12), (21, 9)], 16),  # decodes, a fresh prompt, a chunk
    ([(17, 1), (40, 1)], 32),  # decodes only
    ([(0, 7), (9, 20)], 4),  # prefill only; blocks smaller than a tile
])
@pytest.mark.parametrize("window,with_sinks", [(None, False), (7, False), (7, True)])
def test_backend_forward_matches_the_torch_backend(seqs, block_size, window, with_sinks):
    q, k, v, cache, meta = mixed_batch(seqs, block_size, num_heads=4)
    torch_cache = cache.clone()
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0], device=DEVICE) if with_sinks else None
    got = get_backend("triton").forward(q, k, v, cache, meta, SCALE, window=window, sinks=sinks)
    want = get_backend("torch").forward(q, k, v, torch_cache, meta, SCALE, window=window,
                                        sinks=sinks)
    assert torch.equal(cache, torch_cache)  # both stored the new K/V in the same slots
    assert_close(got, want, torch.float32)


def test_get_backend_returns_the_triton_backend():
    assert isinstance(get_backend("triton"), TritonAttentionBackend)


def test_get_backend_says_triton_is_missing(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match="triton.*not installed"):
        get_backend("triton")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_llm_greedy_tokens_match_the_torch_backend(tiny_model, kv_cache_dtype):
    """Chunked prefill beside decodes and a prefix hit, over a full-precision cache and an int8
    one (the Triton path rotates and quantizes in its RoPE-and-store kernel and attends between
    two rotations in its backend, the torch path does all of it in torch; an fp8 cache's int8
    keys are covered kernel by kernel above and in test_fused_kernels)."""
    from workers.engine.llm import LLM
    from workers.contract.protocol import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [list(range(1, 41)), [7, 3, 9], list(range(1, 33)) + [100, 101]]

    def generate(backend: str):
        # a small token budget splits the long prompts into chunks beside running decodes
        llm = LLM(tiny_model, attention_backend=backend, num_blocks=64, max_num_batched_tokens=24,
                  kv_cache_dtype=kv_cache_dtype)
        first = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
        # the first prompt's blocks are cached now: this prefill starts after them
        again = llm.generate([prompts[0] + [200, 201]], params)[0]
        return first, again.outputs[0].token_ids, again.num_cached_tokens

    want = generate("torch")
    assert want[2] > 0
    assert generate("triton") == want


def test_backend_forward_over_a_latent_cache_matches_the_torch_backend():
    """MLA's cache: one plane, one head, its vectors both keys and values."""
    q, k, v, cache, meta = mixed_batch([(30, 1), (4, 1), (0, 12), (21, 9)], 16, num_heads=4)
    latent = cache[:1, :, :, :1].contiguous()
    k = k[:, :1].contiguous()
    torch_cache = latent.clone()
    got = get_backend("triton").forward(q, k, k, latent, meta, SCALE)
    want = get_backend("torch").forward(q, k, k, torch_cache, meta, SCALE)
    assert torch.equal(latent, torch_cache)
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("head_dim,cache_dtype", [  # DeepSeek's latent is 576: no power of two
    (24, torch.float32), (40, torch.float32), (40, torch.int8),  # 8-bit: scales per 10 values
    (40, torch.float8_e4m3fn)])
def test_head_sizes_that_are_no_power_of_two_match_the_torch_backend(head_dim, cache_dtype):
    gen = torch.Generator().manual_seed(5)
    seqs, block_size, num_heads = [(70, 1), (3, 1), (0, 9), (21, 30)], 16, 4
    lens = [c + n for c, n in seqs]
    tables = torch.arange(sum(-(-n // block_size) for n in lens), dtype=torch.int32)
    rows, start = [], 0
    for n in lens:
        count = -(-n // block_size)
        rows.append(tables[start:start + count].tolist())
        start += count
    width = max(len(r) for r in rows)
    cache = torch.randn(2, len(tables) + 1, block_size, KV_HEADS, head_dim, generator=gen)
    meta = _mixed_meta(seqs, rows, block_size, torch.tensor(
        [r + [0] * (width - len(r)) for r in rows], dtype=torch.int32))
    starts = meta.query_start_loc_cpu
    q = torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(DEVICE)
    k = torch.randn(starts[-1], KV_HEADS, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(starts[-1], KV_HEADS, head_dim, generator=gen).to(DEVICE)
    cache = quantized_cache(cache, cache_dtype) if cache_dtype != torch.float32 else cache
    cache = cache.to(DEVICE)
    torch_cache = cache.clone()
    got = get_backend("triton").forward(q, k, v, cache, meta, head_dim ** -0.5)
    want = get_backend("torch").forward(q, k, v, torch_cache, meta, head_dim ** -0.5)
    assert_close(got, want, torch.float32)
    split = rotate(paged_decode_attention(  # the kernel alone: attends in the cache's basis
        rotate(q[:2], cache.dtype), cache, meta.block_tables[:2], meta.seq_lens[:2],
        head_dim ** -0.5, num_splits=3), cache.dtype)
    assert_close(split, want[:2], torch.float32)


def _mixed_meta(seqs: list[tuple[int, int]], rows: list[list[int]], block_size: int,
                tables: torch.Tensor) -> AttentionMetadata:
    """Metadata of a step over `seqs` ((cached, new) tokens each; the decodes first) whose
    blocks are `rows` (`tables`: the same, padded into a tensor)."""
    lens = [c + n for c, n in seqs]
    starts, slots = [0], []
    for (cached, new), row in zip(seqs, rows):
        starts.append(starts[-1] + new)
        slots += [row[p // block_size] * block_size + p % block_size
                  for p in range(cached, cached + new)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE), num_decodes=sum(n == 1 for _, n in seqs),
        max_query_len=max(n for _, n in seqs), max_seq_len=max(lens),
        query_start_loc_cpu=starts, seq_lens_cpu=lens)


def _outlier_batch(head_dim: int) -> tuple:
    """Two decodes and a chunk after cached tokens (every one reads the cache) over keys with
    outlier channels: two dims about 25x the rest, of one sign at every token, as trained
    models' keys have them (SmolLM2's). Returns q, k, v, the fp32 cache and metadata."""
    gen = torch.Generator().manual_seed(11)
    seqs, block_size = [(90, 1), (40, 1), (25, 6)], 16
    lens = [c + n for c, n in seqs]
    cache, tables = noise_paged_cache(lens, block_size, KV_HEADS, head_dim, gen)
    outliers = torch.zeros(head_dim)
    outliers[5] = 40.0
    cache[0] += outliers
    meta = _mixed_meta(seqs, tables.tolist(), block_size, tables)
    starts = meta.query_start_loc_cpu
    q = torch.randn(starts[-1], 2 * KV_HEADS, head_dim, generator=gen)
    k = torch.randn(starts[-1], KV_HEADS, head_dim, generator=gen) + outliers
    v = torch.randn(starts[-1], KV_HEADS, head_dim, generator=gen)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache.to(DEVICE), meta


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_rotated_int8_cache_attends_outlier_keys_closer_than_quarter_scales(backend,
                                                                              monkeypatch):
    """The int8 cache Hadamard-rotates each head before its quarter scales (q rotated alike, the
    output rotated back): over outlier-heavy keys its attention stays within a bound of
    full-precision attention that the unrotated format (patched off) misses by far."""
    head_dim = 64
    q, k, v, cache, meta = _outlier_batch(head_dim)
    scale = head_dim ** -0.5
    want = get_backend("torch").forward(q, k, v, cache.clone(), meta, scale)

    def error() -> float:
        stored = quantize_kv(cache, torch.int8)
        got = get_backend(backend).forward(q, k, v, stored, meta, scale)
        return (got - want).abs().max().item()

    rotated = error()
    monkeypatch.setattr(kv_quant, "ROTATED_DTYPES", frozenset())
    unrotated = error()
    # measured: 0.0204 and 0.0424 (the values' own rounding, alike in both, is in each)
    assert rotated < 0.03 < unrotated, (rotated, unrotated)

