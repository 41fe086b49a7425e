"""The host-memory tier of the prefix cache: evicted blocks saved to host memory and copied
back on a hit, with every block read holding exactly the tokens its hash names."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.workers.factories import create_request, create_scheduler, replay_events
from tests.workers.test_block_accounting import OPS, check_pool
from workers.engine.llm import LLM
from workers.contract.protocol import FinishReason, SamplingParams
from workers.contract.prefix_cache import hash_prompt_blocks
from workers.engine.step_costs import StepCosts
from workers.serving.connector import Connector


class FakeTensors:
    """What the cache's tensors would hold: per device and host block, the token written at
    each slot. Makes a step's tier copies, checks that every computed block a chunk reads holds
    its own tokens, then writes the chunk's tokens (the forward pass)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.device: dict[int, list[int | None]] = {}
        self.host: dict[int, list[int | None]] = {}

    def _block(self, block_id: int) -> list[int | None]:
        return self.device.setdefault(block_id, [None] * self.block_size)

    def write(self, table: tuple[int, ...] | list[int], tokens: list[int], start: int,
              end: int) -> None:
        for p in range(start, end):
            self._block(table[p // self.block_size])[p % self.block_size] = tokens[p]

    def step(self, scheduler, token: int = 5) -> None:
        out = scheduler.schedule()
        for device_block, host_block in out.block_copies.swap_out:  # saves first
            self.host[host_block] = list(self._block(device_block))
        for host_block, device_block in out.block_copies.swap_in:
            self.device[device_block] = list(self.host[host_block])
        size = self.block_size
        for req, start, n, table, _, _ in out.chunks:
            tokens = req.all_token_ids
            for i in range(start // size):  # the prefix the chunk attends over
                assert self._block(table[i]) == tokens[i * size:(i + 1) * size], (
                    f"{req.request_id}: block {i} (id {table[i]}) holds the wrong KV")
            self.write(table, tokens, start, start + n)
        scheduler.update(out, {c.request.request_id: token for c in out.chunks if c.samples})


def check_host_tier(scheduler) -> None:
    host = scheduler.kv.host
    if host is None:
        return
    held = list(host._by_hash.values())
    assert len(held) == len(set(held)), "two hashes share a host block"
    assert len(held) + len(host._free) == host.num_blocks
    assert not host._swap_out and not host._swap_in and not host._reading  # taken by the step


@settings(max_examples=150, deadline=None)
@given(ops=OPS, host_blocks=st.sampled_from([1, 3, 8, 40]))
def test_every_block_read_holds_its_tokens_and_every_block_returns(ops, host_blocks):
    scheduler = create_scheduler(num_blocks=12, block_size=4, max_num_seqs=3,
                                 max_num_batched_tokens=8, host_blocks=host_blocks)
    tensors = FakeTensors(4)
    added: list[str] = []
    for op in ops:
        if op[0] in ("add", "handoff"):
            rid = f"r{len(added)}"
            req = create_request(rid, op[1], max_tokens=op[2], ignore_eos=True)
            if op[0] == "add":
                scheduler.add(req)
                added.append(rid)
            else:
                req.append_output(5)  # the first token, sampled by the prefill worker
                if scheduler.add_waiting_for_kv(req):  # the pull writes the prompt's blocks
                    tensors.write(scheduler.kv.block_table(rid), req.all_token_ids, 0,
                                  req.num_prompt_tokens)
                    added.append(rid)
        elif op[0] == "land":
            if scheduler.waiting_for_kv:
                waiting = list(scheduler.waiting_for_kv)
                scheduler.kv_landed(waiting[op[1] % len(waiting)])
        elif op[0] == "step":
            tensors.step(scheduler)
        elif added:
            scheduler.finish(added[op[1] % len(added)], FinishReason.ABORT)
        check_pool(scheduler)
        check_host_tier(scheduler)
    for rid in list(scheduler.waiting_for_kv):
        scheduler.kv_landed(rid)
    for _ in range(500):
        if not scheduler.num_unfinished:
            break
        tensors.step(scheduler)
        check_pool(scheduler)
        check_host_tier(scheduler)
    assert scheduler.num_unfinished == 0
    pool, host = scheduler.kv.pool, scheduler.kv.host
    assert pool.num_free_blocks == pool.num_blocks
    events = scheduler.kv.events.drain()
    assert [e.seq for e in events] == list(range(len(events)))
    assert replay_events(events) == set(pool.cached_hashes())
    assert replay_events(events, "host") == set(host.cached_hashes())


def test_an_evicted_prefix_comes_back_from_host_memory_not_recomputed():
    scheduler = create_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=64,
                                 host_blocks=8)
    tensors = FakeTensors(4)
    old = [1] * 8 + [2]
    scheduler.add(create_request("old", old, max_tokens=1))
    tensors.step(scheduler)
    scheduler.add(create_request("new", [3] * 8 + [4], max_tokens=1))
    tensors.step(scheduler)  # evicts the old prompt's two blocks: saved to the host tier
    old_hashes = hash_prompt_blocks(old, 4)
    assert not set(old_hashes) & set(scheduler.kv.pool.cached_hashes())
    assert set(old_hashes) <= set(scheduler.kv.host.cached_hashes())
    events = scheduler.kv.events.drain()
    assert set(old_hashes) <= replay_events(events, "host")

    scheduler.add(create_request("again", old + [9, 9, 9], max_tokens=1))
    out = scheduler.schedule()
    assert out.num_batched_tokens == 4  # 8 of 12 tokens come back from host memory
    assert len(out.block_copies.swap_in) == 2
    assert out.chunks[0].request.num_cached_tokens == 8
    # the loaded blocks are device cache entries again, reported as such
    stored = replay_events(scheduler.kv.events.drain())
    assert set(old_hashes) <= stored


def test_a_block_brought_back_is_not_copied_out_again():
    scheduler = create_scheduler(num_blocks=2, block_size=4, max_num_batched_tokens=64,
                                 host_blocks=8)
    tensors = FakeTensors(4)
    for rid, prompt in (("a", [1] * 4 + [2]), ("b", [3] * 4 + [4]), ("c", [1] * 4 + [5]),
                        ("d", [3] * 4 + [6])):
        scheduler.add(create_request(rid, prompt, max_tokens=1))
        tensors.step(scheduler)
    host = scheduler.kv.host
    assert host.num_loaded == 2
    assert host.num_saved == 2  # [1]*4 and [3]*4, once each: the host copy stays valid


def test_a_host_hit_survives_the_saves_its_own_allocation_makes():
    # one host block: admitting "c" loads [1]*4 from it while evicting [3]*4 from the device,
    # whose save must not take the block being read
    scheduler = create_scheduler(num_blocks=2, block_size=4, max_num_batched_tokens=64,
                                 host_blocks=1)
    tensors = FakeTensors(4)
    for rid, prompt in (("a", [1] * 4 + [2]), ("b", [3] * 4 + [4]), ("c", [1] * 4 + [5])):
        scheduler.add(create_request(rid, prompt, max_tokens=1))
        tensors.step(scheduler)
    host = scheduler.kv.host
    assert host.num_loaded == 1 and host.num_dropped == 1
    assert host.cached_hashes() == hash_prompt_blocks([1] * 4, 4)


def test_reset_empties_both_tiers():
    scheduler = create_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=64,
                                 host_blocks=8)
    tensors = FakeTensors(4)
    for rid, first in (("a", 1), ("b", 3)):
        scheduler.add(create_request(rid, [first] * 8 + [2], max_tokens=1))
        tensors.step(scheduler)
    assert scheduler.kv.host.num_cached_blocks
    assert scheduler.kv.reset_prefix_cache()
    assert scheduler.kv.host.num_cached_blocks == 0 and not scheduler.kv.pool.cached_hashes()


# ---- the engine, with real tensors ------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _conversations(llm: LLM, turns: int = 3, seed: int = 0) -> list[tuple[list[int], int]]:
    """Five conversations, round-robin, each turn the whole history plus a new message: their
    KV outgrows a small cache, so earlier turns' prefixes are evicted between visits. Returns
    every turn's greedy tokens and cached prompt tokens."""
    rng = random.Random(seed)
    histories = [[rng.randrange(5, 500) for _ in range(80)] for _ in range(5)]
    results = []
    for _ in range(turns):
        for history in histories:
            out = llm.generate([history], GREEDY)[0]
            tokens = list(out.outputs[0].token_ids)
            results.append((tokens, out.num_cached_tokens))
            history.extend(tokens + [rng.randrange(5, 500) for _ in range(12)])
    return results


@pytest.fixture(scope="module")
def without_tier(tiny_model):
    return _conversations(LLM(tiny_model, num_blocks=12, block_size=16))


@pytest.mark.parametrize("options", [{}, {"kv_cache_dtype": "int8"}], ids=["auto", "int8"])
def test_greedy_output_is_identical_with_the_host_tier(tiny_model, without_tier, options):
    """Full precision: as recomputing what was evicted. An 8-bit cache: a prompt prefilled
    fresh attends its own K/V before quantization, a restored prefix attends its quantized
    copy, so the oracle is a device cache that keeps every block (the same bytes read back);
    recomputing differs by the quantization error (a near-tie flipped once on this model)."""
    baseline = (without_tier if not options else
                _conversations(LLM(tiny_model, num_blocks=12, block_size=16, **options)))
    oracle = (baseline if not options else
              _conversations(LLM(tiny_model, num_blocks=256, block_size=16, **options)))
    llm = LLM(tiny_model, num_blocks=12, block_size=16, host_kv_cache_memory_bytes=64 << 20,
              **options)
    tiered = _conversations(llm)
    assert [t for t, _ in tiered] == [t for t, _ in oracle]
    host, pool = llm.engine.kv.host, llm.engine.kv.pool
    assert host.num_loaded > 0 and host.num_saved > 0
    # later turns find their whole history again; without the tier most of it was evicted
    assert sum(c for _, c in tiered) > 2 * sum(c for _, c in baseline)
    assert pool.num_free_blocks == pool.num_blocks  # every block back
    snapshot = Connector(llm.engine).kv_snapshot()
    assert snapshot.host_block_hashes == frozenset(host.cached_hashes())
    # measured, not the prior: copying a block back is far cheaper than recomputing it here
    assert 0.0 < llm.engine.stats().host_hit_cost < StepCosts.HOST_HIT_PRIOR


def test_tensor_parallel_ranks_keep_their_own_host_tier(tiny_model, without_tier):
    llm = LLM(tiny_model, num_blocks=12, block_size=16, host_kv_cache_memory_bytes=64 << 20,
              tensor_parallel_size=2)
    try:
        tiered = _conversations(llm)
    finally:
        llm.engine.close()
    assert [t for t, _ in tiered] == [t for t, _ in without_tier]
    assert llm.engine.kv.host.num_loaded > 0


def test_a_host_tier_too_small_for_a_block_is_refused(tiny_model):
    with pytest.raises(ValueError, match="host_kv_cache_memory_bytes=100 holds no block"):
        LLM(tiny_model, num_blocks=20, host_kv_cache_memory_bytes=100)
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        LLM(tiny_model, num_blocks=20, host_kv_cache_memory_bytes=64 << 20,
            enable_prefix_caching=False)


def test_host_tier_blocks_are_kept_apart_per_lora_adapter(tiny_model, tmp_path):
    """A prompt's blocks under an adapter, evicted to host memory, come back for that adapter
    (its text again) and never for the base model (nothing cached, the base model's text)."""
    from workers.models.lora.make_adapter import ATTENTION, MLP, make_adapter

    folder = make_adapter(tiny_model, tmp_path / "sql", rank=8, targets=ATTENTION + MLP, seed=1)
    lora = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8,
            "lora_modules": (f"sql={folder}",)}
    llm = LLM(tiny_model, num_blocks=12, block_size=16, host_kv_cache_memory_bytes=64 << 20,
              **lora)
    reference = LLM(tiny_model, num_blocks=256, block_size=16, **lora)
    rng = random.Random(3)
    prompt = [rng.randrange(5, 500) for _ in range(80)]
    want = {name: list(reference.generate([prompt], GREEDY, lora_name=name)[0].outputs[0]
                       .token_ids) for name in ("sql", None)}
    assert want["sql"] != want[None]

    def run(name):
        out = llm.generate([prompt], GREEDY, lora_name=name)[0]
        return list(out.outputs[0].token_ids), out.num_cached_tokens

    assert run("sql") == (want["sql"], 0)
    for _ in range(3):  # other prompts push its blocks out of the 12 on the device
        llm.generate([[rng.randrange(5, 500) for _ in range(80)]], GREEDY)
    host = llm.engine.kv.host
    assert host.num_saved > 0
    assert run(None) == (want[None], 0)
    loaded = host.num_loaded
    tokens, cached = run("sql")
    assert tokens == want["sql"] and cached == 64 and host.num_loaded > loaded
