"""The load generator every serving benchmark shares: streamed `/v1/completions` requests to any
OpenAI-compatible server, timed chunk by chunk.

Requests arrive as a Poisson process (`request_rate`; inf: all at once), at most
`max_concurrency` in flight (a fixed-concurrency run: inf with `max_concurrency=c` keeps `c`
streams busy, starting the next request as one finishes). A run is bounded in count (the specs
given) and in time (`time_limit_s`: requests not yet started by then are not sent, and count as
failed). Prompts are token ids (exact lengths, no tokenizer needed) or text.

`summarize` turns one run into the figures a report prints: requests ok/failed, requests/s and
output tokens/s, TTFT, TPOT, inter-token latency (ITL: gaps between streamed chunks) and
end-to-end latency p50/p90/p99 in ms, and goodput under optional TTFT/TPOT SLOs.

The client is aiohttp (C HTTP parser), as vLLM's `bench serve` uses: on a machine the server
shares, the client's own CPU is taken from the server's. Against httpx it spent 33-40 us of CPU
per streamed token instead of 70-150 (the tiny model at 1 and 64 streams), and the in-process
server then delivered 13-28% more tokens/s at 64 streams.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

QUANTILES = (50, 90, 99)
SKIPPED = "not sent: the run's time limit passed first"


@dataclass(frozen=True)
class RequestSpec:
    prompt: list[int] | str  # token ids, or text
    max_tokens: int
    kind: str = "short"  # "short" or "long" (the mixed workload's two classes)
    extra: dict | None = None  # more body fields (a structured-output constraint, ...)


@dataclass
class RequestResult:
    kind: str
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between streamed chunks
    output_tokens: int = 0
    prompt_tokens: int = 0  # from the usage chunk, where the server sends one
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage's details)

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def make_workload(workload: str, num_prompts: int, input_len: int, output_len: int,
                  vocab_size: int, seed: int = 0, long_input_len: int = 1024,
                  long_output_len: int = 16, long_fraction: float = 0.25) -> list[RequestSpec]:
    """`num_prompts` requests of random token ids in [10, `vocab_size`), in arrival order:
    `random` gives each `input_len` prompt and `output_len` output tokens; in `mixed`, every
    1/`long_fraction`-th is long instead (evenly spread, so long prompts keep arriving while
    short ones decode). The same arguments give the same requests."""
    if workload not in ("random", "mixed"):
        raise ValueError(f"workload must be random or mixed, got {workload!r}")
    if not 0.0 < long_fraction <= 1.0:
        raise ValueError(f"long_fraction must be in (0, 1], got {long_fraction}")
    if min(num_prompts, input_len, output_len, long_input_len, long_output_len) < 1:
        raise ValueError("num_prompts and every length must be >= 1, got "
                         f"{(num_prompts, input_len, output_len, long_input_len, long_output_len)}")
    if vocab_size <= 10:
        raise ValueError(f"vocab_size must be > 10 (ids start at 10), got {vocab_size}")
    rng = random.Random(seed)
    every = round(1 / long_fraction)
    specs = []
    for i in range(num_prompts):
        long = workload == "mixed" and i % every == every - 1
        n_in, n_out = (long_input_len, long_output_len) if long else (input_len, output_len)
        specs.append(RequestSpec([rng.randrange(10, vocab_size) for _ in range(n_in)], n_out,
                                 "long" if long else "short"))
    return specs


def client_session(api_key: str = "EMPTY", keep_alive: bool = True,
                   timeout_s: float = 600.0) -> aiohttp.ClientSession:
    """The HTTP client `send` takes (open it with `async with`): no limit on connections;
    `keep_alive=False`: a fresh connection per request, for servers that close a connection
    after a few requests (llama.cpp's cpp-httplib), which a reused connection then meets as
    "disconnected without a response"."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=not keep_alive),
        timeout=aiohttp.ClientTimeout(total=timeout_s, connect=30.0),
        read_bufsize=1 << 22,  # the longest line (one streamed chunk) it reads
        headers={"Authorization": f"Bearer {api_key}"})


async def send(client: aiohttp.ClientSession, url: str, model: str, spec: RequestSpec,
               ignore_eos: bool) -> RequestResult:
    """One streamed completion, timed chunk by chunk; failures are returned, not raised."""
    body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(spec.extra or {})
    out = RequestResult(spec.kind)
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.post(url, json=body) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return out
            async for line in resp.content:  # lines, each with its b"\n"
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = str(chunk["error"].get("message"))[:200]
                    return out
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    out.output_tokens = usage["completion_tokens"]
                    out.prompt_tokens = usage.get("prompt_tokens") or 0
                    out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens") or 0
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if chunks == 0:
                        out.ttft_s = now - start
                    else:
                        out.itl_s.append(now - last)
                    last, chunks = now, chunks + 1
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: JSON
        out.error = f"{type(exc).__name__}: {exc}"[:200]
        return out
    out.latency_s = time.perf_counter() - start
    out.output_tokens = out.output_tokens or chunks
    out.ok = chunks > 0
    return out


