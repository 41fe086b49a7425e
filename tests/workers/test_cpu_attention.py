"""The `cpu` attention backend: the C decode kernel against softmax attention computed naively on
contiguous K/V, its build (cached; a missing compiler is a clear error and `auto` falls back to
torch), and the backend's fallbacks for what the kernel does not take."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from tests.workers.factories import noise_paged_cache
from workers.attention import cpu_backend
from workers.attention.cpu_backend import KernelBuildError, build_kernel, paged_decode
from workers.engine.config import EngineConfig

pytestmark = pytest.mark.skipif(not cpu_backend.available(),
                                reason="no C compiler here to build the cpu attention kernel")


def make_case(seq_lens, heads, kv_heads, dim, block_size, seed=0):
    """Queries, a cache of noise with shuffled block tables, and the lengths as int32."""
    gen = torch.Generator().manual_seed(seed)
    cache, tables = noise_paged_cache(seq_lens, block_size, kv_heads, dim, gen)
    q = torch.randn(len(seq_lens), heads, dim, generator=gen)
    return q, cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


def naive_decode(q, cache, tables, seq_lens, scale):
    heads, kv_heads = q.shape[1], cache.shape[3]
    out = torch.empty_like(q)
    for i, length in enumerate(seq_lens.tolist()):
        k, v = (cache[j].index_select(0, tables[i].long()).flatten(0, 1)[:length]
                for j in (0, 1))  # [L, Hkv, D]
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        probs = (torch.einsum("hd,lhd->hl", q[i].double(), k.double()) * scale).softmax(-1)
        out[i] = torch.einsum("hl,lhd->hd", probs, v.double()).float()
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("dim", [8, 16, 24, 32, 64, 128])
def test_decode_matches_naive_attention(heads, kv_heads, dim):
    # lengths: one token, exactly one and several full blocks, partial last blocks, long
    seq_lens = [1, 16, 17, 48, 5, 300, 33, 2]
    q, cache, tables, lens = make_case(seq_lens, heads, kv_heads, dim, block_size=16)
    scale = dim ** -0.5
    got = paged_decode(q, cache, tables, lens, scale)
    torch.testing.assert_close(got, naive_decode(q, cache, tables, lens, scale),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 8, 32, 128])
def test_decode_any_block_size(block_size):
    seq_lens = [1, 7, 130, 64, 257]
    q, cache, tables, lens = make_case(seq_lens, 8, 2, 64, block_size, seed=block_size)
    got = paged_decode(q, cache, tables, lens, 0.125)
    torch.testing.assert_close(got, naive_decode(q, cache, tables, lens, 0.125),
                               atol=1e-5, rtol=1e-5)


def test_decode_scores_far_apart_stay_finite():
    """Online softmax across blocks: a later block's maximum far above the first block's must
    rescale what was accumulated, not overflow."""
    q, cache, tables, lens = make_case([64], 2, 1, 16, 16)
    cache[0] *= 40.0  # scores in the hundreds
    got = paged_decode(q, cache, tables, lens, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, naive_decode(q, cache, tables, lens, 1.0),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dim", [64, 24, 16])
def test_a_bf16_cache_is_read_as_fp32(dim):
    """A bf16 cache decodes in the kernel: the same as the fp32 kernel over the cache's values
    widened to fp32, and close to naive attention over them."""
    seq_lens = [1, 16, 40, 300]
    q, cache, tables, lens = make_case(seq_lens, 8, 2, dim, block_size=16, seed=5)
    half = cache.bfloat16()
    got = paged_decode(q, half, tables, lens, 0.125)
    assert got.dtype == torch.float32
    assert torch.equal(got, paged_decode(q, half.float(), tables, lens, 0.125))
    torch.testing.assert_close(got, naive_decode(q, half.float(), tables, lens, 0.125),
                               atol=1e-5, rtol=1e-5)


def test_result_does_not_depend_on_the_thread_count():
    rng = random.Random(3)
    seq_lens = [rng.randint(1, 200) for _ in range(37)]
    q, cache, tables, lens = make_case(seq_lens, 8, 4, 64, 16, seed=3)
    one = paged_decode(q, cache, tables, lens, 0.125, num_threads=1)
    for threads in (2, 5):
        assert torch.equal(paged_decode(q, cache, tables, lens, 0.125, num_threads=threads), one)


@pytest.mark.parametrize("num_seqs,threads", [(1, 2), (1, 3), (2, 7), (3, 4)])
def test_fewer_sequences_than_threads_split_heads_with_the_same_result(num_seqs, threads):
    # below one sequence per thread, a sequence's KV-head groups are split over the threads
    q, cache, tables, lens = make_case([150, 17, 64][:num_seqs], 8, 4, 64, 16, seed=5)
    one = paged_decode(q, cache, tables, lens, 0.125, num_threads=1)
    assert torch.equal(paged_decode(q, cache, tables, lens, 0.125, num_threads=threads), one)
    torch.testing.assert_close(one, naive_decode(q, cache, tables, lens, 0.125),
                               rtol=1e-5, atol=1e-5)
    sinks = torch.linspace(-1.0, 1.0, 8)  # with a sliding window and attention sinks too
    one = paged_decode(q, cache, tables, lens, 0.125, num_threads=1, window=40, sinks=sinks)
    assert torch.equal(paged_decode(q, cache, tables, lens, 0.125, num_threads=threads,
                                    window=40, sinks=sinks), one)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (6, 3, 32), (12, 4, 64)])
def test_a_split_of_few_heads_normalizes_them_as_the_whole_sequence_does(heads, kv_heads, dim):
    """Items of 1-3 query heads (the tiny model's 4 heads over 2 threads: 2 each), where a loop
    over an item's heads vectorized by the compiler had its remainder divide otherwise."""
    for seed, seq_lens in enumerate(([1], [8], [7], [20], [33], [8, 21])):
        q, cache, tables, lens = make_case(seq_lens, heads, kv_heads, dim, 4, seed=seed)
        one = paged_decode(q, cache, tables, lens, 0.25, num_threads=1)
        for threads in (2, 3, 4):
            got = paged_decode(q, cache, tables, lens, 0.25, num_threads=threads)
            assert torch.equal(got, one), (seq_lens, threads)


def verification_case(rows_per_seq, longest, heads, kv_heads, dim, block_size, seed):
    """Sequences of `longest` tokens, each with `rows_per_seq` rows as a speculative
    verification lays them out (its rows together, one block table, seq_lens one apart, the last
    row's the longest): (q, cache, tables, lens) with one entry per row."""
    _, cache, tables, _ = make_case(longest, heads, kv_heads, dim, block_size, seed=seed)
    owner = [s for s, n in enumerate(rows_per_seq) for _ in range(n)]
    lens = [length - n + 1 + i for length, n in zip(longest, rows_per_seq) for i in range(n)]
    q = torch.randn(len(owner), heads, dim, generator=torch.Generator().manual_seed(seed))
    return q, cache, tables[owner], torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 16), (6, 6, 24)])
