"""Block accounting and the prefix cache, on the scheduler alone (no model)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.workers.factories import (create_request, create_scheduler, fake_step,
                                     replay_events)
from workers.contract.protocol import FinishReason
from workers.contract.prefix_cache import hash_prompt_blocks


def check_pool(scheduler) -> None:
    """Every block's reference count equals the number of live requests holding it; free blocks
    are exactly those with count 0; the cache map only names blocks carrying that hash."""
    kv = scheduler.kv
    pool = kv.pool
    holders = {b.block_id: 0 for b in pool.blocks}
    for rid in scheduler.requests:
        for block_id in kv.block_ids(rid):
            holders[block_id] += 1
        assert kv.block_ids(rid) == [b.block_id for b in kv._blocks.get(rid, ())]
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], block
    assert pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_cnt == 0)
    for block_hash, block in pool._cached.items():
        assert block.block_hash == block_hash
    # the counters `Engine.stats()` reads equal a scan of the queues
    queued = [*scheduler.waiting, *scheduler.running]
    assert scheduler.num_pending_prompt_tokens == sum(
        max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in queued)
    assert len(queued) + len(scheduler.waiting_for_kv) == len(scheduler.requests)


PROMPTS = st.lists(st.integers(1, 3), min_size=1, max_size=30)  # few ids: prefixes repeat
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), PROMPTS, st.integers(1, 12)),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 20)),
    st.tuples(st.just("handoff"), PROMPTS, st.integers(2, 12)),  # KV arriving from elsewhere
    st.tuples(st.just("land"), st.integers(0, 20)),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, caching=st.booleans())
def test_any_sequence_of_add_step_abort_finish_returns_every_block(ops, caching):
    scheduler = create_scheduler(num_blocks=12, block_size=4, max_num_seqs=3,
                                 max_num_batched_tokens=8, enable_caching=caching)
    added: list[str] = []
    for op in ops:
        if op[0] == "add":
            rid = f"r{len(added)}"
            scheduler.add(create_request(rid, op[1], max_tokens=op[2], ignore_eos=True))
            added.append(rid)
        elif op[0] == "handoff":
            rid = f"r{len(added)}"
            req = create_request(rid, op[1], max_tokens=op[2], ignore_eos=True)
            req.append_output(5)  # the first token, sampled by the prefill worker
            if scheduler.add_waiting_for_kv(req):
                added.append(rid)
        elif op[0] == "land":
            if scheduler.waiting_for_kv:
                waiting = list(scheduler.waiting_for_kv)
                scheduler.kv_landed(waiting[op[1] % len(waiting)])
        elif op[0] == "step":
            fake_step(scheduler, token=5)
        elif added:
            scheduler.finish(added[op[1] % len(added)], FinishReason.ABORT)
        check_pool(scheduler)
    for rid in list(scheduler.waiting_for_kv):
        scheduler.kv_landed(rid)
    for _ in range(500):  # everything left runs to completion (preempting as needed)
        if not scheduler.num_unfinished:
            break
        fake_step(scheduler, token=5)
        check_pool(scheduler)
    assert scheduler.num_unfinished == 0
    pool = scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    # the KV events describe exactly what the prefix cache holds, numbered without gaps
    events = scheduler.kv.events.drain()
    assert [e.seq for e in events] == list(range(len(events)))
    assert replay_events(events) == set(pool.cached_hashes())


def test_prefix_hit_computes_only_the_uncached_tokens():
    scheduler = create_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    shared = list(range(1, 13))  # three full blocks
    scheduler.add(create_request("a", shared + [20, 21], max_tokens=1))
    first = fake_step(scheduler)
    assert first.num_batched_tokens == 14
    scheduler.add(create_request("b", shared + [30, 31, 32], max_tokens=1))
    second = fake_step(scheduler)
    assert second.num_batched_tokens == 3  # 12 tokens came from the cache
    assert second.chunks[0].request.num_cached_tokens == 12


def test_cache_salt_isolates_tenants():
    scheduler = create_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    prompt = list(range(1, 10))
    scheduler.add(create_request("a", prompt, max_tokens=1))
    fake_step(scheduler)
    req = create_request("b", prompt, max_tokens=1)
    req.cache_salt = "tenant-b"
    scheduler.add(req)
    assert fake_step(scheduler).num_batched_tokens == 9


def test_whole_prompt_cached_still_computes_one_token():
    scheduler = create_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    prompt = list(range(1, 9))  # exactly two blocks
    scheduler.add(create_request("a", prompt, max_tokens=1))
    fake_step(scheduler)
    scheduler.add(create_request("b", prompt, max_tokens=1))
    out = fake_step(scheduler)
    # the last block is recomputed: a sequence must compute at least its last token
    assert out.num_batched_tokens == 4


def test_kv_events_name_hashes_the_router_can_compute():
    scheduler = create_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    prompt = list(range(1, 11))
    scheduler.add(create_request("a", prompt, max_tokens=1))
    fake_step(scheduler)
    events = scheduler.kv.events.drain()
    stored = [h for e in events for h in e.block_hashes]
    assert stored == hash_prompt_blocks(prompt, 4)
    assert events[0].epoch == scheduler.kv.events.epoch


def test_eviction_is_least_recently_used_and_reported():
    scheduler = create_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    scheduler.add(create_request("old", [1] * 8 + [2], max_tokens=1))
    fake_step(scheduler)
    scheduler.add(create_request("new", [3] * 8 + [4], max_tokens=1))
    fake_step(scheduler)
    events = scheduler.kv.events.drain()
    assert replay_events(events) == set(scheduler.kv.pool.cached_hashes())
    # the older prompt's blocks were evicted to make room; the newer prompt's are cached
    assert set(hash_prompt_blocks([3] * 8 + [4], 4)) <= set(scheduler.kv.pool.cached_hashes())


def test_preemption_frees_blocks_and_the_request_resumes():
    scheduler = create_scheduler(num_blocks=6, block_size=4, max_num_seqs=4,
                                 max_num_batched_tokens=64, enable_caching=False)
    for i in range(3):
        scheduler.add(create_request(f"r{i}", [1 + i] * 7, max_tokens=9, ignore_eos=True))
    preempted: list[str] = []
    for _ in range(100):
        if not scheduler.num_unfinished:
            break
        preempted += fake_step(scheduler).preempted
    assert preempted, "six blocks cannot hold three 16-token sequences at once"
    assert scheduler.num_unfinished == 0
    assert scheduler.kv.pool.num_free_blocks == 6


def test_prompt_logprob_rows_per_step_stay_within_the_profiled_bound():
    """Every prefill token of a prompt-logprobs request costs a row of vocabulary-sized logits:
    a step holds at most PROMPT_LOGPROB_TOKENS_PER_STEP of them, over every such request, while
    other requests still fill the token budget."""
    from workers.engine.scheduler import PROMPT_LOGPROB_TOKENS_PER_STEP as ROWS

    sched = create_scheduler(num_blocks=2048, block_size=16, max_num_seqs=8,
                             max_num_batched_tokens=4096, max_model_len=4096)
    for i in range(3):
        sched.add(create_request(f"lp{i}", [5 + i] * 700, max_tokens=2, prompt_logprobs=1))
    sched.add(create_request("plain", [9] * 900, max_tokens=2))
    for _ in range(12):
        out = fake_step(sched)
        rows = sum(c.num_tokens for c in out.chunks
                   if c.request.prompt_logprobs is not None and c.num_tokens > 1)
        assert rows <= ROWS
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished()  # every request got through, in more steps
