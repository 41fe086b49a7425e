"""The CPU paged-attention backends (torch; cpu, whose decodes run a C kernel) against attention
computed naively on contiguous K/V."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from workers.attention import AttentionMetadata, get_backend
from workers.attention.torch_backend import decode_groups

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def naive(q, k_ctx, v_ctx, num_cached, scale, window=None, sinks=None):
    """q: [Lq, H, D]; k_ctx/v_ctx: [L, Hkv, D] whole context; causal from num_cached, over the
    last `window` positions when given; `sinks` [H] join each softmax as gpt-oss computes it."""
    group = q.shape[1] // k_ctx.shape[1]
    k = k_ctx.repeat_interleave(group, dim=1)
    v = v_ctx.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        end = num_cached + i + 1
        start = 0 if window is None else max(0, end - window)
        scores = torch.einsum("hd,lhd->hl", q[i], k[start:end]) * scale
        if sinks is not None:  # a column for the sink, dropped after the softmax
            probs = torch.cat([scores, sinks[:, None]], dim=-1).softmax(-1)[:, :-1]
        else:
            probs = scores.softmax(-1)
        out[i] = torch.einsum("hl,lhd->hd", probs, v[start:end])
    return out


def run_mixed_batch(backend: str, seed: int, dim: int = DIM, dtype: torch.dtype = torch.float32,
                    atol: float = 1e-5, window: int | None = None, sinks: bool = False,
                    latent: bool = False) -> None:
    """Decodes and prefill chunks (fresh and after cached tokens) in one forward, each sequence's
    output checked against naive attention over its whole context (or sliding window). `latent`:
    MLA's cache, one plane and one head whose vectors are both the keys and the values."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 512
    kv_heads = 1 if latent else KV_HEADS
    cache = torch.zeros(1 if latent else 2, num_blocks, BLOCK, kv_heads, dim, dtype=dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    # (context already in the cache, new tokens): decodes first, then prefill chunks
    seqs = [(rng.randint(1, 30), 1) for _ in range(rng.randint(1, 20) if seed else 40)]
    seqs += [(0, rng.randint(1, 9)), (rng.randint(1, 12), rng.randint(2, 9))]
    tables, contexts, q_rows, k_new, v_new, slots = [], [], [], [], [], []
    for cached, new in seqs:
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // BLOCK))]
        tables.append(blocks)
        k_ctx = torch.randn(total, kv_heads, dim).to(dtype).float()  # what the cache holds
        v_ctx = k_ctx if latent else torch.randn(total, kv_heads, dim).to(dtype).float()
        for p in range(cached):  # earlier tokens already in the paged cache
            cache[0, blocks[p // BLOCK], p % BLOCK] = k_ctx[p]
            cache[-1, blocks[p // BLOCK], p % BLOCK] = v_ctx[p]
        contexts.append((k_ctx, v_ctx, cached))
        q_rows.append(torch.randn(new, HEADS, dim))
        k_new.append(k_ctx[cached:])
        v_new.append(v_ctx[cached:])
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, total)]
    starts = [0]
    for _, new in seqs:
        starts.append(starts[-1] + new)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor([c + n for c, n in seqs]),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        num_decodes=sum(1 for _, n in seqs if n == 1) if seqs[0][1] == 1 else 0,
        max_query_len=max(n for _, n in seqs), max_seq_len=max(c + n for c, n in seqs),
        query_start_loc_cpu=starts, seq_lens_cpu=[c + n for c, n in seqs])
    scale = dim ** -0.5
    sink_logits = torch.randn(HEADS) * 2 if sinks else None
    out = get_backend(backend).forward(torch.cat(q_rows), torch.cat(k_new), torch.cat(v_new),
                                       cache, meta, scale, window=window, sinks=sink_logits)
    for i, (k_ctx, v_ctx, cached) in enumerate(contexts):
        want = naive(q_rows[i], k_ctx, v_ctx, cached, scale, window, sink_logits)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], want, atol=atol, rtol=atol)


@pytest.mark.parametrize("window,sinks,latent", [
    (None, False, False), (1, False, False), (6, False, False),  # 6: part of a block, across one
    (None, True, False), (6, True, False), (None, False, True)])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_mixed_batch_matches_naive_attention(backend, seed, window, sinks, latent):
    if backend == "cpu":
        from workers.attention import cpu_backend

        if not cpu_backend.available():
            pytest.skip("no C compiler here to build the cpu attention kernel")
    run_mixed_batch(backend, seed, window=window, sinks=sinks, latent=latent)


def test_decode_groups_cover_every_sequence_once_and_bound_the_padding():
    lens = sorted(random.Random(0).randint(1, 800) for _ in range(70))
    groups = decode_groups(lens)
    assert [i for s, e in groups for i in range(s, e)] == list(range(70))
    assert all(e - s <= 16 for s, e in groups)
    assert all(lens[e - 1] <= 1.5 * lens[s] + 16 for s, e in groups)


def test_backends_are_found_by_name_and_unknown_names_list_the_known_ones():
    assert get_backend("torch").name == "torch"
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'.*'cpu'.*'torch'"):
        get_backend("flash")


def test_the_registry_imports_no_backend_until_one_is_asked_for():
    code = ("import sys, workers.attention\n"
            "loaded = [m for m in sys.modules\n"
            "          if m.startswith('workers.attention.') and m.endswith('_backend')]\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