def test_a_sequence_s_rows_attended_together_equal_each_row_attended_alone(kv_dtype, heads,
                                                                          kv_heads, dim):
    """A verification's rows share a work item (each cached K/V row read once for all of them);
    each row's result must still be the 1-row decode step's bit for bit, on any thread count,
    or greedy output would change with speculation. Rows across block boundaries (16, 32), in
    the first block, more rows than an item takes (10); with a window and sinks too."""
    q, cache, tables, lens = verification_case([5, 3, 5, 10, 1], [18, 5, 34, 100, 40], heads,
                                               kv_heads, dim, block_size=16, seed=dim)
    cache = cache.to(kv_dtype)
    sinks = torch.linspace(-1.0, 1.0, heads)
    for window, sink in ((None, None), (20, sinks)):
        alone = torch.cat([paged_decode(q[r:r + 1], cache, tables[r:r + 1], lens[r:r + 1],
                                        0.125, num_threads=1, window=window, sinks=sink)
                           for r in range(len(lens))])
        for threads in (1, 2, 3):
            together = paged_decode(q, cache, tables, lens, 0.125, num_threads=threads,
                                    window=window, sinks=sink)
            assert torch.equal(together, alone), (window, threads)
        # on two threads: one sequence's rows (its heads and rows split), a verification
        # beside a plain decode (its rows split)
        for r, rows in ((0, [5]), (4, [5]), (12, [5]), (3, [5, 1]), (7, [1, 5])):
            one = verification_case(rows, [18 + r] * len(rows), heads, kv_heads, dim, 16,
                                    seed=r)
            q1, cache1, tables1, lens1 = one[0], one[1].to(kv_dtype), one[2], one[3]
            solo = [paged_decode(q1[i:i + 1], cache1, tables1[i:i + 1], lens1[i:i + 1], 0.125,
                                 num_threads=1, window=window, sinks=sink)
                    for i in range(len(lens1))]
            got = paged_decode(q1, cache1, tables1, lens1, 0.125, num_threads=2, window=window,
                               sinks=sink)
            assert torch.equal(got, torch.cat(solo)), (window, r, rows)
    want = naive_decode(q, cache.float(), tables, lens, 0.125)
    torch.testing.assert_close(paged_decode(q, cache, tables, lens, 0.125), want, atol=1e-5,
                               rtol=1e-5)


