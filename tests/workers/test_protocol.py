"""Torch-free request types: block hashes the router and the engine must agree on."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from workers.contract.prefix_cache import hash_block, hash_prompt_blocks


@given(tokens=st.lists(st.integers(-2**63, 2**63 - 1), max_size=80),
       block_size=st.sampled_from([1, 2, 4, 16]), salt=st.none() | st.text(max_size=5))
def test_prompt_hashes_equal_chaining_block_hashes(tokens, block_size, salt):
    chained, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start:start + block_size], salt if start == 0 else None)
        chained.append(parent)
    assert hash_prompt_blocks(tokens, block_size, salt) == chained


def test_salt_and_order_change_the_hash():
    tokens = list(range(32))
    assert hash_prompt_blocks(tokens, 16) != hash_prompt_blocks(tokens, 16, salt="t")
    assert hash_prompt_blocks(tokens, 16)[1] != hash_prompt_blocks(tokens[16:] + tokens[:16], 16)[0]
