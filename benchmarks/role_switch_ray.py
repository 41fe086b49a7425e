"""A role switch on the Ray app against a replica start (issue 51: "faster than starting a
replica"), under load, in one run.

Setup: the Cleave application on a local Ray in this process (`cluster.launch.deploy`): one
router replica serving HTTP itself and an aggregated pool of two replicas, each pinned to a core
of `--cores` (the pool's `cpu_affinity`, one torch thread, as `disagg_goodput.py` pins them;
claims in a folder of this run's), the `small` preset. A load thread keeps `--streams` greedy
streamed completions running (`--context` random tokens, `--output-len` out, seeded), each
followed by the next as it ends.

Each of `--rounds` rounds, alternated, under that load:
- switch: the worker with the most running streams goes aggregated -> prefill
  (`cluster.role.switch_worker_role`, as `cleave role` does: its streams move to the other with
  their KV), then, after `--hold-s`, back to aggregated. Timed from the call to its answer (the
  verb's wall time) and by the router (`RoleSwitch.seconds`).
- replica start: one pool replica is killed (`ray.kill`), and timed until the router routes the
  worker of the replica Serve starts in its place (Serve sees the death, starts a replica
  process, loads the model, registers its engine in the directory; the router adds it at its
  next sync). Its streams fail over to the other worker meanwhile.

`switch_vs_replica_start_ratio`: the median switch to prefill (the verb's wall time) over the
median replica start; `switch_back_vs_replica_start_ratio` likewise. The machine may be shared
with other work: the result says so; both sides ran alternated, under the same load.

Last line: one JSON object; also written to benchmarks/results/role_switch_ray.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import threading
import time

import httpx
from drain import Stream, stream_completion
from kv_fetch import long_context_model
from results_io import RESULTS, command_line, emit, sig
from serving_layers import code_state
from serving_ray import free_ports

MODEL_NAME = "small"
ROUTE_TIMEOUT_S = 600.0  # a replacement replica is routed within this, or the run fails


def app_config(model: str, cores: list[int], num_blocks: int) -> dict:
    http, grpc = free_ports(2)
    return {"model": {"path": model, "served_model_name": MODEL_NAME},
            "pools": {"aggregated": {"cpus_per_rank": 1, "cpu_affinity": cores,
                                     "replicas": {"min": 2, "max": 2, "initial": 2},
                                     "engine": {"num_blocks": num_blocks}}},
            "router": {"http_port": http, "grpc_port": grpc, "kv_poll_interval_s": 0.25}}


class Load:
    """`streams` concurrent streamed completions, each followed by the next, until `stop`."""

    def __init__(self, url: str, prompts: list[list[int]], output_len: int) -> None:
        self.url, self.prompts, self.output_len = url, prompts, output_len
        self.done: list[Stream] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _one(self, client: httpx.AsyncClient, lane: int) -> None:
        n = lane
        while not self.stop.is_set():
            s = Stream()
            await stream_completion(client, self.url, MODEL_NAME,
                                    self.prompts[n % len(self.prompts)], self.output_len, s)
            self.done.append(s)
            n += len(self.prompts)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            await asyncio.gather(*(self._one(client, i) for i in range(len(self.prompts))))


def _router():
    from ray import serve

    from cluster.launch import APP_NAME

    return serve.get_deployment_handle("router", app_name=APP_NAME)


def _routed() -> dict[str, int]:
    """Healthy workers the router routes, and their running streams."""
    return {w["worker_id"]: w["num_running"] or 0
            for w in _router().status.remote().result(timeout_s=60)["workers"]
            if w["healthy"] and not w["draining"]}


def switch_round(hold_s: float) -> dict:
    from cluster.role import switch_worker_role

    running = _routed()
    wid = max(running, key=lambda w: running[w])
    t0 = time.perf_counter()
    to_prefill = switch_worker_role(wid, "prefill", timeout_s=600)
    wall = time.perf_counter() - t0
    time.sleep(hold_s)
    t0 = time.perf_counter()
    back = switch_worker_role(wid, "aggregated", timeout_s=600)
    return {"worker": wid, "running_on_it": running[wid], "to_prefill_s": sig(wall),
            "to_prefill_router_s": to_prefill["seconds"],
            "streams_moved": to_prefill["streams_moved"],
            "back_s": sig(time.perf_counter() - t0), "back_router_s": back["seconds"]}


def replica_start_round() -> dict:
    import ray

    before = set(_routed())
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith("SERVE_REPLICA::cleave#pool-aggregated#"))
    t0 = time.perf_counter()
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    deadline = time.monotonic() + ROUTE_TIMEOUT_S
    while not set(_routed()) - before:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no replacement replica routed within {ROUTE_TIMEOUT_S:.0f} s")
        time.sleep(0.1)
    started = time.perf_counter() - t0
    while len(_routed()) < 2:  # the dead one's entry expires; the pool is two again
        time.sleep(0.1)
    return {"replica_start_s": sig(started)}


def run(args: argparse.Namespace) -> dict:
    from cluster.config import CleaveConfig
    from cluster.launch import deploy, shutdown

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["CLEAVE_CPU_CLAIM_DIR"] = os.path.join(tmp, "claims")  # the workers inherit
        model = long_context_model(tmp, args.context + args.output_len + 256)
        from workers.models.model_config import ModelConfig

        vocab = ModelConfig.from_pretrained(model).vocab_size
        prompts = [[rng.randrange(10, vocab) for _ in range(args.context)]
                   for _ in range(args.streams)]
        blocks = args.streams * (-(-(args.context + args.output_len) // 16)) * 2 + 64
        config = CleaveConfig.parse(app_config(model, args.cores, blocks))
        started_ray = deploy(config, num_cpus=8)
        load = Load(f"http://127.0.0.1:{config.router.http_port}/v1/completions", prompts,
                    args.output_len)
        rounds = []
        try:
            load.thread.start()
            time.sleep(args.warm_s)
            for _ in range(args.rounds):
                rounds.append({**switch_round(args.hold_s), **replica_start_round()})
                time.sleep(args.warm_s)
        finally:
            load.stop.set()
            load.thread.join(600)
            shutdown(started_ray)
    return {"rounds": rounds, "streams_completed": sum(not s.error for s in load.done),
            "stream_errors": sorted({s.error for s in load.done if s.error})[:5]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cores", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1])
    p.add_argument("--streams", type=int, default=6)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--output-len", type=int, default=384)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hold-s", type=float, default=2.0, help="seconds a switched worker prefills")
    p.add_argument("--warm-s", type=float, default=3.0, help="load before each round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "role_switch_ray.json"))
    args = p.parse_args(argv)
    os.environ.pop("RAY_ADDRESS", None)  # a Ray of its own
    measured = run(args)
    rounds = measured["rounds"]
    switch = statistics.median(r["to_prefill_s"] for r in rounds)
    back = statistics.median(r["back_s"] for r in rounds)
    start = statistics.median(r["replica_start_s"] for r in rounds)
    result = {
        "benchmark": "role_switch_ray", "command": command_line(argv), **code_state(),
        "setup": {"server": "the Ray app in this process's local Ray: 1 router replica, an "
                            "aggregated pool of 2 replicas, each pinned to one core of "
                            f"{args.cores} (one torch thread); router, Ray and the load "
                            "generator unpinned", "model": "small preset (random weights)",
                  "streams": args.streams, "context": args.context,
                  "output_len": args.output_len, "rounds": args.rounds,
                  "machine": "2 CPU cores shared with other work during the run (timings "
                             "noisy; both sides alternated under the same load)"},
        **measured, "switch_to_prefill_s_median": sig(switch),
        "switch_back_s_median": sig(back), "replica_start_s_median": sig(start),
        "switch_vs_replica_start_ratio": sig(switch / start),
        "switch_back_vs_replica_start_ratio": sig(back / start)}
    return emit(result, args.out)


if __name__ == "__main__":
    main()
