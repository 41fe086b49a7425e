"""The router's routing counters (totals since start). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RouterCounters:
    """Totals since start; tokens are prompt tokens. Written by `router.orchestrator`, read by
    the metrics and `cleave status`."""

    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_predicted_cached_tokens: int = 0  # what the prefix index promised at routing time
    num_cached_tokens: int = 0  # what the workers reported serving from their prefix caches
    num_disaggregated: int = 0  # requests whose first token came from a prefill worker
    # requests of a deployment with prefill workers that ran on one worker, by why:
    # short_prompt, unsupported_params, no_prefill_worker, prefill_failed
    aggregated: dict[str, int] = field(default_factory=dict)
    # failures worked around, by reason: prefill_error (one attempt, retried elsewhere),
    # prefill_failed (every attempt), no_prefill_worker, kv_pull_failed (decode prefilled),
    # decode_worker_failed (a stream moved to another worker mid-way, once per move),
    # start_failed (an aggregated request's worker failed before its first token: retried),
    # hand_off_failed (a leaving worker's prefix did not move: a lost hit only)
    fallbacks: dict[str, int] = field(default_factory=dict)
    num_refused_overloaded: int = 0  # 429s because every worker's queue was full
    num_refused_deadline: int = 0  # 429s: no worker could meet the request's own TTFT target
    first_tokens_by_worker: dict[str, int] = field(default_factory=dict)  # worker id -> requests
    decodes_by_worker: dict[str, int] = field(default_factory=dict)  # who streamed the rest
    # prefix fetches (a request's worker pulled its prompt's leading blocks from another's
    # cache): requests that did, the blocks offered them, how many of those the requests found
    # beyond their worker's own, and the seconds of prefill the pulls were predicted to save
    num_prefix_fetches: int = 0
    prefix_fetch_blocks: int = 0
    prefix_fetch_blocks_hit: int = 0
    prefix_fetch_predicted_saved_s: float = 0.0
    # live migrations (a running stream moved with its KV: a drain): done, and not done (it
    # stayed on its worker, or had to recompute there)
    num_live_migrations: int = 0
    num_live_migrations_failed: int = 0
    num_rebalanced: int = 0  # of those, moved off a worker whose KV cache was nearly full
    # a leaving worker's hot prefixes pulled by the workers that stay (`router.hand_off`)
    num_hand_off_prefixes: int = 0
    hand_off_blocks: int = 0

    def count_fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def count_aggregated(self, reason: str) -> None:
        self.aggregated[reason] = self.aggregated.get(reason, 0) + 1

    def count_decode(self, worker_id: str) -> None:
        self.decodes_by_worker[worker_id] = self.decodes_by_worker.get(worker_id, 0) + 1
