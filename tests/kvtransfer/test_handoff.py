"""The prefill->decode payload: `KVHandoff` sizes itself, refuses records that disagree or come
from another version, and loads without torch (the router carries it)."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import pytest

from kvtransfer.errors import InvalidDescriptor
from kvtransfer.handoff import DTYPE_SIZES, HANDOFF_VERSION, Handoff, KVHandoff, KVLayout


def make_rank_handoff(tp_rank: int = 0, tp_size: int = 1, **overrides) -> Handoff:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16",
                      tp_rank=tp_rank, tp_size=tp_size)
    d = dict(request_id="req-1", address=f"tcp://127.0.0.1:{4000 + tp_rank}", layout=layout,
             block_ids=(3, 4, 9), lease_id=f"L{tp_rank}", expires_at=1e9)
    return Handoff(**{**d, **overrides})


def make_kv_handoff(tp_size: int = 2) -> KVHandoff:
    return KVHandoff(tuple(make_rank_handoff(r, tp_size) for r in range(tp_size)))


def test_byte_count_is_every_rank_layer_block_key_and_value() -> None:
    handoff = make_kv_handoff(tp_size=2)
    # 2 ranks x 3 blocks x 3 layers x (K and V) x 4 tokens x 2 heads x 8 dims x 2 bytes
    assert handoff.num_bytes == 2 * 3 * 3 * 2 * 4 * 2 * 8 * DTYPE_SIZES["bfloat16"] == 4608
    assert handoff.num_blocks == 3
    assert handoff.request_id == "req-1"
    assert handoff.version == HANDOFF_VERSION


def test_every_dtype_size_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    for name, size in DTYPE_SIZES.items():
        assert torch.empty((), dtype=getattr(torch, name)).element_size() == size, name


def test_ranks_of_different_requests_are_refused_naming_them() -> None:
    other = make_rank_handoff(1, 2, request_id="req-2")
    with pytest.raises(InvalidDescriptor, match=r"request ids \['req-1', 'req-2'\]"):
        KVHandoff((make_rank_handoff(0, 2), other))


def test_missing_or_repeated_tp_ranks_are_refused() -> None:
    with pytest.raises(InvalidDescriptor, match=r"tp_ranks \[0\] of tp_sizes \[2\]"):
        KVHandoff((make_rank_handoff(0, 2),))
    with pytest.raises(InvalidDescriptor, match=r"block counts \[1, 3\]"):
        KVHandoff((make_rank_handoff(0, 2), make_rank_handoff(1, 2, block_ids=(5,))))
    with pytest.raises(InvalidDescriptor, match="KVHandoff.ranks"):
        KVHandoff(())


def latent_handoff(tp_rank: int = 0, tp_size: int = 2) -> Handoff:
    layout = KVLayout(num_layers=3, num_kv_heads=1, head_dim=64, block_size=4,
                      dtype="bfloat16", tp_rank=tp_rank, tp_size=tp_size, kind="latent")
    return make_rank_handoff(tp_rank, tp_size, layout=layout)


def test_a_latent_cache_is_one_handoff_of_one_plane_whole_on_any_rank() -> None:
    handoff = KVHandoff((latent_handoff(),))
    # 3 blocks x 3 layers x one latent (no K/V pair) x 4 tokens x 64 dims x 2 bytes
    assert handoff.num_bytes == 3 * 3 * 4 * 64 * 2
    layout = handoff.ranks[0].layout
    assert (layout.planes, layout.total_kv_heads, layout.head_start) == (1, 1, 0)
    assert KVLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(InvalidDescriptor, match="2 latent handoffs; expected one"):
        KVHandoff((latent_handoff(0), latent_handoff(1)))


def test_latent_layouts_are_checked_and_never_transfer_into_kv_layouts() -> None:
    from kvtransfer.errors import LayoutMismatch
    from kvtransfer.handoff import check_transferable

    with pytest.raises(InvalidDescriptor, match="num_kv_heads = 2 for a latent layout"):
        KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32",
                 kind="latent")
    with pytest.raises(InvalidDescriptor, match="KVLayout.kind = 'mla'"):
        KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32",
                 kind="mla")
    latent = latent_handoff().layout
    kv = dataclasses.replace(latent, kind="kv")
    with pytest.raises(LayoutMismatch, match="kind 'latent' vs 'kv'"):
        check_transferable(latent, kv)
    check_transferable(latent, dataclasses.replace(latent, tp_rank=0, tp_size=1))


def test_unknown_version_is_refused_in_plain_words() -> None:
    with pytest.raises(InvalidDescriptor, match=r"version = 2: this worker reads only version 1"):
        KVHandoff(make_kv_handoff().ranks, version=2)


def test_pickle_round_trip_checks_the_version() -> None:
    handoff = make_kv_handoff()
    assert pickle.loads(pickle.dumps(handoff)) == handoff
    future = make_kv_handoff()
    object.__setattr__(future, "version", 7)  # as a newer Cleave would pickle it
    with pytest.raises(InvalidDescriptor, match="version = 7"):
        pickle.loads(pickle.dumps(future))


def test_replace_keeps_checking() -> None:
    with pytest.raises(InvalidDescriptor, match="version"):
        dataclasses.replace(make_kv_handoff(), version=0)


def test_handoff_records_load_without_torch() -> None:
    code = ("import sys, kvtransfer.handoff, kvtransfer\n"
            "assert kvtransfer.KVHandoff is kvtransfer.handoff.KVHandoff\n"
            "loaded = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
