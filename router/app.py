"""The router core shared by the HTTP and gRPC front ends: tokenizer, workers, routing, limits.

One `Router` per process and event loop. It tokenizes (torch-free), hashes the prompt's full KV
blocks, asks the routing policy for a worker, submits the request through that worker's
`WorkerClient`, and keeps the prefix index fed from the workers' KV events (after every request
and from a background poll).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from router.errors import (
    AuthenticationError,
    BadRequestError,
    NotFoundError,
    OverloadedError,
    WorkerUnavailableError,
)
from router.metrics import RouterMetrics
from router.orchestrator import Generation, Orchestrator
from router.policy import WorkerLoad, get_policy
from router.prefix_index import PrefixIndex
from router.worker_client import WorkerClient, WorkerInfo, WorkerRequest, WorkerRole
from workers.protocol import SamplingParams
from workers.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 2.0


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
    retry_after_s: int = 1  # the Retry-After a 429 suggests
    kv_poll_interval_s: float = 0.5  # background poll of the workers' KV events
    # prefill on a decode worker when fewer prompt tokens than this are not in the cache
    disagg_threshold_tokens: int = 64
    prefill_retries: int = 2  # other prefill workers tried after a failed prefill
    # times a stream moves to another decode-pool worker after the one streaming it failed
    migration_retries: int = 2
    # how long a stream whose worker failed waits for a decode-pool worker to move to (a
    # cluster's pool replaces its lost replicas); 0: fail at once when none is healthy
    migration_wait_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("disagg_threshold_tokens", "prefill_retries", "migration_retries",
                     "migration_wait_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_in_flight", "max_body_bytes", "max_n", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.kv_poll_interval_s > 0:
            raise ValueError(f"kv_poll_interval_s must be > 0, got {self.kv_poll_interval_s}")
        if any(not key for key in self.api_keys):
            raise ValueError("api_keys must not contain empty strings")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_path).resolve().name


@dataclass
class RouterCounters:
    """Totals since start; tokens are prompt tokens."""

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
    # decode_worker_failed (a stream moved to another worker mid-way, once per move)
    fallbacks: dict[str, int] = field(default_factory=dict)
    first_tokens_by_worker: dict[str, int] = field(default_factory=dict)  # worker id -> requests
    decodes_by_worker: dict[str, int] = field(default_factory=dict)  # who streamed the rest


class Admission:
    """One admitted request's slot; `release()` is idempotent."""

    def __init__(self, router: Router) -> None:
        self._router: Router | None = router

    def release(self) -> None:
        if self._router is not None:
            self._router.in_flight -= 1
            self._router = None


