"""Draining a worker that holds running streams: live KV migration against replay (issue 23).

Setup: the router and two aggregated workers in this process (`LocalServer`: real HTTP,
streamed completions from an httpx client in this process too), the `small` preset with an 8k
context, one torch thread. `--streams` requests with prompts of `--min-context` to
`--max-context` random tokens all start on worker 0 (worker 1 is kept draining meanwhile), each
asking for `--output-len` tokens (greedy, ignore_eos). Once every stream has sent
`--warm-tokens` tokens and `--steady-s` seconds of steady decoding have passed, worker 0 is
drained (`Router.drain`): its streams move to worker 1 with their KV (live), or worker 1
recomputes each stream's prompt and output so far (replay, `with_kv=False`: what Dynamo's
migration does). Both modes on the same requests, in one run.

Figures per mode: prompt tokens worker 1 computes for the moved streams (live: 0; replay: the
contexts' sum), the drain's time (from `drain` until every stream it moved has streamed again:
the end of each stream's longest gap between chunks after the drain began), the moved streams'
inter-token gaps during the drain (p99) against their gaps before it (p99), and whether every
stream's text equals the other mode's (both should equal an undisturbed run, which the tests
check). Ratios: `drain_time_ratio` (live / replay; target < 0.1), `itl_p99_during_ratio` (live,
during / steady; target <= 2), `recomputed_tokens_ratio` (live / replay; target 0).

The issue's shape (32 streams of 2k-8k tokens on the Ray app) is `drain_ray.py`'s; this one is
the same drain without Ray, smaller by default.

Last line: one JSON object; also written to benchmarks/results/drain.json with the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import threading
import time
from typing import Callable

import httpx
from kv_fetch import long_context_model
from loadgen import percentiles_ms
from results_io import RESULTS, command_line, emit
from serving_layers import code_state


class Stream:
    def __init__(self) -> None:
        self.text = ""
        self.times: list[float] = []  # when each chunk arrived
        self.error = ""


async def stream_completion(client: httpx.AsyncClient, url: str, model: str,
                            prompt: list[int], max_tokens: int, out: Stream) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk.get("choices"):
                        out.text += chunk["choices"][0]["text"]
                        out.times.append(time.perf_counter())
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"


def run_mode(model: str, prompts: list[list[int]], args: argparse.Namespace,
             with_kv: bool) -> dict:
    import torch

    from cluster.local_server import LocalServeConfig, LocalServer

    torch.set_num_threads(args.torch_threads)
    longest = max(len(p) for p in prompts) + args.output_len
    num_blocks = len(prompts) * (-(-longest // 16)) + 64
    server = LocalServer(LocalServeConfig(
        model, num_workers=2, http_port=0, grpc_port=0,
        engine={"num_blocks": num_blocks, "max_num_batched_tokens": 2048})).start()
    router = server.router
    target = server.clients[1].channel.worker
    computed = [0]
    real = target.engine.scheduler.schedule

    def counting():
        out = real()
        computed[0] += out.num_batched_tokens - out.num_decodes
        return out

    target.engine.scheduler.schedule = counting
    server.call(_set_draining(router, "worker-1", True))
    streams = [Stream() for _ in prompts]
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"

    async def load() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
            await asyncio.gather(*(stream_completion(client, url, router.model_name, p,
                                                     args.output_len, s)
                                   for p, s in zip(prompts, streams)))

    thread = threading.Thread(target=lambda: asyncio.run(load()), daemon=True)
    try:
        thread.start()
        wait_started(streams, thread, args.warm_tokens, 1800)
        server.call(_set_draining(router, "worker-1", False))
        warmed = time.perf_counter()
        time.sleep(args.steady_s)  # every stream decoding: the steady gaps
        computed[0] = 0
        start = time.perf_counter()
        moved = server.call(router.drain("worker-0", with_kv, hand_off_prefixes=False), 600)
        thread.join(1800)
        recomputed = computed[0]  # by worker 1, for the streams it took over
    finally:
        server.stop()
    return {"moved": moved, **summarize(streams, warmed, start),
            "recomputed_tokens": recomputed}


def wait_started(streams: list[Stream], thread: threading.Thread, warm_tokens: int,
                 timeout_s: float) -> None:
    """Until every stream has sent `warm_tokens` chunks; `RuntimeError` when the streaming
    `thread` ends first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while min(len(s.times) for s in streams) < warm_tokens:
        if not thread.is_alive() or time.monotonic() > deadline:
            errors = sorted({s.error for s in streams if s.error})
            raise RuntimeError(f"the streams did not all start: {errors[:3]}")
        time.sleep(0.01)


