"""The router's settings (`cluster.settings` translates the cluster config into them)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Deadlines:
    """How long the router waits on a worker (`RouterConfig`'s `prefill_timeout_s` and
    `stall_timeout_s`): a prefill not answered in time is aborted there and raised as
    `WorkerUnavailableError`; a channel silent for `stall_s` past its heartbeat, or whose
    worker reports itself unhealthy (a stalled step, a dead rank), fails its streams the same
    way, so they move to other workers."""

    prefill_s: float = 300.0
    stall_s: float = 15.0


# the tool-call formats `router.openai.tool_parsers` reads (vLLM's --tool-call-parser names)
TOOL_CALL_PARSERS = ("llama3_json", "hermes", "mistral")


@dataclass(frozen=True)
class RouterConfig:
    model_path: str
    served_model_name: str | None = None  # default: the model folder's name
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    policy: str = "prefix_aware"
    policy_options: tuple[tuple[str, float], ...] = ()  # (name, value): the policy's weights
    max_in_flight: int = 256  # requests admitted at once; more get 429
    max_body_bytes: int = 16 * 1024**2  # larger HTTP bodies get 413
    max_n: int = 16  # samples per request at most
    max_prompts_per_request: int = 64  # a completions body's prompts at most (each takes a slot)
    retry_after_s: int = 1  # the Retry-After a 429 suggests
    kv_poll_interval_s: float = 0.5  # background poll of the workers' KV events
    # "hand off or run here" (`router.split_policy`): uncached_threshold (hand off when at
    # least disagg_threshold_tokens of the prompt are not cached), always, or never
    disagg_policy: str = "uncached_threshold"
    # prefill on a decode worker when fewer prompt tokens than this are not in the cache
    disagg_threshold_tokens: int = 64
    # which decode worker takes a handoff (`router.decode_policy`): a routing policy's name
    # (least_loaded, round_robin, prefix_aware); each pick counts against its worker at once
    decode_policy: str = "least_loaded"
    prefill_retries: int = 2  # other prefill workers tried after a failed prefill
    # times a stream moves to another decode-pool worker after the one streaming it failed
    migration_retries: int = 2
    # how long a stream whose worker failed waits for a decode-pool worker to move to (a
    # cluster's pool replaces its lost replicas); 0: fail at once when none is healthy
    migration_wait_s: float = 0.0
    # other workers tried when an aggregated request's worker fails before its first token
    start_retries: int = 2
    # admission: a worker with this many requests, or prompt tokens, waiting takes no more;
    # when every healthy worker of the pool is that full, requests get 429 with Retry-After
    max_waiting_per_worker: int = 256
    max_pending_tokens_per_worker: int = 1 << 20
    prefill_timeout_s: float = 300.0  # a prefill not answered by then is retried elsewhere
    # a worker whose output channel says nothing for this long (it answers every 0.5 s when
    # idle) is unhealthy, and the streams on it move to other workers
    stall_timeout_s: float = 15.0
    # how the model writes tool calls (TOOL_CALL_PARSERS); None: as its chat template says
    tool_call_parser: str | None = None
    # a decode-pool worker at this KV usage (0..1] moves a running stream, with its KV, to a
    # worker with room each kv_poll_interval_s (`router.rebalance`); None: streams stay put
    rebalance_kv_usage: float | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got "
                             f"{self.tool_call_parser!r}")
        for name in ("disagg_threshold_tokens", "prefill_retries", "migration_retries",
                     "migration_wait_s", "start_retries"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_in_flight", "max_body_bytes", "max_n", "retry_after_s",
                     "max_prompts_per_request",
                     "max_waiting_per_worker", "max_pending_tokens_per_worker"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("prefill_timeout_s", "stall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.kv_poll_interval_s > 0:
            raise ValueError(f"kv_poll_interval_s must be > 0, got {self.kv_poll_interval_s}")
        if self.rebalance_kv_usage is not None and not 0 < self.rebalance_kv_usage <= 1:
            raise ValueError(f"rebalance_kv_usage must be in (0, 1], got "
                             f"{self.rebalance_kv_usage}")
        if any(not key for key in self.api_keys):
            raise ValueError("api_keys must not contain empty strings")

    @property
    def deadlines(self) -> Deadlines:
        """What each channel client waits on its worker."""
        return Deadlines(self.prefill_timeout_s, self.stall_timeout_s)

    @functools.cached_property
    def model_name(self) -> str:  # resolved once: every request reads it
        return self.served_model_name or Path(self.model_path).resolve().name
