"""Request types shared by the engine, the router and the transfer layer. No torch here.

Everything that crosses a process or package boundary is one of these typed records: sampling
parameters in, token events out, and the errors a request can end with. What the router learns
of a worker's prefix cache (block hashes, KV events, snapshots) is `workers.contract.prefix_cache`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

# re-exported: every layer's refusal, and the errors a request can end with on a worker
from workers.contract.errors import EngineOverloaded as EngineOverloaded
from workers.contract.errors import EngineShutDown as EngineShutDown
from workers.contract.errors import InvalidRequestError
from workers.contract.errors import KVCacheFull as KVCacheFull
from workers.contract.errors import KVPullFailed as KVPullFailed

if TYPE_CHECKING:
    from workers.contract.structured_output import StructuredOutput


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{param} {message}", param=param)


# bounds on the per-token stop checks a request may ask for (every step scans them)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries of a request's logit_bias


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Validated on construction (`InvalidRequestError`).

    `top_k` of 0 or -1 (vLLM's spellings) means "all tokens", stored as None.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # the output text's grammar (`workers.contract.structured_output`); None: free text
    structured: StructuredOutput | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # Cleave's extension: False decodes this request without speculation on a server that
    # speculates (`workers.engine.speculative`)
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k in (0, -1):
            self.top_k = None
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k is None or self.top_k >= 1, "top_k",
               f"must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
               f"must be in [0, 20], got {self.logprobs}")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
               "prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")
        _check(self.seed is None or -(1 << 63) <= self.seed < 1 << 63, "seed",
               f"must be a 64-bit signed integer, got {self.seed}")
        _check(all(s for s in self.stop), "stop", "must not contain empty strings")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop",
               f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        _check(all(len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
               f"each stop string at most {MAX_STOP_CHARS} characters")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               f"must be non-negative token ids, got {self.stop_token_ids}")
        if self.logit_bias is not None:
            bias = self.logit_bias
            _check(len(bias) <= MAX_LOGIT_BIAS, "logit_bias",
                   f"at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
            _check(all(isinstance(t, int) and t >= 0 for t in bias), "logit_bias",
                   f"keys must be non-negative token ids, got {list(bias)[:5]}")
            bad = {t: v for t, v in bias.items() if not -100.0 <= v <= 100.0}
            _check(not bad, "logit_bias", f"values must be in [-100, 100], got {bad}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller


@dataclass(frozen=True)
class WorkerRequest:
    """One request as every layer below the router's front ends passes it, whole: built once by
    the router (tokenized, validated) and handed unchanged to the orchestrator, the worker
    client, the engine actor, the worker, the async engine and the engine."""

    request_id: str  # made by the router, unique per request: the engine, lease and block key
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str | None = None  # isolates this request's prefix-cache blocks
    lora_name: str | None = None  # the LoRA adapter it runs under (its served name); None: base
    # the W3C trace context its spans continue (`workers.contract.tracing`; None: untraced)
    traceparent: str | None = None
    # its own TTFT target (the `x-slo-ttft-ms` header), seconds from its arrival at a worker:
    # the engine's waiting queue puts it ahead of requests due later or never
    # (`workers.engine.waiting_order`); None: none, queued first come first served
    ttft_deadline_s: float | None = None


class WorkerRole(str, enum.Enum):
    """What a worker does with a request."""

    BOTH = "both"  # prefill and decode on the same worker (aggregated); may do either half
    PREFILL = "prefill"  # prompts to their first token, then hands the KV off
    DECODE = "decode"  # continues handed-off requests; also runs whole short ones


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker serves; fixed for its lifetime."""

    worker_id: str
    role: WorkerRole
    block_size: int  # tokens per KV block (the router hashes prompts in blocks of this size)
    max_model_len: int  # tokens per sequence, prompt and output together
    vocab_size: int  # token ids must be in [0, vocab_size)
    num_blocks: int  # KV blocks in the worker's cache
    tp_size: int = 1  # tensor-parallel ranks, each holding its share of the KV heads
    kv_bytes_per_block: int = 0  # one block of KV, all layers and ranks (what a pull moves)


