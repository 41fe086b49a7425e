"""Draining a decode replica of the Ray app that holds running streams: live KV migration
against replay (issue 23), through the deployment as users run it.

Setup: the Cleave application on a local Ray in this process (`cluster.launch.deploy`: a
router replica serving HTTP itself, an aggregated pool of two replicas: each decodes, and
prefills its own prompts), the `small` preset with a context of `--max-context` plus the
output. The second worker is drained first (`Directory.set_draining`). `--streams` prompts of
`--min-context` to `--max-context` random tokens are first run to one token each, so the first
worker caches them all (a long prompt's prefill takes seconds on 2 cores: without this the
first streams would be over before the last had started). Then the streamed completions
(httpx, in this process), `--output-len` tokens each (greedy, ignore_eos), all start at once on
the first worker from its cache. Once every stream has sent `--warm-tokens` tokens, the second
worker is put back in rotation (`Directory.undrain`), and after `--steady-s` seconds of steady
decoding the first is drained as `cleave drain` drains it (`cluster.drain.drain_worker`,
without the restart): the router moves its streams to the second with their KV (live), or has
it recompute each stream's prompt and output so far (replay: what Dynamo's migration does). A
fresh application per mode, the same requests.

Figures per mode: prompt tokens the second decode worker computes from the drain on (its
`EngineStats.num_prompt_tokens_computed`; live: 0, replay: the contexts' sum), the drain's time
(from the drain until every stream it moved has streamed again: the end of each stream's longest
gap between chunks after the drain began), the streams' inter-token gaps during the drain (p99)
against before it (p99), and whether each stream's text is the same in both modes. Ratios as
`drain.py`'s: `drain_time_ratio` (live / replay; target < 0.1), `itl_p99_during_ratio` (live,
during / steady; target <= 2), `recomputed_tokens_ratio` (live / replay; target 0).

Last line: one JSON object; also written to benchmarks/results/drain_ray.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time

import httpx
from drain import Stream, both_modes, compare, setup, stream_completion, summarize, wait_started
from results_io import RESULTS, command_line, emit
from serving_layers import code_state
from serving_ray import free_ports

MODEL_NAME = "small"


def app_config(model: str, num_blocks: int) -> dict:
    """Two aggregated workers, each with room for every stream."""
    http, grpc = free_ports(2)
    return {"model": {"path": model, "served_model_name": MODEL_NAME},
            "pools": {"aggregated": {"cpus_per_rank": 0.5, "replicas": {"min": 2, "max": 2},
                                     "engine": {"num_blocks": num_blocks,
                                                "max_num_batched_tokens": 2048}}},
            "router": {"http_port": http, "grpc_port": grpc, "kv_poll_interval_s": 0.25}}


def _directory():  # noqa: ANN202
    from ray import serve

    from cluster.launch import APP_NAME

    return serve.get_deployment_handle("directory", app_name=APP_NAME)


def _workers() -> list:
    entries = _directory().entries.remote().result(timeout_s=30)
    return sorted(entries, key=lambda e: e.worker_id)


def _stats(entry):  # noqa: ANN001, ANN202
    import ray

    return ray.get(entry.actor.stats.remote(), timeout=30)


def run_mode(model: str, prompts: list[list[int]], args: argparse.Namespace,
             with_kv: bool) -> dict:
    from cluster.config import CleaveConfig
    from cluster.drain import drain_worker
    from cluster.launch import deploy, shutdown

    longest = -(-(max(len(p) for p in prompts) + args.output_len) // 16)  # blocks
    config = CleaveConfig.parse(app_config(model, len(prompts) * longest + 64))
    started_ray = deploy(config, num_cpus=8)
    streams = [Stream() for _ in prompts]
    url = f"http://127.0.0.1:{config.router.http_port}/v1/completions"

    async def load(max_tokens: int, outs: list[Stream]) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
            await asyncio.gather(*(stream_completion(client, url, MODEL_NAME, p, max_tokens, s)
                                   for p, s in zip(prompts, outs)))

    thread = threading.Thread(target=lambda: asyncio.run(load(args.output_len, streams)),
                              daemon=True)
    try:
        first, second = _workers()
        _directory().set_draining.remote(second.worker_id).result(timeout_s=30)
        time.sleep(1.0)  # the router's next directory sync (every 0.25 s) sees it
        warm = [Stream() for _ in prompts]
        asyncio.run(load(1, warm))  # every prompt cached on the first worker
        if any(w.error for w in warm):
            raise RuntimeError(f"warming the cache failed: {[w.error for w in warm][:3]}")
        thread.start()
        wait_started(streams, thread, args.warm_tokens, 3600)
        _directory().undrain.remote(second.worker_id).result(timeout_s=30)
        time.sleep(0.5)  # back in the router's rotation
        warmed = time.perf_counter()
        time.sleep(args.steady_s)
        running = _stats(first).num_running
        computed_before = _stats(second).num_prompt_tokens_computed
        start = time.perf_counter()
        drain_worker(first.worker_id, timeout_s=3600, with_kv=with_kv, restart=False)
        thread.join(3600)
        recomputed = _stats(second).num_prompt_tokens_computed - computed_before
    finally:
        shutdown(started_ray)
    return {"moved_from": first.worker_id, "running_on_it": running,
            **summarize(streams, warmed, start), "recomputed_tokens": recomputed}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--min-context", type=int, default=1024)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warm-tokens", type=int, default=16)
    p.add_argument("--steady-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "drain_ray.json"))
    args = p.parse_args(argv)
    os.environ.pop("RAY_ADDRESS", None)  # a Ray of its own
    prompts, live, replay = both_modes(args, run_mode)
    result = {
        "benchmark": "drain_ray", "command": command_line(argv), **code_state(),
        "setup": {**setup(args, prompts),
                  "server": "the Ray app (2 aggregated replicas, 1 router) in this process's "
                            "local Ray; the prompts cached on the first before the streams"},
        **compare(live, replay)}
    return emit(result, args.out)


if __name__ == "__main__":
    main()
