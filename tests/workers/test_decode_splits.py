"""How many splits a paged decode uses: enough to fill idle SMs, never more than a scratch of
`max_split_rows` holds. Plain arithmetic, so it runs without triton."""

from __future__ import annotations

import pytest

from workers.attention.decode_splits import MAX_SPLITS, choose_num_splits, max_split_rows


def test_num_splits_fill_idle_sms_only_for_long_sequences():
    assert choose_num_splits(batch=128, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 1
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seq_len=100, num_sms=132) == 1
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seq_len=32768, num_sms=132) == MAX_SPLITS
    assert choose_num_splits(batch=4, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 4
    assert choose_num_splits(batch=1, num_kv_heads=8, max_seq_len=1024, num_sms=132) == 4
    with pytest.raises(ValueError, match="positive"):
        choose_num_splits(batch=0, num_kv_heads=8, max_seq_len=10)


@pytest.mark.parametrize("num_kv_heads,num_sms", [(8, 132), (1, 132), (4, 78), (2, 1)])
def test_max_split_rows_covers_every_split_choice(num_kv_heads, num_sms):
    """A scratch of max_split_rows never needs to grow, so graphs captured over it stay valid."""
    rows = max_split_rows(num_kv_heads, num_sms)
    for batch in range(1, 300):
        for length in (1, 300, 5000, 10 ** 6):
            splits = choose_num_splits(batch, num_kv_heads, length, num_sms)
            assert splits == 1 or batch * splits <= rows
    assert rows < 2 * num_sms / num_kv_heads + 1