@dataclass(frozen=True)
class EngineStats:
    """A worker's load, computed by the engine on its step thread (after each step): other
    threads and processes read a published copy, never the scheduler's live queues."""

    num_waiting: int  # requests queued, not yet scheduled
    num_running: int  # requests being prefilled or decoded
    kv_usage: float  # fraction of KV blocks held by requests, in [0, 1]
    num_free_blocks: int  # KV blocks not held by any request (cached ones included)
    num_cached_blocks: int  # blocks findable in the prefix cache (held or free)
    num_blocks: int  # KV blocks in the cache
    num_waiting_for_kv: int = 0  # handed-off requests whose KV is still arriving
    num_pending_prompt_tokens: int = 0  # prompt tokens queued or mid-prefill
    # a prefix hit in the host tier, as a fraction of recomputing the block (measured:
    # workers.engine.step_costs); 0.0 without a host tier
    host_hit_cost: float = 0.0
    prefill_s_per_token: float = 0.0  # measured on prefill steps (0.0: not yet)
    kv_pull_bytes_per_s: float = 0.0  # the worker's KV pulls, measured (0.0: none yet)
    # a prefix fetch's cost beyond its bytes at that rate (reserving, landing, the steps it
    # waits for), in seconds, measured (0.0: none yet)
    kv_fetch_fixed_s: float = 0.0
    # prefix-cache hits lately, in blocks, decayed (`workers.engine.kv_cache.hot_prefixes`): what
    # the cache is worth now; a scale-down removes the worker where it is least
    recent_hit_blocks: float = 0.0
    # since start: prompt tokens computed (not served from a cache or pulled; replayed
    # context included), a counter
    num_prompt_tokens_computed: int = 0
    # speculative decoding: the server's method (None: none), and since start the drafted
    # tokens verified, those accepted, and the drafts verified (one a request a step), counters
    speculative_method: str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_drafts: int = 0
    lora_adapters: tuple[str, ...] = ()  # LoRA adapters in its device slots, least recent first
    num_lora_loads: int = 0  # since start: adapters copied into a device slot, a counter
    # False: a step past its watchdog bound or a lost rank (`AsyncEngine.unhealthy_reason`):
    # the router routes nothing new there and moves the streams on it
    healthy: bool = True
    # prompt tokens a request with a deadline arriving now would wait behind (the waiting
    # queue's order puts it ahead of those without); None: all pending ones (fcfs)
    num_due_prompt_tokens: int | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one chosen token and its top alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass(frozen=True)
class TokenEvent:
    """New tokens for one sample (`index` of n) of a request, as the async engine yields them."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str  # detokenized text added by these tokens (stop strings removed)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # on a request's first event, when prompt logprobs were asked for (None for the first token)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # speculative decoding: this sample's drafted tokens verified so far, and of those accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def replaced(self, **changes: Any) -> TokenEvent:
        """This event with `changes`, as `dataclasses.replace` makes it but without running
        `__init__` (the router copies an event or two per streamed token: 0.75 us against
        3)."""
        if not changes.keys() <= _TOKEN_EVENT_FIELDS:
            unknown = sorted(changes.keys() - _TOKEN_EVENT_FIELDS)
            raise TypeError(f"TokenEvent has no field {unknown}")
        event = object.__new__(TokenEvent)
        event.__dict__.update(self.__dict__, **changes)
        return event


_TOKEN_EVENT_FIELDS = frozenset(f.name for f in fields(TokenEvent))


@dataclass
class CompletionOutput:
    """One finished (or in-progress) sample of a request, as the offline API returns it."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprob | None] | None = None  # None for the first prompt token
    num_cached_tokens: int = 0
