"""The KV cache's host-memory tier on multi-turn conversations, served (issue 23).

Setup: the router and one aggregated engine in a child process (`LocalServer`: real HTTP,
streamed completions, the same router `cleave serve` runs; `serving_layers.inprocess_server`),
on the `small` preset (`--model` for another folder or `tiny`), one torch thread. The engine's
primary KV pool is sized to `--pool-fraction` (default a quarter) of the conversations' KV at
their longest, so a conversation's earlier turns are evicted before it comes back. Two runs in
one invocation, on the same requests: without a host tier, then with one holding all of the
conversations' KV (`host_kv_cache_memory_bytes`, `--kv-offloading-size` of `cleave serve`).

Workload: `--conversations` conversations, each a system prompt of `--system-len` random
tokens, then `--turns` turns of a user message (`--user-len` tokens) and a reply (`--reply-len`
tokens, ignore_eos, greedy). Each turn's prompt is the previous turn's prompt, `--reply-len`
stand-in tokens for the reply (the stream returns text, not the reply's token ids; both runs
send the same ones) and the new message. `--concurrency` clients send turns in turn-major order
(every conversation's turn t before any turn t + 1), a conversation's turns one after another.

Figures per run: TTFT p50/p90/p99 over all turns and over turns after the first (the ones a
cache can serve), the hit rate (cached prompt tokens over prompt tokens, from each response's
usage), throughput. Ratios: `ttft_p90_ratio` = TTFT p90 without / with the tier over all
turns (target >= 2), `ttft_p50_ratio`, and the same over turns after the first
(`ttft_p90_later_turns_ratio`, `ttft_p50_later_turns_ratio`): first turns find nothing cached
in either run, and with few turns per conversation they set the all-turns p90.

`--parts fetch` (`kv_fetch.py`): prefix fetch from another worker against recompute, per prompt
length (`--fetch-lengths`, default 1k-8k tokens) on each of `--transports`, measured beside the
router's cost model's prediction; the crossover (the shortest length where a fetch wins) of each.

Last line: one JSON object; also written to benchmarks/results/kv_tiers.json with the command.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from dataclasses import dataclass

import kv_fetch
from loadgen import RequestResult, RequestSpec, client_session, percentiles_ms, send, served_model
from results_io import RESULTS, command_line, emit
from serving_layers import code_state, inprocess_server, resolve_model, vocab_of


@dataclass(frozen=True)
class Shape:
    conversations: int
    turns: int
    system_len: int
    user_len: int
    reply_len: int

    @property
    def longest(self) -> int:
        """Tokens of a conversation's last prompt plus its reply."""
        return self.system_len + self.turns * (self.user_len + self.reply_len)


