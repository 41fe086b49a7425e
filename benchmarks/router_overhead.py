"""What one routing decision costs the router: hash the prompt's blocks, match, choose.

Setup: a prefix index of 100k distinct blocks over 16 workers, built from `BlockStored` events
(64 shared 2k-token "system prompts" held by 2-4 workers each, plus private conversation
chains). Each decision takes a 2k-token prompt (128 blocks at block size 16: a known system
prompt with a fresh tail, or a wholly new prompt), hashes its full blocks, and asks the
`prefix_aware` policy to choose among 16 workers with varied loads. Pinned to one core when the
OS allows it.

Then the router's own routing step with loads and KV events pushed (`router_pushed.py`): a
`WorkerSet` over 16 and 1,000 simulated workers, each reporting every `--report-interval-s`,
the reports delivered between decisions; decisions/s counts the reports' cost too, and every
call the router makes to a worker during the decisions is counted (target: none).

Compared against the targets (5,000 decisions/s, p99 <= 1 ms) and, for hashing, against
`workers.contract.protocol.hash_prompt_blocks` (the reference the router's faster equivalent must equal).

Last line: one JSON object; also written to benchmarks/results/ with the command.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time

from results_io import RESULTS, command_line, emit

from router.policy import WorkerLoad, get_policy
from router.prefix_index import PrefixIndex
from workers.contract.prefix_cache import BlockStored, hash_prompt_blocks

BLOCK_SIZE = 16
TARGET_DECISIONS_PER_S = 5000.0
TARGET_P99_S = 1e-3


def pin_to_one_core() -> str:
    if hasattr(os, "sched_setaffinity"):
        core = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})
        return f"core {core}"
    return "not pinned (no sched_setaffinity)"


def build_index(rng: random.Random, num_workers: int, num_blocks: int,
                system_prompts: list[list[int]]) -> PrefixIndex:
    """Shared system prompts on 2-4 workers each, then private chains up to `num_blocks`."""
    index = PrefixIndex()
    workers = [f"worker-{i:02d}" for i in range(num_workers)]
    seqs = dict.fromkeys(workers, 0)

    def store(worker: str, hashes: list[int]) -> None:
        event = BlockStored("epoch-" + worker, seqs[worker], tuple(hashes), None, (), BLOCK_SIZE)
        index.apply(worker, [event])
        seqs[worker] += 1

    for prompt in system_prompts:
        hashes = hash_prompt_blocks(prompt, BLOCK_SIZE)
        for worker in rng.sample(workers, rng.randint(2, 4)):
            store(worker, hashes)
    while index.num_blocks < num_blocks:
        length = min(rng.randint(8, 128), num_blocks - index.num_blocks)
        store(rng.choice(workers), [rng.getrandbits(63) for _ in range(length)])
    return index


def make_prompts(rng: random.Random, system_prompts: list[list[int]], n: int,
                 num_tokens: int) -> list[list[int]]:
    """Nine in ten start with a known system prompt (cut to 1-2k tokens); the rest are new."""
    prompts = []
    for _ in range(n):
        head = rng.choice(system_prompts)[:rng.randint(1024, num_tokens)] if rng.random() < 0.9 \
            else []
        prompts.append(head + [rng.randrange(32000) for _ in range(num_tokens - len(head))])
    return prompts


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def time_each(fn, items: list) -> list[float]:
    out = []
    clock = time.perf_counter
    for item in items:
        start = clock()
        fn(item)
        out.append(clock() - start)
    return sorted(out)


def summary_us(latencies: list[float]) -> dict:
    return {"mean_us": round(sum(latencies) / len(latencies) * 1e6, 1),
            "p50_us": round(percentile(latencies, 0.5) * 1e6, 1),
            "p99_us": round(percentile(latencies, 0.99) * 1e6, 1)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--index-blocks", type=int, default=100_000)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pushed-workers", default="16,1000",
                        help="worker counts of the served-path runs (router_pushed.py)")
    parser.add_argument("--report-interval-s", type=float, default=0.1,
                        help="each simulated worker reports its load and KV events this often")
    parser.add_argument("--out", default=str(RESULTS / "router_overhead.json"))
    args = parser.parse_args(argv)

    pinned = pin_to_one_core()
    rng = random.Random(args.seed)
    system_prompts = [[rng.randrange(32000) for _ in range(2048)] for _ in range(64)]
    start = time.perf_counter()
    index = build_index(rng, args.workers, args.index_blocks, system_prompts)
    build_s = time.perf_counter() - start
    prompts = make_prompts(rng, system_prompts, args.decisions, args.prompt_tokens)
    loads = [[WorkerLoad(w, rng.randint(0, 8), rng.randint(0, 64), rng.random())
              for w in index.workers()] for _ in range(64)]
    policy = get_policy("prefix_aware")
    hashes = [hash_prompt_blocks(p, BLOCK_SIZE) for p in prompts]
    gc.collect()
    gc.freeze()  # the index is long-lived: keep the collector from rescanning it

    def decide(i: int) -> None:
        policy.choose(hash_prompt_blocks(prompts[i], BLOCK_SIZE), loads[i % 64], index)

    ids = list(range(len(prompts)))
    time_each(decide, ids[:200])  # warm-up
    decide_lat = time_each(decide, ids)
    total_s = sum(decide_lat)
    hash_lat = time_each(lambda p: hash_prompt_blocks(p, BLOCK_SIZE), prompts)
    ref_hash_lat = time_each(lambda p: hash_prompt_blocks(p, BLOCK_SIZE), prompts[:1000])
    match_lat = time_each(index.match, hashes)
    choose_lat = time_each(lambda i: policy.choose(hashes[i], loads[i % 64], index), ids)
    hit_depths = [max(index.match(h).values(), default=0) for h in hashes[:1000]]

    decisions_per_s = len(ids) / total_s
    p99 = percentile(decide_lat, 0.99)
    ref_decision_s = sum(ref_hash_lat) / len(ref_hash_lat) + sum(choose_lat) / len(choose_lat)
    result = {
        "benchmark": "router_overhead",
        "setup": {"workers": args.workers, "index_blocks": index.num_blocks,
                  "prompt_tokens": args.prompt_tokens, "block_size": BLOCK_SIZE,
                  "blocks_per_prompt": len(hashes[0]), "decisions": len(ids),
                  "policy": "prefix_aware", "cpu": pinned, "index_build_s": round(build_s, 2),
                  "mean_matched_blocks": round(sum(hit_depths) / len(hit_depths), 1)},
        "decision": {**summary_us(decide_lat), "decisions_per_s": round(decisions_per_s)},
        "hash_router_fast": summary_us(hash_lat),
        "hash_protocol_reference": summary_us(ref_hash_lat),
        "match": summary_us(match_lat),
        "match_and_choose": summary_us(choose_lat),
        "targets": {"decisions_per_s": TARGET_DECISIONS_PER_S, "p99_us": TARGET_P99_S * 1e6},
        "decisions_per_s_vs_target_ratio": round(decisions_per_s / TARGET_DECISIONS_PER_S, 3),
        "p99_bound_ratio": round(TARGET_P99_S / p99, 3),
        "hash_share_of_decision_ratio": round(sum(hash_lat) / total_s, 3),
        "decisions_per_s_with_reference_hash_vs_target_ratio": round(
            1.0 / ref_decision_s / TARGET_DECISIONS_PER_S, 3),
        "fast_vs_reference_hash_speedup_ratio": round(sum(ref_hash_lat) / len(ref_hash_lat)
                                                      / (sum(hash_lat) / len(hash_lat)), 2),
        "match_p99_bound_ratio": round(TARGET_P99_S / percentile(match_lat, 0.99), 1),
        "command": command_line(argv),
    }
    result["pushed"] = pushed(args, system_prompts, prompts)
    for n, row in result["pushed"].items():
        result[f"pushed_{n}_workers_decisions_per_s_vs_target_ratio"] = round(
            row["decisions_per_s_with_reports"] / TARGET_DECISIONS_PER_S, 3)
        result[f"pushed_{n}_workers_p99_bound_ratio"] = round(
            TARGET_P99_S * 1e6 / row["decision"]["p99_us"], 3)
    print(f"decision: {result['decision']}  (targets: {TARGET_DECISIONS_PER_S:.0f}/s, p99 1 ms)")
    print(f"hash (router fast): {result['hash_router_fast']}  "
          f"reference: {result['hash_protocol_reference']}")
    print(f"match: {result['match']}  match+choose: {result['match_and_choose']}")
    return emit(result, args.out)


def pushed(args: argparse.Namespace, system_prompts: list[list[int]],
           prompts: list[list[int]]) -> dict:
    """The router's routing step over pushed loads and events, per worker count."""
    from router_pushed import run

    out = {}
    for n in (int(x) for x in args.pushed_workers.split(",")):
        gc.unfreeze()
        gc.collect()
        r = run(n, BLOCK_SIZE, system_prompts, args.index_blocks, prompts,
                TARGET_DECISIONS_PER_S, args.report_interval_s, args.seed, time.perf_counter)
        decision_s = sum(r["decisions"]) / len(r["decisions"])
        report_s = sum(r["reports"]) / max(len(r["reports"]), 1)
        per_decision = r["reports_per_decision"]
        out[str(n)] = {
            "decision": summary_us(r["decisions"]),
            "report": summary_us(r["reports"]) if r["reports"] else None,
            "reports_per_decision": round(per_decision, 2),
            "decisions_per_s_with_reports": round(1.0 / (decision_s + per_decision * report_s)),
            "worker_calls_per_decision": sum(r["calls"].values()) / len(r["decisions"]),
            "worker_calls_by_method": r["calls"],
        }
        print(f"pushed, {n} workers: {out[str(n)]}")
    return out


if __name__ == "__main__":
    main()