async def run_load(base_url: str, model: str, specs: list[RequestSpec], request_rate: float,
                   max_concurrency: int | None = None, api_key: str = "EMPTY",
                   ignore_eos: bool = True, seed: int = 0,
                   time_limit_s: float | None = None,
                   keep_alive: bool = True) -> tuple[list[RequestResult], float]:
    """Send `specs` (Poisson arrivals at `request_rate`/s; inf: all at once), at most
    `max_concurrency` in flight; requests not started within `time_limit_s` are not sent.
    Returns the results in spec order and the wall time (s) from the first send to the last
    response."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or max(1, len(specs)))
    url = base_url.rstrip("/") + "/v1/completions"
    async with client_session(api_key, keep_alive) as client:
        start = time.perf_counter()
        deadline = math.inf if time_limit_s is None else start + time_limit_s

        async def one(spec: RequestSpec) -> RequestResult:
            async with limit:
                if time.perf_counter() > deadline:
                    return RequestResult(spec.kind, error=SKIPPED)
                return await send(client, url, model, spec, ignore_eos)

        tasks = []
        for spec in specs:
            tasks.append(asyncio.ensure_future(one(spec)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start


@dataclass(frozen=True)
class Workload:
    """One measured run's requests (`make_workload`'s options) and the client's settings."""

    kind: str = "random"  # random or mixed
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    long_input_len: int = 1024
    long_output_len: int = 16
    long_fraction: float = 0.25
    max_concurrency: int | None = None  # streams in flight at most (None: no cap)
    warmup: int = 2  # unmeasured requests sent first
    seed: int = 0
    ignore_eos: bool = True
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    api_key: str = field(default="EMPTY", repr=False)
    keep_alive: bool = True  # reuse connections between requests

    def specs(self, vocab_size: int) -> list[RequestSpec]:
        return make_workload(self.kind, self.num_prompts, self.input_len, self.output_len,
                             vocab_size, self.seed, self.long_input_len, self.long_output_len,
                             self.long_fraction)

    def warmup_specs(self, vocab_size: int) -> list[RequestSpec]:
        """`warmup` short-output requests, one of each kind the workload sends, other prompts."""
        return make_workload(self.kind, self.warmup, self.input_len, 4, vocab_size, -1 - self.seed,
                             self.long_input_len, 2, 1 / max(2, self.warmup))

    def setup(self) -> dict:
        """The options that shape the load, for a report (no API key)."""
        keys = ("num_prompts", "input_len", "output_len", "long_input_len", "long_output_len",
                "long_fraction", "max_concurrency", "warmup", "seed")
        return {"workload": self.kind} | {k: getattr(self, k) for k in keys}


def measure(base_url: str, model: str, workload: Workload, rate: float,
            vocab_size: int, time_limit_s: float | None = None) -> tuple[dict, list[RequestResult]]:
    """Warm up, then one measured run of `workload` at `rate` (blocking: runs its own event
    loop). Returns (summary, results)."""
    if workload.warmup:
        asyncio.run(run_load(base_url, model, workload.warmup_specs(vocab_size), math.inf, None,
                             workload.api_key, workload.ignore_eos,
                             keep_alive=workload.keep_alive))
    cpu0 = time.process_time()
    results, duration = asyncio.run(run_load(
        base_url, model, workload.specs(vocab_size), rate, workload.max_concurrency,
        workload.api_key, workload.ignore_eos, workload.seed, time_limit_s, workload.keep_alive))
    cpu = time.process_time() - cpu0
    summary = summarize(results, duration, workload.slo_ttft_ms, workload.slo_tpot_ms)
    # this process's CPU time over the run's wall time: near 1 (one core), the client itself
    # may be what limits the figures (meaningful only when no server runs in this process)
    summary["client_cpu_fraction"] = round(cpu / max(duration, 1e-9), 3)
    return {"request_rate": rate if math.isfinite(rate) else "inf", **summary}, results


def served_model(base_url: str, api_key: str = "EMPTY") -> str:
    """The server's first model id (`/v1/models`)."""
    async def get() -> str:
        async with client_session(api_key, timeout_s=30.0) as client, client.get(
                f"{base_url.rstrip('/')}/v1/models") as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]

    return asyncio.run(get())


def percentiles_ms(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 (nearest rank) and the mean of `values` (seconds), in ms."""
    if not values:
        return {f"p{q}_ms": None for q in QUANTILES} | {"mean_ms": None}
    xs = sorted(values)
    out: dict[str, float | None] = {
        f"p{q}_ms": round(xs[min(len(xs) - 1, math.ceil(q / 100 * len(xs)) - 1)] * 1e3, 2)
        for q in QUANTILES}
    out["mean_ms"] = round(sum(xs) / len(xs) * 1e3, 2)
    return out


def summarize(results: list[RequestResult], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    """The report of one run (no raw samples)."""
    ok = [r for r in results if r.ok]
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]

    def meets_slo(r: RequestResult) -> bool:
        tpot = r.tpot_s or 0.0
        return ((slo_ttft_ms is None or r.ttft_s * 1e3 <= slo_ttft_ms)
                and (slo_tpot_ms is None or tpot * 1e3 <= slo_tpot_ms))

    good = [r for r in ok if meets_slo(r)]
    errors = sorted({r.error for r in results if not r.ok})[:5]
    duration_s = max(duration_s, 1e-9)
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": errors, "duration_s": round(duration_s, 2),
        "request_throughput": round(len(ok) / duration_s, 3),
        "output_throughput": round(sum(r.output_tokens for r in ok) / duration_s, 1),
        "goodput": round(len(good) / duration_s, 3),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms,
                "met_fraction": round(len(good) / len(results), 3) if results else None},
        "ttft": percentiles_ms([r.ttft_s for r in ok]), "tpot": percentiles_ms(tpots),
        "itl": percentiles_ms([x for r in ok for x in r.itl_s]),
        "e2e": percentiles_ms([r.latency_s for r in ok]),
    }


def plot(runs: list[tuple[str, list[RequestResult]]], path: Path, title: str) -> Path:
    """CDFs of TTFT and ITL (ms) for each labelled run, as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, results in runs:
        ok = [r for r in results if r.ok]
        for ax, values in zip(axes, ([r.ttft_s for r in ok], [x for r in ok for x in r.itl_s])):
            xs = sorted(v * 1e3 for v in values)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    for ax, name in zip(axes, ("TTFT", "inter-token latency")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