def make_turns(shape: Shape, vocab_size: int, seed: int) -> list[list[list[int]]]:
    """Per conversation, each turn's prompt (token ids)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab_size) for _ in range(n)]

    out = []
    for _ in range(shape.conversations):
        history = tokens(shape.system_len)
        prompts = []
        for turn in range(shape.turns):
            if turn:
                history = history + tokens(shape.reply_len)  # the reply's stand-in
            history = history + tokens(shape.user_len)
            prompts.append(history)
        out.append(prompts)
    return out


async def converse(base_url: str, model: str, turns: list[list[list[int]]], reply_len: int,
                   concurrency: int) -> tuple[list[tuple[int, RequestResult]], float]:
    """Every turn, turn-major, at most `concurrency` in flight, a conversation's turns in
    order. Returns (turn index, result) per request and the wall time."""
    order = [(t, c) for t in range(len(turns[0])) for c in range(len(turns))]
    done = {(t, c): asyncio.Event() for t, c in order}
    queue: asyncio.Queue = asyncio.Queue()
    for item in order:
        queue.put_nowait(item)
    results: list[tuple[int, RequestResult]] = []
    url = base_url.rstrip("/") + "/v1/completions"
    async with client_session() as client:

        async def client_loop() -> None:
            while not queue.empty():
                t, c = queue.get_nowait()
                if t:
                    await done[(t - 1, c)].wait()
                spec = RequestSpec(turns[c][t], reply_len)
                results.append((t, await send(client, url, model, spec, ignore_eos=True)))
                done[(t, c)].set()

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return results, time.perf_counter() - start


def report(results: list[tuple[int, RequestResult]], duration_s: float) -> dict:
    ok = [(t, r) for t, r in results if r.ok]
    prompt = sum(r.prompt_tokens for _, r in ok)
    cached = sum(r.cached_tokens for _, r in ok)
    return {
        "requests": len(results), "completed": len(ok),
        "errors": sorted({r.error for _, r in results if not r.ok})[:5],
        "duration_s": round(duration_s, 2),
        "output_throughput": round(sum(r.output_tokens for _, r in ok) / duration_s, 1),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 4) if prompt else None,
        "ttft": percentiles_ms([r.ttft_s for _, r in ok]),
        "ttft_later_turns": percentiles_ms([r.ttft_s for t, r in ok if t > 0]),
        "tpot": percentiles_ms([x for x in (r.tpot_s for _, r in ok) if x is not None]),
    }


def kv_bytes_per_token(model: str) -> int:
    from workers.engine.kv_cache.spec import KVCacheSpec
    from workers.models.dtypes import resolve_dtype
    from workers.models.model_config import ModelConfig

    mc = ModelConfig.from_pretrained(model)
    spec = KVCacheSpec(mc.num_hidden_layers, 1, 1, mc.kv_cache_heads, mc.kv_cache_head_dim,
                       resolve_dtype("auto", mc), latent=mc.mla is not None)
    return spec.bytes_per_block


def run(model: str, shape: Shape, engine: dict, concurrency: int, torch_threads: int,
        seed: int) -> dict:
    turns = make_turns(shape, vocab_of(model), seed)
    with inprocess_server(model, {"num_workers": 1}, 1 << 30, torch_threads,
                          engine=engine) as (base_url, _):
        name = served_model(base_url)
        results, duration = asyncio.run(converse(base_url, name, turns, shape.reply_len,
                                                 concurrency))
    return report(results, duration)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small", help="tiny, small, or a model folder")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--user-len", type=int, default=128)
    p.add_argument("--reply-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--pool-fraction", type=float, default=0.25,
                   help="the primary KV pool, as a fraction of all conversations' KV")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parts", default="tiers,fetch", help="tiers, fetch, or both")
    p.add_argument("--fetch-lengths", default="1024,2048,4096,8192")
    p.add_argument("--transports", default="tcp,ucx")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "kv_tiers.json"))
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts or parts - {"tiers", "fetch"}:
        p.error(f"--parts: expected tiers and/or fetch, got {args.parts!r}")
    result: dict = {"benchmark": "kv_tiers", "command": command_line(argv), **code_state()}
    with tempfile.TemporaryDirectory() as tmp:
        if "tiers" in parts:
            result.update(_tiers(args, tmp))
        if "fetch" in parts:
            result["fetch"] = kv_fetch.run(
                tmp, args.transports.split(","), [int(x) for x in args.fetch_lengths.split(",")],
                args.repeats, args.block_size, args.torch_threads, args.seed)
            for transport, figures in result["fetch"].items():
                longest = args.fetch_lengths.split(",")[-1]
                row = figures.get("lengths", {}).get(longest) if transport != "setup" else None
                if row:
                    result[f"fetch_{transport}_{longest}_speedup_ratio"] = (
                        row["measured_speedup_ratio"])
    return emit(result, args.out)


def _tiers(args: argparse.Namespace, tmp: str) -> dict:
    """The host tier's two runs (see the module's docstring)."""
    shape = Shape(args.conversations, args.turns, args.system_len, args.user_len,
                  args.reply_len)
    model = resolve_model(args.model, tmp)
    total_tokens = shape.conversations * shape.longest
    num_blocks = max(int(total_tokens * args.pool_fraction) // args.block_size,
                     args.concurrency * (-(-shape.longest // args.block_size)))
    host_bytes = 2 * total_tokens * kv_bytes_per_token(model)  # all of it, with room
    base = {"block_size": args.block_size, "num_blocks": num_blocks}
    runs = {}
    for name, extra in (("without_host_tier", {}),
                        ("with_host_tier", {"host_kv_cache_memory_bytes": host_bytes})):
        runs[name] = run(model, shape, {**base, **extra}, args.concurrency,
                         args.torch_threads, args.seed)
    without, with_tier = runs["without_host_tier"], runs["with_host_tier"]
    return {
        "setup": {"model": args.model, "shape": vars(shape) | {"longest": shape.longest},
                  "total_kv_tokens": total_tokens,
                  "primary_pool_tokens": num_blocks * args.block_size,
                  "host_tier_bytes": host_bytes, "concurrency": args.concurrency,
                  "torch_threads": args.torch_threads,
                  "server": "LocalServer (router + 1 aggregated engine) in a child process"},
        "runs": runs,
        **{f"ttft_{q}{part}_ratio": _ratio(without[key][f"{q}_ms"], with_tier[key][f"{q}_ms"])
           for q in ("p90", "p50")
           for part, key in (("", "ttft"), ("_later_turns", "ttft_later_turns"))},
        "hit_rate_without": without["hit_rate"], "hit_rate_with": with_tier["hit_rate"],
        "target": "ttft_p90_ratio >= 2",
    }


if __name__ == "__main__":
    main()