class Router:
    def __init__(self, config: RouterConfig, clients: list[WorkerClient]) -> None:
        if not clients:
            raise ValueError("a router needs at least one worker client, got none")
        ids = [c.worker_id for c in clients]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker ids must be unique, got {ids}")
        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.model_path)
        self.clients = {c.worker_id: c for c in clients}
        self.policy = get_policy(config.policy, **dict(config.policy_options))
        self.index = PrefixIndex()
        self.counters = RouterCounters()
        self.metrics = RouterMetrics(self)
        self.orchestrator = Orchestrator(self)
        self.in_flight = 0
        self._healthy = {wid: True for wid in self.clients}
        self.draining: set[str] = set()  # workers routed no new requests (being removed)
        self._infos: dict[str, WorkerInfo] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # one poll per worker at a time, so its events are applied in the order they were drained
        self._poll_locks = {wid: asyncio.Lock() for wid in self.clients}
        self._poller: asyncio.Task[None] | None = None
        self.created = int(time.time())

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Read the workers' descriptions, seed the prefix index, start the KV poller."""
        infos = await asyncio.gather(*(c.info() for c in self.clients.values()))
        self._infos = {i.worker_id: i for i in infos}
        shapes = {(i.block_size, i.max_model_len, i.vocab_size) for i in infos}
        if len(shapes) != 1:
            raise ValueError(f"workers disagree on (block_size, max_model_len, vocab_size): "
                             f"{sorted(shapes)}; expected one model served one way")
        for wid in self.clients:
            await self._resync(wid)
        self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def stop(self) -> None:
        tasks = [t for t in (self._poller, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._poller = None

    @property
    def _info(self) -> WorkerInfo:
        if not self._infos:
            raise RuntimeError("Router.start() has not run")
        return next(iter(self._infos.values()))

    @property
    def max_model_len(self) -> int:
        return self._info.max_model_len

    @property
    def block_size(self) -> int:
        return self._info.block_size

    @property
    def model_name(self) -> str:
        return self.config.model_name

    # ---- checks the front ends share -------------------------------------------------------

    def authenticate(self, token: str | None) -> None:
        """Raise `AuthenticationError` unless `token` is one of the API keys (when any are set)."""
        if not self.config.api_keys:
            return
        given = (token or "").encode()
        ok = False
        for key in self.config.api_keys:  # every key compared, in constant time
            ok |= hmac.compare_digest(given, key.encode())
        if not ok:
            raise AuthenticationError("Incorrect API key provided; send it as "
                                      "'Authorization: Bearer <key>'")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise NotFoundError(f"The model `{name}` does not exist; this server serves "
                                f"`{self.model_name}`", param="model")

    def admit(self) -> Admission:
        """Take one of `max_in_flight` slots, or raise 429. Release it when the request ends."""
        if self.in_flight >= self.config.max_in_flight:
            raise OverloadedError(
                f"The server is overloaded: {self.in_flight} requests in flight, the limit is "
                f"{self.config.max_in_flight}; retry later",
                headers={"Retry-After": str(self.config.retry_after_s)})
        self.in_flight += 1
        return Admission(self)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def check_prompt(self, ids: list[int], param: str = "prompt") -> None:
        vocab = self._info.vocab_size
        if not ids:
            raise BadRequestError("the prompt must not be empty", param=param)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequestError(f"the prompt contains token ids outside [0, {vocab}): "
                                  f"{bad[:5]}", param=param)
        if len(ids) >= self.max_model_len:
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {len(ids)} tokens, which leaves no room for a completion.",
                param=param)

    def check_n(self, n: int) -> None:
        if not 1 <= n <= self.config.max_n:
            raise BadRequestError(f"n must be in [1, {self.config.max_n}], got {n}", param="n")

    # ---- generation ------------------------------------------------------------------------

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       cache_salt: str | None = None,
                       request_id: str | None = None, frontend: str = "other") -> Generation:
        """Route and submit a request (aggregated or split between a prefill and a decode
        worker: `router.orchestrator`); returns once its first token arrived. Raises
        `BadRequestError` (a worker refused it) or `NoHealthyWorkerError`. `frontend` (http,
        grpc) labels its metrics; errors raised here are for the caller to count
        (`metrics.count_error`)."""
        started = time.monotonic()
        rid = request_id or f"cmpl-{uuid.uuid4().hex}"
        req = WorkerRequest(rid, tuple(prompt_token_ids), params, cache_salt)
        gen = await self.orchestrator.generate(req)
        gen.record = self.metrics.record(gen, started, frontend)
        return gen

    def pool(self, *roles: WorkerRole) -> list[str]:
        """Ids of the workers serving one of `roles` (healthy or not)."""
        return [wid for wid, info in self._infos.items() if info.role in roles]

    async def _loads(self) -> list[WorkerLoad]:
        async def load(wid: str, client: WorkerClient) -> WorkerLoad:
            try:
                s = await asyncio.wait_for(client.stats(), STATS_TIMEOUT_S)
            except (WorkerUnavailableError, asyncio.TimeoutError) as exc:
                logger.warning("worker %s gave no stats: %s", wid, exc)
                self._healthy[wid] = False
                return WorkerLoad(wid, 0, 0, 1.0, healthy=False)
            self._healthy[wid] = True
            # a draining worker finishes what it holds but takes nothing new
            return WorkerLoad(wid, s.num_waiting, s.num_running, s.kv_usage,
                              healthy=wid not in self.draining)

        clients = list(self.clients.items())  # the set may change while we wait
        return list(await asyncio.gather(*(load(w, c) for w, c in clients)))

    async def loads(self) -> list[WorkerLoad]:
        """Every worker's load, asked now (draining and unreachable ones marked unhealthy)."""
        return await self._loads()

    @property
    def worker_infos(self) -> dict[str, WorkerInfo]:
        """What each routed worker serves, by id."""
        return dict(self._infos)

    def healthy_workers(self) -> list[str]:
        return [wid for wid, ok in self._healthy.items() if ok and wid not in self.draining]

    # ---- membership (a cluster's pools grow, shrink and restart) ----------------------------

    async def add_worker(self, client: WorkerClient) -> None:
        """Start routing to a new worker: read its description, seed the index from its
        snapshot. Raises `ValueError` when it serves the model differently from the others."""
        wid = client.worker_id
        if wid in self.clients:
            raise ValueError(f"worker {wid!r} is already routed to")
        info = await client.info()
        if self._infos:
            mine = (self.block_size, self.max_model_len, self._info.vocab_size)
            theirs = (info.block_size, info.max_model_len, info.vocab_size)
            if theirs != mine:
                raise ValueError(f"worker {wid!r} serves (block_size, max_model_len, "
                                 f"vocab_size)={theirs}; the others serve {mine}")
        self.clients[wid] = client
        self._infos[wid] = info
        self._healthy[wid] = True
        self._poll_locks[wid] = asyncio.Lock()
        await self._resync(wid)

    async def remove_worker(self, worker_id: str) -> None:
        """Stop routing to a worker that is gone; streams it still serves fail over as a
        failed worker's would. Closes its client."""
        client = self.clients.pop(worker_id, None)
        if client is None:
            return
        self._infos.pop(worker_id, None)
        self._healthy.pop(worker_id, None)
        self._poll_locks.pop(worker_id, None)
        self.draining.discard(worker_id)
        self.index.remove_worker(worker_id)
        await client.close()

    async def check_health(self) -> list[str]:
        """Ask every worker; returns the healthy ones' ids."""
        async def ask(wid: str, client: WorkerClient) -> None:
            try:
                self._healthy[wid] = await asyncio.wait_for(client.health(), STATS_TIMEOUT_S)
            except (WorkerUnavailableError, asyncio.TimeoutError):
                self._healthy[wid] = False

        await asyncio.gather(*(ask(w, c) for w, c in list(self.clients.items())))
        return self.healthy_workers()

    # ---- the prefix index ------------------------------------------------------------------

    def _after_request(self, worker_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._poll_worker(worker_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _poll_worker(self, worker_id: str) -> None:
        client = self.clients.get(worker_id)
        if client is None:  # removed meanwhile
            return
        try:
            async with self._poll_locks[worker_id]:
                self.index.apply(worker_id, await client.kv_events())
                if self.index.needs_resync(worker_id):
                    await self._resync(worker_id)
        except WorkerUnavailableError as exc:
            logger.warning("dropping worker %s from the prefix index: %s", worker_id, exc)
            self._healthy[worker_id] = False
            self.index.remove_worker(worker_id)

    async def _resync(self, worker_id: str) -> None:
        self.index.resync(worker_id, await self.clients[worker_id].kv_snapshot())

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.kv_poll_interval_s)
            for wid in list(self.clients):
                try:
                    await self._poll_worker(wid)
                except Exception:  # the poller must outlive one bad poll
                    logger.exception("polling the KV events of worker %s failed", wid)