def test_decode_writes_into_out_and_reads_strided_queries():
    q, cache, tables, lens = make_case([20, 9], 4, 2, 16, 16)
    wide = torch.randn(2, 4, 32)
    wide[..., :16] = q  # a view with a row stride of 32: copied to contiguous first
    out = torch.full((2, 4, 16), float("nan"))
    assert paged_decode(wide[..., :16], cache, tables, lens, 0.25, out=out) is out
    torch.testing.assert_close(out, naive_decode(q, cache, tables, lens, 0.25),
                               atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_refused_with_what_was_expected():
    q, cache, tables, lens = make_case([5], 4, 2, 16, 16)
    with pytest.raises(TypeError, match="float32 or bfloat16 cache.*torch.float16"):
        paged_decode(q, cache.half(), tables, lens, 0.25)
    with pytest.raises(TypeError, match="float32 q.*torch.bfloat16"):
        paged_decode(q.bfloat16(), cache, tables, lens, 0.25)
    q12, cache12, tables12, lens12 = make_case([5], 4, 2, 12, 16)
    with pytest.raises(ValueError, match="4 heads of 12.*multiple of 8"):
        paged_decode(q12, cache12, tables12, lens12, 0.25)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_decode(torch.randn(1, 3, 16), cache, tables, lens, 0.25)


def test_backend_falls_back_to_torch_for_what_the_kernel_does_not_take():
    """Head sizes that are not multiples of 8 decode through the torch path; bf16 through the
    kernel, against the reference."""
    from tests.workers.test_attention import run_mixed_batch

    run_mixed_batch("cpu", seed=1, dim=12)
    run_mixed_batch("cpu", seed=2, dtype=torch.bfloat16, atol=2e-2)


def test_loading_the_kernel_leaves_subnormal_floats_alone():
    """-ffast-math at link time would load a constructor that sets flush-to-zero for the whole
    process, silently changing torch's (and everyone's) arithmetic on tiny values."""
    cpu_backend.load_kernel()
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # subnormal in fp32
    assert (tiny / 2).item() > 0.0
    assert (tiny * 1.0).item() == pytest.approx(1e-39, rel=1e-3)


def test_build_is_cached_per_source_compiler_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CLEAVE_CACHE_DIR", str(tmp_path))
    first = build_kernel()
    assert first.parent == tmp_path / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert build_kernel() == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    assert list((tmp_path / "kernels").iterdir()) == [first]  # no temporary files left


def test_missing_compiler_is_named_and_auto_falls_back_to_torch(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CLEAVE_CACHE_DIR", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(KernelBuildError, match="'no-such-cc' not found"):
        build_kernel()
    cpu_backend.load_kernel.cache_clear()
    cpu_backend.available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="workers.attention.cpu_backend"):
            assert EngineConfig(model="unused", device="cpu").resolved_attention_backend == "torch"
        assert "no-such-cc" in caplog.text
    finally:
        cpu_backend.load_kernel.cache_clear()
        cpu_backend.available.cache_clear()


def test_auto_picks_the_kernel_on_the_cpu():
    assert EngineConfig(model="unused", device="cpu").resolved_attention_backend == "cpu"
    assert EngineConfig(model="unused", device="cpu",
                        attention_backend="torch").resolved_attention_backend == "torch"
