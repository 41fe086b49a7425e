"""Fault-injection soak: the Cleave application on a local Ray (two prefill and two decode
replicas of the tiny model, fractional CPUs) under a seeded mixed workload while a seeded
schedule injects faults. Bounded in time and in count.

    python benchmarks/soak.py                      # 10 minutes, >= 2,000 requests, >= 100 faults
    python benchmarks/soak.py --duration-s 60 --quick   # the deterministic subset `make test` runs
                                                        # (ends once its faults are done)

Before any fault, every distinct request is sent once to take its reference output. During the
run each request ends as: `ok` (its output equals the reference: greedy and seeded outputs are
path-independent), `wrong` (it differs: tokens lost, duplicated or mixed), `refused` (429/503
with an OpenAI-shaped error, or gRPC RESOURCE_EXHAUSTED/UNAVAILABLE), `unavailable` (no
connection: a router replica restarting), `cancelled` (the client ended it on purpose),
`error` (anything else) or `hung` (no end within its deadline). After the run: every worker
idle with all KV blocks free and no lease outstanding, engine actors = replicas, no new
shared-memory files, the router's memory against its post-warm-up level, and no Ray process
left once Ray is shut down. The last line is the JSON kept in benchmarks/results/soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["CLEAVE_FAULT_INJECTION"] = "1"  # before Ray starts: its workers inherit it
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# a Ray temp folder of its own (short: Ray puts unix sockets under it), so the processes this
# soak's Ray starts can be told from any other Ray on the machine when checking none is left
os.environ["RAY_TMPDIR"] = RAY_TMPDIR = tempfile.mkdtemp(prefix="soak-", dir="/tmp")
os.environ.pop("RAY_ADDRESS", None)

from results_io import RESULTS, command_line, emit  # noqa: E402
from serving_ray import free_ports  # noqa: E402
from soak_checks import (  # noqa: E402
    MemoryWatch,
    alive_actors,
    leases_outstanding,
    refusal_reason,
    router_in_flight,
    settle,
    shm_files,
)
from soak_faults import INPUT_FAULTS, SERVER_FAULTS, Cluster, Injected, send_bad_input  # noqa: E402
from soak_workload import (  # noqa: E402
    Clients,
    Outcome,
    Spec,
    Variant,
    make_specs,
    send,
    with_stop,
)

API_KEY = "soak-key"
MODEL = "tiny"
PULL_TIMEOUT_S = 3.0
STEP_TIMEOUT_S = 3.0
MAX_BODY_BYTES = 16 * 1024**2


def app_config(model: str, http_port: int, grpc_port: int) -> dict:
    pool = {"cpus_per_rank": 0.25, "replicas": {"min": 2, "max": 2},
            "step_timeout_s": STEP_TIMEOUT_S, "engine": {"num_blocks": 512},
            "autoscaling": {"drain_timeout_s": 15.0}}
    return {"model": {"path": model, "served_model_name": MODEL},
            "pools": {"prefill": dict(pool), "decode": dict(pool)},
            "kv_transfer": {"lease_s": 10.0, "pull_timeout_s": PULL_TIMEOUT_S},
            "router": {"http_port": http_port, "grpc_port": grpc_port, "api_keys": [API_KEY],
                       "disagg_threshold_tokens": 48, "migration_wait_s": 30.0,
                       "max_in_flight": 64}}


def variant_for(spec: Spec, rng: random.Random, fault_share: float) -> Variant:
    stream = spec.api != "grpc" and rng.random() < 0.5
    salt = rng.choice((None, None, "tenant-a", "tenant-b"))
    if rng.random() >= fault_share:
        return Variant(stream=stream, salt=salt)
    if spec.api == "grpc":
        kind = rng.choice(("cancel", "deadline"))
        return Variant(salt=salt, grpc_cancel=kind == "cancel",
                       grpc_deadline_s=0.05 if kind == "deadline" else None)
    return Variant(stream=True, salt=salt, disconnect=rng.choice(("before_first", "mid_stream")))


async def references(clients: Clients, specs: list[Spec]) -> dict[str, list[str]]:
    """Each spec's output before any fault (greedy and stop-string specs derive from it)."""
    refs: dict[str, list[str]] = {}

    async def take(batch: list[Spec]) -> None:
        outs = await asyncio.gather(*(send(clients, s, Variant(), 120.0) for s in batch))
        print(f"soak: {len(refs) + len(outs)} references taken", flush=True)
        for out in outs:
            if out.status != "ok":
                raise RuntimeError(f"reference request failed: {out.status} {out.detail}")
            refs[out.spec.key] = out.texts or []

    for i in range(0, len(specs), 8):
        await take(specs[i:i + 8])
    stops = [s for s in (with_stop(spec, refs[spec.key]) for spec in specs
                         if spec.temperature == 0.0 and spec.n == 1) if s is not None]
    for i in range(0, len(stops), 8):
        await take(stops[i:i + 8])
    print(f"soak: {len(refs)} references ({len(stops)} with a stop string); soaking", flush=True)
    return refs


