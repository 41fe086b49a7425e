"""Deadlines under overload: requests carrying a tight TTFT target (`x-slo-ttft-ms`) among a
stream of requests without one, arriving faster than the worker can serve them, on two
`cleave serve --in-process` servers of a random checkpoint (one worker each) side by side: one
orders its waiting queue earliest-deadline-first (`--scheduling-policy deadline`), the other
first come first served (`fcfs`). Both routers refuse (429) a deadline no worker is predicted to
meet. The servers are driven in alternation (ABBA rounds) with the same arrivals.

Per policy: the tight requests sent, refused (429), met (first token within the target), the met
rate = met / sent, and `deadline_vs_fcfs_met_ratio` (target, issue 51: >= 2). That refusals come
before any prefill work is checked on each server's `/metrics`: the prompt tokens prefilled
(`cleave_prompt_tokens`) are exactly the admitted requests' (a refused prompt never counted);
the refusals' latency is reported beside the unloaded TTFT (the in-process router shares its
process with the busy worker, so it is no proof by itself).

The capacity (requests a second with every background request sent at once) is measured first
on the fcfs server; the arrival rate is `--overload` times it, and the tight target `--tight-x`
times the mean time between completions at capacity (a request queued first waits for a running
sequence to finish, then its own prefill step; one queued last, for the whole queue).

    python benchmarks/deadlines.py [--preset tiny] [--rounds 2] [--seconds 12]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from results_io import RESULTS, command_line, emit
from serving_ray import CLEAVE, ServerProcess, free_ports

POLICIES = ("fcfs", "deadline")


class Server(ServerProcess):
    """`cleave serve --in-process`, one worker, the given waiting-queue order."""

    def __init__(self, model: str, policy: str, max_num_seqs: int) -> None:
        self.http_port, grpc_port = free_ports(2)
        self.command = [CLEAVE, "serve", "--in-process", "--model", model, "--device", "cpu",
                        "--port", str(self.http_port), "--grpc-port", str(grpc_port),
                        "--served-model-name", "m", "--num-workers", "1",
                        "--scheduling-policy", policy, "--max-num-seqs", str(max_num_seqs),
                        "--max-waiting-per-worker", "100000",
                        "--max-pending-tokens-per-worker", "100000000"]

    def start(self, timeout_s: float = 300.0) -> Server:
        self._spawn()
        self._wait_healthy(timeout_s, 0.5)
        return self

    def stop(self) -> None:
        self._terminate(60.0)


@dataclass
class Load:
    """One round's arrivals (the same for both servers)."""

    rate: float  # requests a second, all kinds
    seconds: float
    tight_fraction: float
    tight_ms: float
    prompt_len: int
    tight_prompt_len: int
    output_len: int
    seed: int
    model: str = "m"  # the served model name


@dataclass
class Outcome:
    """One round on one server."""

    tight_sent: int = 0
    tight_refused: int = 0
    tight_met: int = 0
    tight_late: int = 0
    tight_failed: int = 0
    background_sent: int = 0
    background_refused: int = 0
    background_failed: int = 0
    admitted_prompt_tokens: int = 0
    refusal_s: list[float] = field(default_factory=list)
    admitted_ttft_s: list[float] = field(default_factory=list)
    prefilled_prompt_tokens: float = 0.0  # from /metrics, this round's


def _body(prompt: list[int], max_tokens: int, model: str) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}


async def _request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                   headers: dict[str, str], model: str = "m"
                   ) -> tuple[int, float | None, float]:
    """(status, seconds to the first token or None, seconds to the answer's end)."""
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{url}/v1/completions", json=_body(prompt, max_tokens, model),
                             headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, None, time.perf_counter() - start
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.perf_counter() - start
    return 200, ttft, time.perf_counter() - start