def _resumed(times: list[float], start: float) -> float | None:
    """When a stream streamed again after its move: the end of its longest gap between two
    chunks that ends after `start` (None: it had ended by then)."""
    gaps = [(b - a, b) for a, b in zip(times, times[1:]) if b > start]
    return max(gaps)[1] if gaps else None


def summarize(streams: list[Stream], warmed: float, start: float) -> dict:
    """The drain's figures from the streams' chunk times: decoding steadily from `warmed`,
    drained at `start`. The drain is over when every stream it moved streams again."""
    resumed = [t for t in (_resumed(s.times, start) for s in streams) if t is not None]
    drain_s = max(resumed) - start if resumed else None
    steady = [b - a for s in streams for a, b in zip(s.times, s.times[1:])
              if a >= warmed and b < start]
    end = start + (drain_s or 0.0)
    during = [b - a for s in streams for a, b in zip(s.times, s.times[1:])
              if b >= start and a <= end]
    return {"drain_s": None if drain_s is None else round(drain_s, 4),
            "itl_steady": percentiles_ms(steady), "itl_during_drain": percentiles_ms(during),
            "errors": sorted({s.error for s in streams if s.error})[:5],
            "texts": [s.text for s in streams]}


async def _set_draining(router, worker_id: str, draining: bool) -> None:  # noqa: ANN001
    (router.workers.draining.add if draining else router.workers.draining.discard)(worker_id)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--min-context", type=int, default=1024)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--warm-tokens", type=int, default=16)
    p.add_argument("--steady-s", type=float, default=1.0,
                   help="seconds of steady decoding measured before the drain")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "drain.json"))
    args = p.parse_args(argv)
    prompts, live, replay = both_modes(args, run_mode)
    result = {
        "benchmark": "drain", "command": command_line(argv), **code_state(),
        "setup": {**setup(args, prompts), "torch_threads": args.torch_threads,
                  "server": "LocalServer (router + 2 aggregated workers) in this process"},
        **compare(live, replay)}
    return emit(result, args.out)


def both_modes(args: argparse.Namespace,
               run: Callable[[str, list[list[int]], argparse.Namespace, bool], dict]
               ) -> tuple[list[list[int]], dict, dict]:
    """`--streams` random prompts of `--min-context` to `--max-context` tokens on the `small`
    preset (its context long enough), then `run(model, prompts, args, with_kv)` live and by
    replay: (prompts, live, replay)."""
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model = long_context_model(tmp, args.max_context + args.output_len + 256)
        from workers.models.model_config import ModelConfig

        vocab = ModelConfig.from_pretrained(model).vocab_size
        prompts = [[rng.randrange(10, vocab) for _ in range(
            rng.randint(args.min_context, args.max_context))] for _ in range(args.streams)]
        return prompts, run(model, prompts, args, True), run(model, prompts, args, False)


def setup(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """The workload's figures both drain benchmarks report."""
    return {"streams": args.streams, "context": [args.min_context, args.max_context],
            "sum_of_contexts": sum(len(x) for x in prompts), "output_len": args.output_len,
            "warm_tokens": args.warm_tokens}


def compare(live: dict, replay: dict) -> dict:
    """Both modes' figures (their texts compared, then dropped) and the ratios."""
    texts = live.pop("texts")
    same = sum(a == b for a, b in zip(texts, replay.pop("texts")))

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 4) if a is not None and b else None

    return {"live": live, "replay": replay, "identical_texts": f"{same}/{len(texts)}",
            "drain_time_ratio": ratio(live["drain_s"], replay["drain_s"]),
            "itl_p99_during_ratio": ratio(live["itl_during_drain"]["p99_ms"],
                                          live["itl_steady"]["p99_ms"]),
            "recomputed_tokens_ratio": ratio(live["recomputed_tokens"],
                                             replay["recomputed_tokens"]),
            "targets": "drain_time_ratio < 0.1, itl_p99_during_ratio <= 2, "
                       "recomputed_tokens_ratio == 0"}


if __name__ == "__main__":
    main()