def judge(out: Outcome, refs: dict[str, list[str]]) -> str:
    if out.status != "ok" or out.variant.on_purpose:
        return out.status
    if out.texts == refs[out.spec.key]:
        return "ok"
    out.detail = f"got {out.texts!r}, expected {refs[out.spec.key]!r}"
    return "wrong"


REFUSED = ("refused", "unavailable")
BACKOFF_S = 0.5  # a client told to come back later (429, 503, no connection) waits this long


async def soak(clients: Clients, cluster: Cluster, refs: dict[str, list[str]], specs: list[Spec],
               args: argparse.Namespace) -> tuple[list[tuple[str, Outcome]], list[Injected]]:
    rng = random.Random(args.seed)
    results: list[tuple[str, Outcome]] = []
    injected: list[Injected] = []
    start = time.monotonic()
    end = [start + args.duration_s]  # --quick moves it up once its schedule is done

    def more() -> bool:
        return time.monotonic() < end[0] and len(results) < args.max_requests

    async def client_loop(k: int) -> None:
        crng = random.Random(args.seed * 1000 + k)
        while more():
            spec = crng.choice(specs)
            if spec.api == "grpc" and crng.random() < 0.05:  # two requests, one client id
                both = await asyncio.gather(*(send(clients, spec, Variant(request_id="dup"),
                                                   args.deadline_s) for _ in range(2)))
                verdicts = [judge(o, refs) for o in both]
                results.extend(zip(verdicts, both))
                injected.append(Injected("duplicate_ids", "grpc", all(
                    v in ("ok", *REFUSED) for v in verdicts), "; ".join(
                    f"{v}: {o.detail}" for v, o in zip(verdicts, both))))
                continue
            variant = variant_for(spec, crng, args.client_fault_share)
            out = await send(clients, spec, variant, args.deadline_s)
            verdict = judge(out, refs)
            results.append((verdict, out))
            if verdict in REFUSED:
                await asyncio.sleep(BACKOFF_S)
            if variant.on_purpose:
                kind = variant.disconnect or ("grpc_cancel" if variant.grpc_cancel
                                              else "grpc_deadline")
                injected.append(Injected(f"client_{kind}", spec.api))

    async def inject(fault: str) -> None:
        try:
            if fault in INPUT_FAULTS:
                inj = await send_bad_input(clients.http, fault, MODEL, MAX_BODY_BYTES)
            else:
                inj = await asyncio.to_thread(cluster.inject, fault, rng)
        except Exception as exc:  # noqa: BLE001 -- reported
            # a server fault whose target died while it was being armed was not injected;
            # a front door that stayed shut past the retries is a fault not handled
            inj = Injected(fault, "-", False, repr(exc)[:200],
                           skipped=fault not in INPUT_FAULTS)
        injected.append(inj)
        print(f"soak: {time.monotonic() - start:6.1f}s {inj.fault} on {inj.target}"
              f"{'' if inj.ok else ' FAILED: ' + inj.detail}", flush=True)

    async def pause() -> bool:
        await asyncio.sleep(min(args.fault_interval_s, max(0.0, end[0] - time.monotonic())))
        return more()

    async def fault_loop() -> None:
        if args.quick:  # each server fault once, in order, every input fault, one more interval
            for fault in SERVER_FAULTS:
                if not await pause():
                    return
                await inject(fault)
            if not await pause():
                return
            for fault in INPUT_FAULTS:  # requests, not restarts: nothing to wait between them
                await inject(fault)
            await pause()  # traffic goes on after the last fault, then the run ends
            end[0] = min(end[0], time.monotonic())
            return
        while await pause():
            await inject(rng.choice(SERVER_FAULTS + INPUT_FAULTS))

    await asyncio.gather(fault_loop(), *(client_loop(k) for k in range(args.concurrency)))
    return results, injected


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--max-requests", type=int, default=100_000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--fault-interval-s", type=float, default=4.0)
    p.add_argument("--client-fault-share", type=float, default=0.03)
    p.add_argument("--deadline-s", type=float, default=90.0, help="per request: past it, hung")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="each server fault once, in a fixed order, then every input fault; "
                        "ends one fault interval after the last (or at --duration-s)")
    p.add_argument("--model", default=None, help="default: the embedded tiny model")
    p.add_argument("--out", default=str(RESULTS / "soak.json"))
    return p.parse_args(argv)