def arrivals(load: Load) -> list[tuple[float, bool, list[int]]]:
    """The round's requests, the same for every server: (seconds from the start, tight?,
    prompt), Poisson at `load.rate`."""
    rng = random.Random(load.seed)
    out, t = [], rng.expovariate(load.rate)
    while t < load.seconds:
        tight = rng.random() < load.tight_fraction
        n = load.tight_prompt_len if tight else load.prompt_len
        out.append((t, tight, [rng.randrange(10, 500) for _ in range(n)]))
        t += rng.expovariate(load.rate)
    return out


async def _round(url: str, load: Load) -> Outcome:
    out = Outcome()
    tight_headers = {"x-slo-ttft-ms": f"{load.tight_ms:.0f}"}

    async def one(at: float, tight: bool, prompt: list[int]) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        try:
            status, ttft, total = await _request(client, url, prompt, load.output_len,
                                                 tight_headers if tight else {}, load.model)
        except httpx.HTTPError:
            if tight:
                out.tight_failed += 1
            return
        if status == 200:
            out.admitted_prompt_tokens += len(prompt)
            if ttft is not None:
                out.admitted_ttft_s.append(ttft)
        if tight:
            if status == 429:
                out.tight_refused += 1
                out.refusal_s.append(total)
            elif status == 200 and ttft is not None and ttft * 1000 <= load.tight_ms:
                out.tight_met += 1
            elif status == 200:
                out.tight_late += 1
            else:
                out.tight_failed += 1
        elif status == 429:
            out.background_refused += 1
        elif status != 200:
            out.background_failed += 1

    schedule = arrivals(load)
    out.tight_sent = sum(tight for _, tight, _ in schedule)
    out.background_sent = len(schedule) - out.tight_sent
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(*a) for a in schedule))
    return out


