"""The router core shared by the HTTP and gRPC front ends: tokenizer, workers, routing, limits.

One `Router` per process and event loop. It tokenizes (torch-free), checks the request, makes
its id, and hands one `WorkerRequest` to the `Orchestrator`, which routes it over the
`WorkerSet` (membership, health, loads and the prefix index, all pushed by the workers'
channels). The parts take narrow interfaces: none reads another's private fields."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid

from router.adapters import ServedAdapters
from router.config import RouterConfig
from router.counters import RouterCounters
from router.embedder import Embedder
from router.errors import AuthenticationError, BadRequestError, NotFoundError, OverloadedError
from router.failover import Failover
from router.generations import GenerationFactory
from router.hand_off import coldest, hand_off
from router.live_migration import LiveMigrations
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.policies import Policies
from router.policy import WorkerLoad
from router.rebalance import rebalance
from router.role_plan import RoleSwitch
from router.role_switch import switch_role
from router.slo_control import SloControl
from router.stream_trace import StreamSpan
from router.streams import Generation
from router.worker_client import WorkerClient, WorkerInfo, WorkerRequest, WorkerRole
from router.workers import WorkerSet
from workers.contract.calls import Embeddings
from workers.contract.protocol import SamplingParams
from workers.contract.tracing import tracing
from workers.tokenizer import Tokenizer

__all__ = ["Admission", "Generation", "Router", "RouterConfig", "RouterCounters"]

logger = logging.getLogger(__name__)

TOKENIZE_INLINE_CHARS = 4096  # shorter texts are tokenized on the event loop (~0.1 ms)


class Admission:
    """One admitted request's slots (one per prompt it carries), held while a `with` block
    runs (its one owner); `release()` is idempotent."""

    def __init__(self, router: Router, slots: int = 1) -> None:
        self._router: Router | None = router
        self.slots = slots

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        if self._router is not None:
            self._router.in_flight -= self.slots
            self._router = None


class Router:
    def __init__(self, config: RouterConfig, clients: list[WorkerClient]) -> None:
        if not clients:
            raise ValueError("a router needs at least one worker client, got none")
        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.model_path)
        self.workers = WorkerSet(clients)
        policies = Policies.from_config(config)
        self.counters = RouterCounters()
        self.in_flight = 0
        self.metrics = RouterMetrics(self.workers, self.counters, lambda: self.in_flight)
        self.migrations = LiveMigrations(self.workers, self.counters)
        generations = GenerationFactory(
            Failover(self.workers, policies.route, self.counters, self.metrics, config),
            metrics=self.metrics, tracker=self.migrations,
            migration_retries=config.migration_retries, tokenizer=self.tokenizer)
        self.adapters = ServedAdapters(self.workers, config.model_name)  # LoRA, by name
        self.orchestrator = Orchestrator(self.workers, config, policies, self.counters, generations,
                                         self.adapters.supply)
        self.embedder = Embedder(self.workers, policies.route, config.start_retries)
        self.created = int(time.time())
        self._checker: asyncio.Task[None] | None = None
        self._planner: asyncio.Task[None] | None = None
        self.slo: SloControl | None = None  # the SLO planner, with both targets set
        if config.slo_ttft_ms is not None and config.slo_itl_ms is not None:
            self.slo = SloControl(config, self.workers, self.migrations, self.metrics.registry)
            self.workers.observers.append(self.slo.observe)

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Read the workers' descriptions, seed the prefix index, listen to their channels,
        and every `kv_poll_interval_s` re-check unreachable workers' health and rebalance
        (`router.rebalance`, when configured)."""
        await self.workers.start()
        await self.adapters.refresh()
        loop = asyncio.get_running_loop()
        self._checker = loop.create_task(self._recheck_forever())
        if self.slo is not None:
            self._planner = loop.create_task(self.slo.run(self.orchestrator))

    async def stop(self) -> None:
        for task in (self._checker, self._planner):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._checker = self._planner = None
        await self.workers.stop()

    async def _recheck_forever(self) -> None:
        bound = self.config.rebalance_kv_usage
        while True:
            await asyncio.sleep(self.config.kv_poll_interval_s)
            down = [wid for wid in self.workers.clients if not self.workers.is_healthy(wid)]
            try:
                if down:
                    await self.workers.check_health()
                if bound is not None:
                    await rebalance(self.workers, self.migrations, bound)
            except Exception:  # the next round tries again
                logger.exception("checking the workers' health or rebalancing failed")

    @property
    def max_model_len(self) -> int:
        return self.workers.any_info.max_model_len

    @property
    def block_size(self) -> int:
        return self.workers.any_info.block_size

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

    def admit(self, prompts: int = 1) -> Admission:
        """Take a slot of `max_in_flight` per prompt, or raise 429; hold them with `with` until
        the request ends. Call before any work on the request's content (tokenizing,
        templates)."""
        if prompts > self.config.max_prompts_per_request:
            raise BadRequestError(f"{prompts} prompts in one request; at most "
                                  f"{self.config.max_prompts_per_request}", param="prompt")
        # (a request of more prompts than the limit is let in alone)
        if self.in_flight and self.in_flight + prompts > self.config.max_in_flight:
            raise OverloadedError(
                f"The server is overloaded: {self.in_flight} requests in flight, the limit is "
                f"{self.config.max_in_flight}; retry later",
                headers={"Retry-After": str(self.config.retry_after_s)})
        self.in_flight += prompts
        return Admission(self, prompts)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    async def tokenize_async(self, text: str) -> list[int]:
        """`tokenize`, a long text on a thread (the Rust tokenizer releases the GIL)."""
        if len(text) < TOKENIZE_INLINE_CHARS:
            return self.tokenizer.encode(text)
        return await asyncio.to_thread(self.tokenizer.encode, text)

    def check_prompt(self, ids: list[int], param: str = "prompt") -> None:
        vocab = self.workers.any_info.vocab_size
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
                       cache_salt: str | None = None, frontend: str = "other",
                       ttft_deadline_s: float | None = None,
                       lora_name: str | None = None) -> Generation:
        """Route and start a request (aggregated or split between a prefill and a decode
        worker: `router.orchestrator`); returns once its first token arrived. The request id,
        the key of its blocks and leases on every worker, is made here. Raises
        `BadRequestError` (a worker refused it) or `NoHealthyWorkerError`. `frontend` (http,
        grpc) labels its metrics; errors raised here are for the caller to count
        (`metrics.count_error`). `ttft_deadline_s`: the request's own TTFT target; one no
        worker is predicted to meet is refused at once (429, `router.deadline`). `lora_name`:
        the LoRA adapter it runs under (`adapters.resolve`; None: the base model)."""
        started, tr = time.monotonic(), tracing()
        front_end = tr.traceparent()  # the stream's span is its child (`router.stream_trace`)
        with tr.span("router.start", attributes={"prompt_tokens": len(prompt_token_ids)}):
            req = WorkerRequest(f"cmpl-{uuid.uuid4().hex}", tuple(prompt_token_ids), params,
                                cache_salt, lora_name, traceparent=tr.traceparent(),
                                ttft_deadline_s=ttft_deadline_s)
            if self.slo is not None:
                self.slo.arrived(len(prompt_token_ids), params.max_tokens)
            try:
                gen = await self.orchestrator.generate(req, started, frontend, ttft_deadline_s)
            except NotFoundError:  # no such adapter there: unloaded through another replica
                self.adapters.forget(lora_name or "")
                raise
            if tr.on:
                tr.set_attributes({"request_id": req.request_id, "worker": gen.worker_id,
                                   "decode_worker": gen.decode_worker_id or "",
                                   "predicted_cached_tokens": gen.predicted_cached_tokens})
                gen.record = StreamSpan(gen.record, gen, front_end)
        return gen

    async def embed(self, token_ids: list[list[int]], pooling: str,
                    normalize: bool) -> Embeddings:
        """The inputs' pooled final hidden states from a prefill worker (`router.embedder`)."""
        return await self.embedder.embed(token_ids, pooling, normalize)

    async def drain(self, worker_id: str, with_kv: bool = True,
                    hand_off_prefixes: bool = True) -> int:
        """Route nothing new to the worker, move its running streams, KV and all, to the
        others (`router.live_migration`), then hand its hottest prefixes to them
        (`router.hand_off`); how many streams moved."""
        moved = await self.migrations.drain(worker_id, with_kv)
        if hand_off_prefixes:
            await hand_off(self.workers, self.counters, worker_id)
        return moved

    async def switch_role(self, worker_id: str, role: WorkerRole) -> RoleSwitch:
        """Route a worker started as "both" under `role` from now on, once emptied of what
        the role must not run (`router.role_switch`: streams moved away with their KV)."""
        return await switch_role(self.workers, self.migrations, worker_id, role)

    def coldest(self, *roles: WorkerRole) -> str | None:
        """The worker of `roles` a scale-down should remove: its cache is worth least lately
        (`router.hand_off.coldest`); None when none is healthy."""
        return coldest(self.workers, roles or (WorkerRole.DECODE, WorkerRole.BOTH))

    # ---- the worker set, for the cluster's membership and status ---------------------------

    @property
    def clients(self) -> dict[str, WorkerClient]:
        return self.workers.clients

    @property
    def draining(self) -> set[str]:
        return self.workers.draining

    @property
    def worker_infos(self) -> dict[str, WorkerInfo]:  # what each routed worker serves, by id
        return self.workers.infos

    def pool(self, *roles: WorkerRole) -> list[str]:
        return self.workers.pool(*roles)

    def loads(self) -> list[WorkerLoad]:  # draining and unreachable workers unhealthy
        return list(self.workers.loads())

    def healthy_workers(self) -> list[str]:
        return self.workers.healthy_workers()

    async def check_health(self) -> list[str]:
        """Ask every worker now; returns the healthy ones' ids."""
        return await self.workers.check_health()

    async def add_worker(self, client: WorkerClient) -> None:  # its adapters first
        await self.adapters.join(client)
        await self.workers.add(client)

    async def remove_worker(self, worker_id: str) -> None:
        await self.workers.remove(worker_id)
