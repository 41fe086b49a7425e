"""Prefix fetch against recompute, per prompt length and transport (`kv_tiers.py --parts fetch`).

Two aggregated workers of the router (`LocalServer`, in this process) on the `small` preset with
an 8k context, one torch thread, over `--transports` (tcp, ucx). Per prompt length: worker B
computes a fresh prompt to its first token (recompute), and, for another prompt worker A has
just computed, worker A offers its blocks (`export_prefix`) and worker B pulls them before its
first token (fetch). Both timed from the request to the first token, the median of
`--repeats`. Beside them, the router's cost model's prediction for B, from B's own measured
rates (`router.workers.fetch_cost`): recompute = tokens x prefill seconds per token; fetch =
blocks x bytes per block / pull rate, plus the fixed cost of a fetch it measured
(`EngineStats.kv_fetch_fixed_s`), plus the tokens past the last full block recomputed.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from router.workers import fetch_cost
from workers.contract.calls import ExportPrefix
from workers.contract.messages import Generate, PrefixFetch
from workers.contract.prefix_cache import hash_prompt_blocks
from workers.contract.protocol import SamplingParams, WorkerRequest
from workers.serving.dispatch import dispatch

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def long_context_model(tmp: str, max_len: int) -> str:
    """The `small` preset with a context of `max_len` tokens, written under `tmp`."""
    from workers.models.make_model import make_model

    return str(make_model(Path(tmp) / "small-long", arch="llama", preset="small",
                          overrides={"max_position_embeddings": max_len}))


async def _first_token(worker, req: WorkerRequest, prefix: PrefixFetch | None = None) -> int:
    """Cached prompt tokens of `req` on `worker`, run to its first token."""
    cached = 0
    async for event in worker.stream(Generate(req, prefix)):
        cached = max(cached, event.num_cached_tokens)
    return cached


class _Pair:
    """Two workers behind one in-process router, and random prompts none of them has seen."""

    def __init__(self, server, vocab_size: int, block_size: int, seed: int) -> None:
        self.server = server
        self.a = server.clients[0].channel.worker
        self.b = server.clients[1].channel.worker
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.n = 0

    def prompt(self, length: int) -> tuple[str, tuple[int, ...]]:
        self.n += 1
        return f"p{self.n}", tuple(self.rng.randrange(10, self.vocab_size)
                                   for _ in range(length))

    def recompute_s(self, length: int) -> float:
        rid, prompt = self.prompt(length)
        start = time.perf_counter()
        self.server.call(_first_token(self.b, WorkerRequest(rid, prompt, FIRST_TOKEN)), 600)
        return time.perf_counter() - start

    def fetch_s(self, length: int) -> tuple[float, int]:
        rid, prompt = self.prompt(length)
        self.server.call(_first_token(self.a, WorkerRequest(rid + "-a", prompt, FIRST_TOKEN)),
                         600)
        hashes = tuple(hash_prompt_blocks(list(prompt), self.block_size))

        async def fetch() -> int:
            handoff = await dispatch(self.a, ExportPrefix(rid, hashes, 1))
            assert handoff is not None, "worker A no longer caches the prompt"
            return await _first_token(self.b, WorkerRequest(rid, prompt, FIRST_TOKEN),
                                      PrefixFetch(handoff, hashes))

        start = time.perf_counter()
        cached = self.server.call(fetch(), 600)
        return time.perf_counter() - start, cached

    def predicted(self, length: int) -> dict:
        info, stats = self.b.info, self.b.stats()
        per_token = stats.prefill_s_per_token
        blocks = length // self.block_size
        cost = fetch_cost(info, stats)
        recompute = length * per_token
        fetch = (None if cost is None else
                 blocks * self.block_size * per_token * cost + stats.kv_fetch_fixed_s
                 + (length - blocks * self.block_size + 1) * per_token)
        return {"recompute_s": round(recompute, 4),
                "fetch_s": None if fetch is None else round(fetch, 4),
                "fetch_cost": None if cost is None else round(cost, 5),
                "fetch_fixed_s": round(stats.kv_fetch_fixed_s, 4),
                "pull_gb_per_s": round(stats.kv_pull_bytes_per_s / 1e9, 3)}


def run_transport(model: str, transport: str, lengths: list[int], repeats: int,
                  block_size: int, torch_threads: int, seed: int) -> dict:
    import torch

    from cluster.local_server import LocalServeConfig, LocalServer

    torch.set_num_threads(torch_threads)
    num_blocks = 4 * max(lengths) // block_size + 64
    server = LocalServer(LocalServeConfig(
        model, num_workers=2, http_port=0, grpc_port=0, transport=transport,
        engine={"num_blocks": num_blocks, "block_size": block_size})).start()
    try:
        pair = _Pair(server, server.router.workers.any_info.vocab_size, block_size, seed)
        pair.fetch_s(min(lengths))  # warm: agents started, a first pull measured
        pair.recompute_s(min(lengths))
        rows = {}
        for length in lengths:
            recompute = [pair.recompute_s(length) for _ in range(repeats)]
            fetches = [pair.fetch_s(length) for _ in range(repeats)]
            measured_r = statistics.median(recompute)
            measured_f = statistics.median(s for s, _ in fetches)
            predicted = pair.predicted(length)
            rows[str(length)] = {
                "measured": {"recompute_s": round(measured_r, 4),
                             "fetch_s": round(measured_f, 4),
                             "fetch_cached_tokens": fetches[-1][1]},
                "predicted": predicted,
                "measured_speedup_ratio": round(measured_r / measured_f, 3),
                "predicted_speedup_ratio": (round(predicted["recompute_s"]
                                                  / predicted["fetch_s"], 3)
                                            if predicted["fetch_s"] else None),
            }
        return {"lengths": rows, "crossover": _crossover(rows)}
    finally:
        server.stop()


def _crossover(rows: dict) -> dict:
    """The shortest prompt at which fetching beats recomputing, measured and predicted."""
    def first(key: str) -> int | None:
        return next((int(n) for n, r in rows.items() if (r[key] or 0) > 1.0), None)

    return {"measured_tokens": first("measured_speedup_ratio"),
            "predicted_tokens": first("predicted_speedup_ratio")}


def run(tmp: str, transports: list[str], lengths: list[int], repeats: int, block_size: int,
        torch_threads: int, seed: int) -> dict:
    model = long_context_model(tmp, max(lengths) + 256)
    out = {"setup": {"model": "small preset, max_position_embeddings "
                              f"{max(lengths) + 256}", "lengths": lengths,
                     "repeats": repeats, "torch_threads": torch_threads,
                     "server": "LocalServer, 2 aggregated workers in this process"}}
    for transport in transports:
        try:
            out[transport] = run_transport(model, transport, lengths, repeats, block_size,
                                           torch_threads, seed)
        except Exception as exc:  # noqa: BLE001 -- a transport missing here is reported
            out[transport] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out


__all__ = ["run"]