def _metric(url: str, name: str) -> float:
    """The sum of a counter's samples on the server's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(
        rf"^{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def measure(url: str, load: Load) -> Outcome:
    """One round on the server at `url`, with the prompt tokens it prefilled meanwhile."""
    before = _metric(url, "cleave_prompt_tokens")
    out = asyncio.run(_round(url, load))
    out.prefilled_prompt_tokens = _metric(url, "cleave_prompt_tokens") - before
    return out


def calibrate(url: str, prompt_len: int, tight_prompt_len: int,
              output_len: int) -> tuple[float, float]:
    """(a tight prompt's unloaded TTFT in seconds, the requests a second the server completes
    with every background request sent at once)."""
    async def go() -> tuple[float, float]:
        rng = random.Random(0)
        async with httpx.AsyncClient(timeout=600) as client:
            for _ in range(2):  # warm: compiled kernels, first steps
                await _request(client, url, [7] * prompt_len, output_len, {})
            ttfts = []
            for _ in range(5):
                prompt = [rng.randrange(10, 500) for _ in range(tight_prompt_len)]
                _, ttft, _ = await _request(client, url, prompt, 1, {})
                ttfts.append(ttft or 0.0)
            n = 32
            start = time.perf_counter()
            await asyncio.gather(*(_request(
                client, url, [rng.randrange(10, 500) for _ in range(prompt_len)],
                output_len, {}) for _ in range(n)))
            return statistics.median(ttfts), n / (time.perf_counter() - start)
    return asyncio.run(go())


def _summary(runs: dict[str, list[Outcome]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for policy, outs in runs.items():
        sent = sum(o.tight_sent for o in outs)
        met = sum(o.tight_met for o in outs)
        refusals = [s for o in outs for s in o.refusal_s]
        ttfts = [s for o in outs for s in o.admitted_ttft_s]
        result[policy] = {
            "tight_sent": sent, "tight_refused": sum(o.tight_refused for o in outs),
            "tight_met": met, "tight_late": sum(o.tight_late for o in outs),
            "tight_failed": sum(o.tight_failed for o in outs),
            "met_rate": round(met / sent, 4) if sent else None,
            "met_rate_by_round": [round(o.tight_met / o.tight_sent, 4) if o.tight_sent else None
                                  for o in outs],
            "background_sent": sum(o.background_sent for o in outs),
            "background_refused": sum(o.background_refused for o in outs),
            "background_failed": sum(o.background_failed for o in outs),
            "admitted_prompt_tokens": sum(o.admitted_prompt_tokens for o in outs),
            "prefilled_prompt_tokens": sum(o.prefilled_prompt_tokens for o in outs),
            "refusal_ms_max": round(max(refusals) * 1000, 2) if refusals else None,
            "refusal_ms_p50": round(statistics.median(refusals) * 1000, 2) if refusals else None,
            "admitted_ttft_ms_min": round(min(ttfts) * 1000, 2) if ttfts else None,
            "admitted_ttft_ms_p50": round(statistics.median(ttfts) * 1000, 2) if ttfts else None,
        }
        # the prompt tokens the worker prefilled are the admitted requests' only
        result[policy]["refused_before_prefill"] = (
            result[policy]["prefilled_prompt_tokens"] == result[policy]["admitted_prompt_tokens"])
    fcfs, edf = result["fcfs"]["met_rate"], result["deadline"]["met_rate"]
    result["deadline_vs_fcfs_met_ratio"] = (round(edf / fcfs, 3) if fcfs else
                                            (None if not edf else float("inf")))
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    from workers.models.make_model import make_model

    model = args.model or str(make_model(tempfile.mkdtemp(prefix="deadlines-"),
                                         preset=args.preset))
    servers = {p: Server(model, p, args.max_num_seqs) for p in POLICIES}
    for server in servers.values():
        server.start()
    try:
        lens = (args.prompt_len, args.tight_prompt_len, args.output_len)
        ttft_s, capacity = calibrate(servers["fcfs"].base_url, *lens)
        calibrate(servers["deadline"].base_url, *lens)  # warm
        # a request queued first waits for a running sequence to finish (one every
        # 1/capacity seconds at full load) and its own prefill step
        tight_ms = args.tight_x * 1000 / capacity
        runs: dict[str, list[Outcome]] = {p: [] for p in POLICIES}
        for r in range(args.rounds):
            load = Load(args.overload * capacity, args.seconds, args.tight_fraction, tight_ms,
                        args.prompt_len, args.tight_prompt_len, args.output_len, seed=r)
            order = POLICIES if r % 2 == 0 else POLICIES[::-1]
            for policy in order:
                runs[policy].append(measure(servers[policy].base_url, load))
                time.sleep(0.5)
            print(f"round {r}", {p: (o[-1].tight_sent, o[-1].tight_refused, o[-1].tight_met)
                                 for p, o in runs.items()}, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    result = _summary(runs)
    result["load"] = {"preset": None if args.model else args.preset,
                      "unloaded_tight_ttft_ms": round(ttft_s * 1000, 2),
                      "capacity_requests_per_s": round(capacity, 2),
                      "rate_requests_per_s": round(args.overload * capacity, 2),
                      "tight_ms": round(tight_ms, 1), "tight_fraction": args.tight_fraction,
                      "prompt_len": args.prompt_len, "tight_prompt_len": args.tight_prompt_len,
                      "output_len": args.output_len, "seconds": args.seconds,
                      "rounds": args.rounds, "max_num_seqs": args.max_num_seqs}
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a checkpoint (default: a random one)")
    parser.add_argument("--preset", default="tiny", help="the random checkpoint's shape")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=12.0, help="arrivals per round")
    parser.add_argument("--overload", type=float, default=1.5, help="x the measured capacity")
    parser.add_argument("--tight-fraction", type=float, default=0.2)
    parser.add_argument("--tight-x", type=float, default=3.0,
                        help="the tight target, x the mean time between completions at capacity")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--tight-prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--out", default=str(RESULTS / "deadlines.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    result["command"] = command_line(argv)
    result["targets"] = {"deadline_vs_fcfs_met_ratio": ">= 2",
                         "refused_before_prefill": "true for both"}
    return emit(result, args.out)


if __name__ == "__main__":
    main()
