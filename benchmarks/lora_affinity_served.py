"""Adapter-affinity routing against round robin on the SERVED system (issue 50's "4 workers,
16 adapters, 4 slots each"): `cleave serve --in-process --process-per-worker` with four
aggregated workers, each with `max_loras` 4 device slots and all 16 rank-16 adapters (attention
and MLP) on the host, driven by the load generator over HTTP (`loadgen.run_load`: streamed
completions, each naming its adapter as its `model`). `lora_affinity.py` is the simulation of
the same question at set step costs; this one measures.

Measured per router policy (`prefix_aware`, which prices a worker lacking the adapter at
`lora_load_cost_blocks`, and `round_robin`, blind to adapters), on the same requests (same seed,
same arrival times), a fresh server each: adapter copies into the workers' slots per 1,000
requests (the workers' `cleave_worker_lora_adapter_loads` counters on `/metrics`, after the
run less before it), TTFT p50/p90 (client wall clock, routing included), output tokens/s.

Model: the embedded `tiny` preset's shape (random weights): a step costs little, so what differs
is what the engines' schedulers do with the adapters they are sent: a request whose adapter is
not among the running requests' and finds the slots full waits (`scheduler_records
.adapter_fits`), and each adapter brought into a slot is a copy from host memory (cheap here,
a host-to-device copy on a GPU). Requests: Poisson arrivals at `--rate`/s, adapters uniform or
Zipf (exponent 1.1) over the 16, prompts of 32-96 random tokens, 16-48 tokens out (EOS ignored).

    python benchmarks/lora_affinity_served.py [--requests 400] [--rate 20]

Last line: JSON with, per distribution, `<dist>_loads_per_1k_ratio` and `<dist>_ttft_p90_ratio`
(affinity / round robin: lower is better).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
from pathlib import Path
from typing import Any

import httpx
import yaml
from loadgen import RequestSpec, percentiles_ms, run_load
from local_app import LocalApp
from prometheus_client.parser import text_string_to_metric_families
from results_io import RESULTS, command_line, emit

NUM_WORKERS, NUM_ADAPTERS, SLOTS, RANK = 4, 16, 4, 16
POLICIES = ("prefix_aware", "round_robin")
LOADS = "cleave_worker_lora_adapter_loads"


def adapter_config(folders: dict[str, Path], policy: str) -> dict:
    engine = {"enable_lora": True, "max_loras": SLOTS, "max_lora_rank": RANK,
              "lora_modules": [f"{n}={f}" for n, f in folders.items()]}
    pool = {"cpus_per_rank": 1, "engine": engine,
            "replicas": {"min": NUM_WORKERS, "max": NUM_WORKERS, "initial": NUM_WORKERS}}
    return {"pools": {"aggregated": pool}, "router": {"policy": policy}}


def requests(n: int, dist: str, vocab: int, seed: int) -> list[RequestSpec]:
    rng = random.Random(seed)
    weights = ([1.0] * NUM_ADAPTERS if dist == "uniform"
               else [1 / (k + 1) ** 1.1 for k in range(NUM_ADAPTERS)])
    names = rng.choices([f"a{k}" for k in range(NUM_ADAPTERS)], weights, k=n)
    return [RequestSpec([rng.randrange(10, vocab) for _ in range(rng.randint(32, 96))],
                        rng.randint(16, 48), extra={"model": name}) for name in names]


def adapter_loads(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == LOADS
               for s in f.samples if s.name == LOADS + "_total")


def run_policy(model: str, folders: dict[str, Path], policy: str, specs: list[RequestSpec],
               rate: float, seed: int, tmp: Path) -> dict[str, Any]:
    path = tmp / f"{policy}.yaml"
    path.write_text(yaml.safe_dump(adapter_config(folders, policy)))
    app = LocalApp(model, "model", config=str(path), num_workers=NUM_WORKERS).start()
    try:
        before = adapter_loads(app.base_url)
        results, seconds = asyncio.run(run_load(app.base_url, "model", specs, rate, seed=seed))
        loads = adapter_loads(app.base_url) - before
    finally:
        app.stop()
    ok = [r for r in results if r.ok]
    errors = sorted({r.error for r in results if not r.ok})
    return {"requests": len(results), "ok": len(ok), "errors": errors[:3],
            "adapter_loads": loads, "loads_per_1k": round(1000 * loads / len(results), 1),
            "ttft_ms": percentiles_ms([r.ttft_s for r in ok]),
            "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / seconds, 1),
            "seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--dists", nargs="+", default=["uniform", "zipf"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "lora_affinity_served.json"))
    args = parser.parse_args()
    from workers.models.lora.make_adapter import ATTENTION, MLP, make_adapter
    from workers.models.make_model import make_model

    result: dict[str, Any] = {"workers": NUM_WORKERS, "adapters": NUM_ADAPTERS, "slots": SLOTS,
                              "rank": RANK, "requests": args.requests, "rate": args.rate}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        model = make_model(tmp / "tiny", arch="llama", preset="tiny")
        folders = {f"a{k}": make_adapter(model, tmp / f"a{k}", rank=RANK, seed=k,
                                         targets=ATTENTION + MLP)
                   for k in range(NUM_ADAPTERS)}
        vocab = 512  # the tiny preset's
        for dist in args.dists:
            specs = requests(args.requests, dist, vocab, args.seed)
            runs = {p: run_policy(str(model), folders, p, specs, args.rate, args.seed, tmp)
                    for p in POLICIES}
            print(dist, runs, flush=True)
            aff, rr = runs["prefix_aware"], runs["round_robin"]
            result[dist] = runs
            result[f"{dist}_loads_per_1k_ratio"] = round(
                aff["loads_per_1k"] / max(rr["loads_per_1k"], 1e-9), 3)
            result[f"{dist}_ttft_p90_ratio"] = round(
                aff["ttft_ms"]["p90_ms"] / max(rr["ttft_ms"]["p90_ms"], 1e-9), 3)
    result["command"] = command_line(None)
    emit(result, args.out)


if __name__ == "__main__":
    main()
