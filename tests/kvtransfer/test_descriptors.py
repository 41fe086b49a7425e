"""Layouts and handoff records: round trips, and bad records rejected naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from kvtransfer import Handoff, InvalidDescriptor, KVLayout, LayoutMismatch, check_transferable
from kvtransfer.plan import Segment, coalesce
from tests.kvtransfer.factories import make_layout, zero_caches


def make_handoff(**overrides) -> Handoff:
    d = dict(request_id="r", address="tcp://127.0.0.1:1", layout=make_layout(),
             block_ids=(3, 4, 9), lease_id="L", expires_at=1e9)
    return Handoff(**{**d, **overrides})


def test_handoff_round_trips_through_json() -> None:
    h = make_handoff(layout=make_layout(tp_rank=1, tp_size=2, dtype="float8_e5m2"))
    assert Handoff.from_json(h.to_json()) == h


@pytest.mark.parametrize("field, value, message", [
    ("block_ids", [], "block_ids"), ("block_ids", [1, -2], "block_ids"),
    ("lease_id", "", "lease_id"), ("expires_at", "soon", "expires_at"),
])
def test_bad_handoff_field_is_named(field: str, value, message: str) -> None:
    d = make_handoff().to_dict()
    d[field] = value
    with pytest.raises(InvalidDescriptor, match=message):
        Handoff.from_json(json.dumps(d))


def test_missing_and_unknown_fields_are_named() -> None:
    d = make_handoff().to_dict()
    del d["lease_id"]
    d["colour"] = "blue"
    with pytest.raises(InvalidDescriptor, match=r"missing fields \['lease_id'\].*\['colour'\]"):
        Handoff.from_dict(d)
    with pytest.raises(InvalidDescriptor, match="not JSON"):
        Handoff.from_json("{")


@pytest.mark.parametrize("overrides, message", [
    ({"dtype": "float64"}, "dtype"), ({"tp_rank": 2, "tp_size": 2}, "tp_rank"),
    ({"block_size": 0}, "block_size"), ({"memory_order": "token,kv"}, "memory_order"),
])
def test_bad_layout_is_named(overrides: dict, message: str) -> None:
    with pytest.raises(InvalidDescriptor, match=message):
        KVLayout.from_dict({**make_layout().to_dict(), **overrides})


def test_layouts_differing_only_in_tp_are_transferable_others_are_not() -> None:
    check_transferable(make_layout(num_kv_heads=4), make_layout(num_kv_heads=2, tp_size=2))
    with pytest.raises(LayoutMismatch, match="head_dim 8 vs 16.*block_size 4 vs 8"):
        check_transferable(make_layout(), make_layout(head_dim=16, block_size=8))


def test_a_rotated_8_bit_cache_never_lands_in_an_unrotated_one() -> None:
    """A rolling upgrade's old worker (int8 stored unrotated) and a new one (Hadamard-rotated):
    the same dtype and shape, different values; the handoff is refused naming the encoding."""
    from workers.kernels.kv_quant import encoding

    old, new = make_layout(dtype="int8"), make_layout(dtype="int8", encoding=encoding(torch.int8))
    check_transferable(new, KVLayout.from_dict(new.to_dict()))
    with pytest.raises(LayoutMismatch, match="encoding '' vs 'hadamard'"):
        check_transferable(old, new)
    assert encoding(torch.bfloat16) == ""
    # fp8: e4m3 keys and values before; rotated int8 keys and e4m3 values now
    old = make_layout(dtype="float8_e4m3fn")
    new = make_layout(dtype="float8_e4m3fn", encoding=encoding(torch.float8_e4m3fn))
    with pytest.raises(LayoutMismatch, match="encoding '' vs 'hadamard,int8-keys'"):
        check_transferable(old, new)


def test_layout_from_caches_and_cache_check() -> None:
    layout = make_layout()
    caches = zero_caches(layout, 5)
    assert KVLayout.from_caches(caches) == layout
    assert layout.check_caches(caches) == 5
    with pytest.raises(LayoutMismatch, match="layer 1 cache"):
        layout.check_caches([caches[0], caches[1].float(), caches[2]])
    with pytest.raises(LayoutMismatch, match="2 cache tensors"):
        layout.check_caches(caches[:2])
    with pytest.raises(LayoutMismatch, match=r"expected \[2, num_blocks"):
        KVLayout.from_caches([torch.zeros(3, 4)])


def test_contiguous_runs_coalesce_on_both_sides() -> None:
    assert coalesce([5, 6, 7, 2, 3], [0, 1, 2, 3, 4]) == (Segment(5, 0, 3), Segment(2, 3, 2))
    assert coalesce([5, 6, 7], [0, 2, 3]) == (Segment(5, 0, 1), Segment(6, 2, 2))
    with pytest.raises(LayoutMismatch, match="2 destination blocks for 3 source"):
        coalesce([1, 2, 3], [1, 2])
