"""Routing policies on the Ray app (`cleave serve`): the multi-tenant, shared-prefix chat
workload of `routing_engines.py`, sent over HTTP to workers in their own processes, each pinned
to a core of its own (the pool's `cpu_affinity`).

Each policy gets a fresh app (cold caches) and the same workload (same seed, same arrival and
think times). A turn is a streamed `/v1/completions` request of token ids: the tenant's system
prompt, the conversation so far (the replies as the model wrote them, from vLLM's
`return_token_ids`) and the new user message. `--workers 4 --cores none` runs four unpinned
workers (more workers than this machine has cores to give each its own). Per turn the usage reports the tokens the worker
served from its prefix cache (`cached_tokens`) and what the router's index predicted
(`predicted_cached_tokens`).

Measured per policy: hit rate (cached over prompt tokens), TTFT p50/p90/p99, output
throughput over the makespan, and routing accuracy: the share of turns whose predicted cached
tokens are within one block of the actual. The oracle here is an upper bound, computed from the
run itself: a turn could at best hit every leading full block of its prompt that an earlier
turn had computed by the time it was sent (its prompt by its first token, its whole text by its
end) -- a cluster with unlimited cache where every request lands where its prefix is. Its hit
rate is at least any real placement's, so the ratio against it is a floor of the ratio against
`routing_engines.py`'s oracle, which reads the block pools at decision time in process.

Last line: one JSON object (ratios under `_ratio` keys), also written to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml
from results_io import RESULTS, command_line, emit
from routing_engines import Workload, bench_model, make_workload, percentile
from serving_ray import RayApp

from cluster.cpu_affinity import affinity_of
from workers.contract.prefix_cache import hash_prompt_blocks

POLICIES = ("prefix_aware", "least_loaded", "round_robin")
BLOCK_SIZE = 16


@dataclass
class Turn:
    conversation: int
    prompt: list[int]
    sent_at: float = 0.0
    first_at: float = 0.0
    done_at: float = 0.0
    output: list[int] = field(default_factory=list)
    cached: int = 0
    predicted: int = 0
    error: str = ""


async def send(client: httpx.AsyncClient, url: str, turn: Turn, max_tokens: int) -> None:
    body = {"model": "model", "prompt": turn.prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    turn.sent_at = time.perf_counter()
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            turn.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                turn.error = str(chunk["error"])[:200]
                return
            for choice in chunk.get("choices", ()):
                if not turn.first_at:
                    turn.first_at = time.perf_counter()
                turn.output.extend(choice.get("token_ids", ()))
            if chunk.get("usage"):
                details = chunk["usage"]["prompt_tokens_details"]
                turn.cached = details["cached_tokens"]
                turn.predicted = details["predicted_cached_tokens"]
    turn.done_at = time.perf_counter()


async def converse(client: httpx.AsyncClient, url: str, workload: Workload, i: int,
                   start: float, turns: list[Turn]) -> None:
    conv = workload.conversations[i]
    await asyncio.sleep(max(0.0, start + conv.arrival_s - time.perf_counter()))
    history = list(workload.systems[conv.tenant])
    for t in conv.turns:
        await asyncio.sleep(t.think_s)
        turn = Turn(i, history + list(t.user))
        turns.append(turn)
        await send(client, url, turn, t.reply_tokens)
        if turn.error:
            return
        history = turn.prompt + turn.output


def oracle_cached(turns: list[Turn]) -> list[int]:
    """Per turn, the tokens of its prompt's leading full blocks computed before it was sent."""
    ready = sorted([(t.first_at, hash_prompt_blocks(t.prompt, BLOCK_SIZE)) for t in turns]
                   + [(t.done_at, hash_prompt_blocks(t.prompt + t.output, BLOCK_SIZE))
                      for t in turns])
    out = []
    for turn in turns:
        known = {h for at, hashes in ready if at < turn.sent_at for h in hashes}
        depth = 0
        for h in hash_prompt_blocks(turn.prompt, BLOCK_SIZE):
            if h not in known:
                break
            depth += 1
        out.append(depth * BLOCK_SIZE)
    return out


