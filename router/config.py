"""The router's settings, each defined once (`workers.contract.setting`): the cluster config,
the `cleave serve` flags and the chart's schema are derived from these fields
(`cluster.config`), and `cluster.settings` builds a `RouterConfig` from a cluster config."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from router.policy import LORA_LOAD_BLOCKS
from workers.contract.setting import check_settings, setting


@dataclass(frozen=True)
class Deadlines:
    """How long the router waits on a worker (`RouterConfig`'s `prefill_timeout_s` and
    `stall_timeout_s`): a prefill not answered in time is aborted there and raised as
    `WorkerUnavailableError`; a channel silent for `stall_s` past its heartbeat, or whose
    worker reports itself unhealthy (a stalled step, a dead rank), fails its streams the same
    way, so they move to other workers."""

    prefill_s: float = 300.0
    stall_s: float = 15.0


DEFAULT_DEADLINES = Deadlines()  # the clients' default (a frozen record, shared safely)

# the tool-call formats `router.openai.tool_parsers` reads (vLLM's --tool-call-parser names)
TOOL_CALL_PARSERS = ("llama3_json", "hermes", "mistral", "gpt_oss")
# the reasoning formats `router.openai.reasoning` reads (vLLM's --reasoning-parser names)
REASONING_PARSERS = ("deepseek_r1", "qwen3", "gpt_oss")
POLICIES = ("prefix_aware", "least_loaded", "round_robin")  # `router.policy`'s names
# "hand off or run here" (`router.split_policy`'s names)
SPLIT_POLICIES = ("uncached_threshold", "always", "never")


@dataclass(frozen=True)
class RouterConfig:
    model_path: str = setting(description="The model folder the router reads its tokenizer "
                                          "from.", section=None)
    served_model_name: str | None = setting(None, (
        "The name clients pass as `model`; default: the model folder's name."), section="model")
    api_keys: tuple[str, ...] = setting((), (
        "Accepted bearer keys (cleave serve: --api-key, repeatable, or CLEAVE_API_KEYS=a,b); "
        "empty and no api_keys_env: no authentication."), flag=("--api-key",))
    policy: str = setting("prefix_aware", "How a worker is chosen for a prompt.",
                          choices=POLICIES)
    policy_options: tuple[tuple[str, float], ...] = setting((), (
        "prefix_aware: w_hit, w_queue, w_kv, queue_scale."), key="policy_weights", flag=None)
    max_in_flight: int = setting(256, "Requests per router replica; more: 429.", ge=1)
    max_body_bytes: int = setting(16 * 1024**2, "Larger HTTP bodies get 413.", ge=1)
    http_keep_alive_s: int = setting(75, (
        "Seconds an idle HTTP connection stays open. Longer than clients' and load balancers' "
        "own (aiohttp 15, httpx 5, a cloud load balancer's 60), so the client closes first: a "
        "request sent on a connection the server is closing fails (uvicorn's default 5 s "
        "raced aiohttp's pool)."), ge=1)
    max_n: int = setting(16, "Samples per request at most.", ge=1)
    max_prompts_per_request: int = setting(64, (
        "Prompts in one completions body at most (each takes an admission slot)."), ge=1)
    retry_after_s: int = setting(1, "The Retry-After (seconds) a 429 suggests.", ge=1)
    kv_poll_interval_s: float = setting(0.5, (
        "How often the router re-checks its workers' health, KV events and the directory."),
        gt=0)
    disagg_policy: str = setting("uncached_threshold", (
        "Hand off or run here (`router.split_policy`): uncached_threshold hands a prompt to the "
        "prefill pool when at least disagg_threshold_tokens of it are not cached; always; "
        "never."), choices=SPLIT_POLICIES)
    disagg_threshold_tokens: int = setting(64, (
        "Prompts with fewer uncached tokens than this prefill on the decode worker."), ge=0)
    lora_load_cost_blocks: float = setting(LORA_LOAD_BLOCKS, (
        "What a worker that would have to load a request's LoRA adapter into a device slot "
        "(it is not among those its engine last reported, nor routed there since) pays in the "
        "prefix_aware score (routing and decode_policy), in KV blocks of prompt recomputed and "
        "at most the whole prompt: requests for an adapter go where it is held unless another "
        "worker is lighter by more than this; 0: adapters do not steer routing."), ge=0)
    decode_policy: str = setting("least_loaded", (
        "Which decode worker takes a handoff (`router.decode_policy`): a routing policy's name; "
        "each pick counts against its worker at once."), choices=POLICIES)
    prefill_retries: int = setting(2, "Other prefill workers tried after a failed prefill.",
                                   ge=0)
    migration_retries: int = setting(2, (
        "Times a stream moves to another decode-pool worker after the one streaming it "
        "failed."), ge=0)
    migration_wait_s: float = setting(0.0, (
        "A stream whose decode worker died waits this long for another one before it fails "
        "(0: fail at once when none is healthy)."), ge=0)
    start_retries: int = setting(2, (
        "Other workers an aggregated request is started on when its worker fails or refuses "
        "it before the first token."), ge=0)
    max_waiting_per_worker: int = setting(256, (
        "Admission: requests waiting on a worker at most; when every healthy worker of the "
        "pool has this many, a request gets 429 with Retry-After."), ge=1)
    max_pending_tokens_per_worker: int = setting(1 << 20, (
        "Admission: prompt tokens waiting on a worker at most (same rule)."), ge=1)
    prefill_timeout_s: float = setting(300.0, (
        "A prefill not answered in this time is aborted and retried on another worker."), gt=0)
    stall_timeout_s: float = setting(15.0, (
        "A worker whose output channel is silent this long (it answers every 0.5 s when idle) "
        "is unhealthy; the streams on it move to other workers."), gt=0)
    tool_call_parser: str | None = setting(None, (
        "How the model writes tool calls (vLLM's --tool-call-parser names); unset: the format "
        "its chat template's wording shows, and none when it renders no tools."),
        choices=TOOL_CALL_PARSERS)
    reasoning_parser: str | None = setting(None, (
        "How the model writes its reasoning (vLLM's --reasoning-parser names): the text in "
        "its <think> block (gpt_oss: its analysis channel) is returned apart from the answer "
        "(chat: reasoning_content; Responses: a reasoning item), tool calls are read and "
        "structured output applies after it; unset: all output is the answer."),
        choices=REASONING_PARSERS)
    response_store_size: int = setting(1024, (
        "Responses (/v1/responses with store) each router replica keeps for "
        "previous_response_id and GET /v1/responses/{id}; the oldest are dropped past this."),
        ge=0)
    rebalance_kv_usage: float | None = setting(None, (
        "A decode-pool worker whose KV usage reaches this fraction moves its longest running "
        "stream, with its KV (nothing recomputed), to the least used worker at least 0.2 below "
        "it, every kv_poll_interval_s. Unset: running streams stay where they started."),
        gt=0, le=1)
    slo_ttft_ms: float | None = setting(None, (
        "Time-to-first-token target, milliseconds, at slo_percentile: with slo_itl_ms, what the "
        "SLO planner (router.planner) sizes the prefill and decode pools and the disaggregation "
        "threshold for. Unset: no planner."), gt=0)
    slo_itl_ms: float | None = setting(None, (
        "Inter-token latency target, milliseconds, at slo_percentile (the planner's second "
        "target; the planner runs when both are set)."), gt=0)
    slo_percentile: float = setting(0.9, "The fraction of requests the SLO targets bound "
                                         "(0.9: p90).", gt=0, le=0.999)

    def __post_init__(self) -> None:
        check_settings(self)
        if any(not key for key in self.api_keys):
            raise ValueError("api_keys must not contain empty strings")

    @property
    def deadlines(self) -> Deadlines:
        """What each channel client waits on its worker."""
        return Deadlines(self.prefill_timeout_s, self.stall_timeout_s)

    @functools.cached_property
    def model_name(self) -> str:  # resolved once: every request reads it
        return self.served_model_name or Path(self.model_path).resolve().name
