"""Scale-down on a shared-prefix workload: the prefix-hit rate before and after one of three
workers goes, by how the worker is chosen and whether its hot prefixes are handed off
(issue 23).

Setup: the router and three aggregated workers in this process (`LocalServer`: real HTTP, an
httpx client in this process), the `tiny` preset. The workload is conversations: `--groups`
prefixes of `--prefix-len` random tokens (a conversation's history, or a system prompt), each
request one of them (popularity Zipf with exponent `--zipf`; 0: uniform) plus `--suffix-len`
tokens of its own, asking for `--output-len` tokens, arriving at `--rate` per second (Poisson,
open loop). Each prefix comes back every few tens of seconds, as a conversation's next turn
does: a prefix whose cache goes with a removed worker misses on its next turn. The two
survivors' caches (`--num-blocks` each) hold every prefix. After `--warm-s` seconds, the hit
rate (cached prompt tokens / prompt tokens, as the workers report them, over the requests that
arrived in the window) is measured for `--window-s` seconds, one worker is removed
(`Router.drain`, then out of the router), and the hit rate is measured for `--window-s` more.

Policies, each on a fresh server with the same request sequence (Serve chooses the replica it
removes blind to caches: the newest on the node with the fewest replicas):
- `serve_default`: the newest worker goes (Serve's choice on one node), its cache with it;
- `hottest`: the worker whose cache served the most lately goes (a blind choice at its worst:
  on several nodes Serve's victim is any replica), its cache with it;
- `hottest_hand_off`: the same worker goes after handing its hottest prefixes to the others
  (`router.hand_off`): what Cleave's Serve deployment does whichever replica Serve picks;
- `cold_first_hand_off`: the worker whose cache served the fewest blocks lately per block goes
  (`Router.coldest`), after the hand-off: what `cleave drain --pool` and Cleave's own choice do.

Ratios: `<policy>_hit_rate_ratio` = hit rate after / before (target >= 0.95 for the hand-off
policies). Last line: one JSON object; also written to benchmarks/results/scale_down.json.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import threading
import time
from pathlib import Path

import httpx
from results_io import RESULTS, command_line, emit
from serving_layers import code_state

# policy -> (which worker goes, whether it hands its hot prefixes off first)
POLICIES = {"serve_default": ("newest", False), "hottest": ("hottest", False),
            "hottest_hand_off": ("hottest", True), "cold_first_hand_off": ("coldest", True)}


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """The request sequence (prompts), long enough for any run; the same for every policy."""
    rng = random.Random(args.seed)
    groups = [[rng.randrange(10, vocab) for _ in range(args.prefix_len)]
              for _ in range(args.groups)]
    weights = [1.0 / (k + 1) ** args.zipf for k in range(args.groups)]
    first = rng.sample(groups, len(groups))  # every prefix once first: the warm-up sees all
    picks = first + rng.choices(groups, weights, k=args.max_requests - len(groups))
    return [g + [rng.randrange(10, vocab) for _ in range(args.suffix_len)] for g in picks]


class Load:
    """Requests sent at Poisson arrivals of `--rate` per second (an open loop: a slow answer
    does not slow the arrivals) over the request sequence; each one's arrival, prompt and
    cached tokens."""

    def __init__(self, url: str, model: str, prompts: list[list[int]], args: argparse.Namespace):
        self.url, self.model, self.prompts, self.args = url, model, prompts, args
        self.done: list[tuple[float, int, int]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()

    async def _one(self, client: httpx.AsyncClient, prompt: list[int]) -> None:
        sent = time.perf_counter()
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.args.output_len,
                "temperature": 0.0, "ignore_eos": True}
        try:
            resp = await client.post(self.url, json=body)
        except httpx.HTTPError as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return
        if resp.status_code != 200:
            self.errors.append(f"HTTP {resp.status_code}: {resp.text[:200]}")
            return
        usage = resp.json()["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        self.done.append((sent, usage["prompt_tokens"], cached))

    async def run(self) -> None:
        rng = random.Random(self.args.seed + 1)
        tasks = []
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            for prompt in self.prompts:
                if self.stop.is_set():
                    break
                tasks.append(asyncio.ensure_future(self._one(client, prompt)))
                await asyncio.sleep(rng.expovariate(self.args.rate))
            await asyncio.gather(*tasks)

    def hit_rate(self, start: float, end: float) -> dict:
        """Over the requests that arrived in [start, end)."""
        window = [(p, c) for t, p, c in self.done if start <= t < end]
        prompt = sum(p for p, _ in window)
        return {"requests": len(window),
                "hit_rate": round(sum(c for _, c in window) / prompt, 4) if prompt else None}


def run_policy(model: str, prompts: list[list[int]], args: argparse.Namespace,
               policy: str) -> dict:
    import torch

    from cluster.local_server import LocalServeConfig, LocalServer

    torch.set_num_threads(args.torch_threads)
    server = LocalServer(LocalServeConfig(
        model, num_workers=3, http_port=0, grpc_port=0, router={"kv_poll_interval_s": 0.2},
        engine={"num_blocks": args.num_blocks, "max_num_batched_tokens": 1024})).start()
    router = server.router
    load = Load(f"http://127.0.0.1:{server.http_port}/v1/completions", router.model_name,
                prompts, args)
    thread = threading.Thread(target=lambda: asyncio.run(load.run()), daemon=True)
    try:
        thread.start()
        time.sleep(args.warm_s)
        before_start = time.perf_counter()
        time.sleep(args.window_s)
        cut = time.perf_counter()
        ids = [c.worker_id for c in server.clients]

        which, hand_off = POLICIES[policy]

        async def choose() -> tuple[str, dict[str, float]]:  # on the router's loop: one view
            worth = {w: round(router.workers.stats(w).recent_hit_blocks, 1) for w in ids}
            victim = {"newest": ids[-1], "hottest": max(worth, key=worth.get),
                      "coldest": router.coldest()}[which]
            return victim, worth

        victim, worth = server.call(choose())
        server.call(router.drain(victim, hand_off_prefixes=hand_off), 600)
        hand_off_s = time.perf_counter() - cut
        server.call(router.remove_worker(victim), 60)
        time.sleep(max(args.window_s - hand_off_s, 0.0))
        end = cut + args.window_s
        load.stop.set()
        thread.join(600)
        c = router.counters
        return {"victim": victim, "newest": ids[-1], "recent_hit_blocks": worth,
                "hand_off_s": round(hand_off_s, 3), "handed_off_prefixes": c.num_hand_off_prefixes,
                "handed_off_blocks": c.hand_off_blocks,
                "before": load.hit_rate(before_start, cut), "after": load.hit_rate(cut, end),
                "first_tenth_after": load.hit_rate(cut, cut + args.window_s / 10),
                "errors": load.errors[:5]}
    finally:
        load.stop.set()
        server.stop()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=192)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=2)
    p.add_argument("--zipf", type=float, default=0.0)
    p.add_argument("--num-blocks", type=int, default=2048,
                   help="KV blocks per worker (16 tokens each)")
    p.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson)")
    p.add_argument("--warm-s", type=float, default=90.0)
    p.add_argument("--window-s", type=float, default=60.0)
    p.add_argument("--max-requests", type=int, default=20_000)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "scale_down.json"))
    args = p.parse_args(argv)
    policies = args.policies.split(",")
    unknown = set(policies) - set(POLICIES)
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}; expected some of {list(POLICIES)}")
    from workers.models.make_model import make_model
    from workers.models.model_config import ModelConfig

    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_model(Path(tmp) / "tiny", arch="llama", preset="tiny"))
        prompts = workload(args, ModelConfig.from_pretrained(model).vocab_size)
        runs = {policy: run_policy(model, prompts, args, policy) for policy in policies}

    def ratio(run: dict) -> float | None:
        before, after = run["before"]["hit_rate"], run["after"]["hit_rate"]
        return round(after / before, 4) if before and after is not None else None

    result = {
        "benchmark": "scale_down", "command": command_line(argv), **code_state(),
        "setup": {k: getattr(args, k) for k in ("groups", "prefix_len", "suffix_len",
                                                 "output_len", "zipf", "num_blocks",
                                                 "rate", "warm_s", "window_s",
                                                 "torch_threads")}
        | {"server": "LocalServer (router + 3 aggregated workers -> 2) in this process"},
        **runs,
        **{f"{policy}_hit_rate_ratio": ratio(run) for policy, run in runs.items()},
        "targets": "hit rate after / before >= 0.95 with the hand-off",
    }
    return emit(result, args.out)


if __name__ == "__main__":
    main()
