"""The engine's load and counters as one `EngineStats` record, read from the scheduler's, the
block pool's, the step costs' and the speculator's own counters (O(1), no scan)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.contract.protocol import EngineStats

if TYPE_CHECKING:
    from workers.engine.core import Engine


def engine_stats(engine: Engine) -> EngineStats:
    """`engine`'s stats now; call on its step thread, between steps."""
    sched, kv, costs = engine.scheduler, engine.kv, engine.costs
    pool = kv.pool
    return EngineStats(len(sched.waiting), len(sched.running), pool.usage,
                       pool.num_free_blocks, pool.num_cached_blocks, pool.num_blocks,
                       len(sched.waiting_for_kv), sched.num_pending_prompt_tokens,
                       costs.host_hit_cost if kv.host is not None else 0.0,
                       costs.prefill_s_per_token or 0.0, engine.kv_pull_bytes_per_s,
                       kv_fetch_fixed_s=engine.kv_fetch_fixed_s,
                       recent_hit_blocks=kv.hot.recent_hit_blocks(),
                       num_prompt_tokens_computed=costs.num_prompt_tokens_computed,
                       speculative_method=engine.speculator.method,
                       num_draft_tokens=sched.num_draft_tokens,
                       num_accepted_tokens=sched.num_accepted_tokens)