def report(turns: list[Turn], warmup: int) -> dict:
    failed = [t.error for t in turns if t.error]
    if failed:
        raise RuntimeError(f"{len(failed)} turns failed: {failed[:3]}")
    bound = oracle_cached(turns)
    measured = [(t, b) for t, b in zip(turns, bound) if t.conversation >= warmup]
    prompt = sum(len(t.prompt) for t, _ in measured)
    ttft = [t.first_at - t.sent_at for t, _ in measured]
    makespan = max(t.done_at for t in turns) - min(t.sent_at for t in turns)
    return {"turns": len(measured), "prompt_tokens": prompt,
            "hit_rate": round(sum(t.cached for t, _ in measured) / prompt, 4),
            "oracle_hit_rate": round(sum(b for _, b in measured) / prompt, 4),
            "routing_accuracy": round(sum(abs(t.predicted - t.cached) < BLOCK_SIZE
                                          for t, _ in measured) / len(measured), 4),
            "ttft_p50_s": round(percentile(ttft, 50), 4),
            "ttft_p90_s": round(percentile(ttft, 90), 4),
            "ttft_p99_s": round(percentile(ttft, 99), 4),
            "ttft_mean_s": round(statistics.fmean(ttft), 4),
            "throughput_output_tok_per_s": round(sum(len(t.output) for t in turns) / makespan,
                                                 1),
            "makespan_s": round(makespan, 1)}


def run_policy(policy: str, model: str, workload: Workload, args: argparse.Namespace,
               tmp: str) -> dict:
    config = {"pools": {"aggregated": {
        "cpus_per_rank": 1, "cpu_affinity": args.cores or None,
        "replicas": {"min": args.workers, "max": args.workers, "initial": args.workers},
        "engine": {"num_blocks": args.num_blocks, "block_size": BLOCK_SIZE}}},
        "router": {"policy": policy}}
    path = Path(tmp, f"{policy}.yaml")
    path.write_text(yaml.safe_dump(config))
    app = RayApp(model, "model", config=str(path), num_cpus=args.workers + 2,
                 extra_args=("--load-format", "dummy")).start()
    try:
        turns: list[Turn] = []

        async def go() -> None:
            url = app.base_url + "/v1/completions"
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
                start = time.perf_counter()
                await asyncio.gather(*(converse(client, url, workload, i, start, turns)
                                       for i in range(len(workload.conversations))))

        asyncio.run(go())
        out = report(turns, args.warmup_conversations)
        out["engine_cores"] = sorted(affinity_of(pid) for pid in app.processes("EngineActor"))
        print(policy, out, flush=True)
        return out
    finally:
        app.stop()


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: routing_engines.py's shape")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cores", type=lambda s: [int(x) for x in s.split(",")] if s != "none"
                   else [], default=[0, 1],
                   help="the cores the workers are pinned to, one each; none: not pinned")
    p.add_argument("--conversations", type=int, default=44)
    p.add_argument("--warmup-conversations", type=int, default=12)
    p.add_argument("--conv-per-s", type=float, default=0.5)
    p.add_argument("--tenants", type=int, default=12)
    p.add_argument("--think-s", type=float, default=2.0)
    p.add_argument("--num-blocks", type=int, default=640, help="KV blocks per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "routing_ray.json"))
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="routing-ray-")
    model = args.model or bench_model(tmp)
    vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
    workload = make_workload(args.seed, args.conversations, args.conv_per_s, args.tenants,
                             vocab, think_s=args.think_s)
    results = {policy: run_policy(policy, model, workload, args, tmp) for policy in POLICIES}
    pa, rr = results["prefix_aware"], results["round_robin"]
    out = {"benchmark": "routing_ray", "command": command_line(None),
           "setup": {k: v for k, v in vars(args).items() if k != "out"} | {
               "model": args.model or "routing_engines.py's SHAPE, dummy weights",
               "cores": "each worker pinned to one core of --cores; the router, Ray and the "
                        "client unpinned" if args.cores else "nothing pinned", "time": time.strftime("%Y-%m-%d %H:%M")},
           "policies": results,
           "prefix_aware_hit_rate_vs_oracle_bound_ratio": round(
               pa["hit_rate"] / pa["oracle_hit_rate"], 3),
           "prefix_aware_ttft_p90_vs_round_robin_ratio": round(
               rr["ttft_p90_s"] / pa["ttft_p90_s"], 2),
           "prefix_aware_ttft_p90_vs_least_loaded_ratio": round(
               results["least_loaded"]["ttft_p90_s"] / pa["ttft_p90_s"], 2),
           "prefix_aware_routing_accuracy_ratio": pa["routing_accuracy"],
           "prefix_aware_throughput_vs_round_robin_ratio": round(
               pa["throughput_output_tok_per_s"] / rr["throughput_output_tok_per_s"], 3)}
    return emit(out, args.out)


if __name__ == "__main__":
    main()
