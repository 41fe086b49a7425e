"""The engine's load and counters as one `EngineStats` record, read from the scheduler's, the
block pool's, the step costs' and the speculator's own counters (O(1), no scan)."""

from __future__ import annotations

from workers.contract.protocol import EngineStats
from workers.engine.kv_cache import KVCacheManager
from workers.engine.scheduler import Scheduler
from workers.engine.step_costs import StepCosts
from workers.engine.waiting_order import prompt_tokens_before_due


def engine_stats(sched: Scheduler, kv: KVCacheManager, costs: StepCosts,
                 speculative_method: str | None, kv_pull_bytes_per_s: float,
                 kv_fetch_fixed_s: float, lora_adapters: tuple[str, ...] = (),
                 num_lora_loads: int = 0) -> EngineStats:
    """An engine's stats now; call on its step thread, between steps. The two rates are the
    worker's transfer layer's measures, which the engine keeps; `lora_adapters`, those in its
    device slots, and `num_lora_loads` the copies into them since start."""
    pool = kv.pool
    return EngineStats(len(sched.waiting), len(sched.running), pool.usage,
                       pool.num_free_blocks, pool.num_cached_blocks, pool.num_blocks,
                       len(sched.waiting_for_kv), sched.num_pending_prompt_tokens,
                       costs.host_hit_cost if kv.host is not None else 0.0,
                       costs.prefill_s_per_token or 0.0, kv_pull_bytes_per_s,
                       kv_fetch_fixed_s=kv_fetch_fixed_s,
                       recent_hit_blocks=kv.hot.recent_hit_blocks(),
                       num_prompt_tokens_computed=costs.num_prompt_tokens_computed,
                       speculative_method=speculative_method,
                       num_draft_tokens=sched.drafts.num_draft_tokens,
                       num_accepted_tokens=sched.drafts.num_accepted_tokens,
                       num_drafts=sched.drafts.num_drafts,
                       lora_adapters=lora_adapters, num_lora_loads=num_lora_loads,
                       num_due_prompt_tokens=(prompt_tokens_before_due(sched.running, sched.waiting)
                                              if sched.config.order_by_deadline else None))