async def drive(args: argparse.Namespace, cluster: Cluster, http_port: int,
                grpc_port: int) -> dict:
    """References, baselines, the soak, then the checks on what it left behind."""
    clients = Clients(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", MODEL, API_KEY)
    try:
        specs = make_specs(random.Random(args.seed), args.prompts)
        refs = await references(clients, specs)
        specs = specs + [
            s for s in (with_stop(sp, refs[sp.key]) for sp in specs
                        if sp.temperature == 0.0 and sp.n == 1) if s is not None]
        shm_before = shm_files()
        memory = MemoryWatch()
        watching = asyncio.get_running_loop().create_task(memory.watch())
        started = time.monotonic()
        try:
            results, injected = await soak(clients, cluster, refs, specs, args)
        finally:
            watching.cancel()
        seconds = time.monotonic() - started
    finally:
        await clients.close()
    workers = await asyncio.to_thread(settle, cluster, 4, 120.0)
    in_flight = await router_in_flight(f"http://127.0.0.1:{http_port}", API_KEY)
    await asyncio.to_thread(memory.sample)
    summary = judge_summary(results, injected)
    leases = await asyncio.to_thread(leases_outstanding, cluster)
    return {**summary, "seconds": round(seconds, 1), "distinct_requests": len(refs),
            "workers_settled": {w: {k: s[k] for k in ("num_free_blocks", "num_blocks",
                                                      "num_running", "num_waiting")}
                                for w, s in workers.items()},
            "blocks_leaked": sum(s["num_blocks"] - s["num_free_blocks"]
                                 for s in workers.values()),
            "leases_outstanding": sum(max(0, n) for n in leases.values()),
            "engine_actors_alive": alive_actors("EngineActor"),
            "shm_files_left": sorted(shm_files() - shm_before),
            "router_slots_held_after": in_flight,
            **memory.report()}


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    from serving_ray import ray_processes

    from cluster.config import CleaveConfig
    from cluster.launch import deploy, shutdown
    from workers.models.make_model import default_model_path

    model = args.model or str(default_model_path())
    http_port, grpc_port = free_ports(2)
    config = CleaveConfig.parse(app_config(model, http_port, grpc_port))
    started_ray = deploy(config, num_cpus=8)
    import ray

    # the state API (actors, replicas) finds "the" Ray by itself, and fails when another one
    # runs on this machine: name this soak's own
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    try:
        result = asyncio.run(drive(args, Cluster(PULL_TIMEOUT_S, STEP_TIMEOUT_S), http_port,
                                   grpc_port))
    finally:
        stop_started = time.monotonic()
        shutdown(started_ray)
    time.sleep(2.0)
    result["shutdown_s"] = round(time.monotonic() - stop_started, 1)
    result["ray_processes_left"] = len(ray_processes(RAY_TMPDIR))
    if not result["ray_processes_left"]:  # else kept: their logs are there
        shutil.rmtree(RAY_TMPDIR, ignore_errors=True)
    result["command"] = command_line(argv)
    return emit(result, args.out)


def judge_summary(results: list[tuple[str, Outcome]], injected: list[Injected]) -> dict:
    by_outcome = collections.Counter(verdict for verdict, _ in results)
    done = [i for i in injected if not i.skipped]
    failed_injections = [f"{i.fault}: {i.detail}" for i in done if not i.ok]
    wrong = [f"{verdict} {dataclasses.replace(o.spec, prompt=o.spec.prompt[:24] + '...')}, "
             f"{o.variant}: {o.detail}"
             for verdict, o in results if verdict in ("wrong", "error", "hung")][:10]
    reasons = collections.Counter(f"{verdict} {refusal_reason(o.detail)}"
                                  for verdict, o in results if verdict in REFUSED)
    return {"requests": len(results), "by_outcome": dict(sorted(by_outcome.items())),
            "refusals_by_reason": dict(reasons.most_common()),
            "faults": len(done),
            "faults_by_kind": dict(sorted(collections.Counter(i.fault for i in done).items())),
            "faults_skipped": [f"{i.fault}: {i.detail}" for i in injected if i.skipped][:20],
            "faults_not_handled": failed_injections[:20], "examples_of_failures": wrong}


if __name__ == "__main__":
    main()
