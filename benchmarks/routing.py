"""Routing policies on a simulated multi-tenant, shared-prefix chat workload: no models.

Four workers, each a real engine-side scheduler and paged KV cache from `workers/` (the prefix
cache, eviction and KV events are the engine's own), stepped by a discrete-event simulation
whose clock comes from a COST MODEL, not from running a model:

    step time = 4 ms + 50 us x prefill tokens in the step + 0.2 ms x decoding sequences

So TTFT and throughput below are SIMULATED figures of that cost model; the prefix-hit rates are
what the real block pools achieved under each policy's placement. `routing_engines.py` runs the
same comparison on real engines (model forward passes, wall-clock TTFT) at a smaller scale.

Workload: 32 tenants' system prompts of 1-2k tokens with Zipf popularity; conversations arrive
as a Poisson process, each 2-6 turns (user message 32-256 tokens, reply 32-160 tokens, think
time ~ exp(2 s)); each turn's prompt is the system prompt plus the whole conversation so far.
The router's `PrefixIndex` is fed the workers' KV events after every step.

Policies compared in one run: `prefix_aware`, `least_loaded`, `round_robin`, and an oracle
that sends every request to the worker whose cache (the truth, not the index) holds the longest
prefix, ignoring load (ties to the least loaded). Targets: prefix_aware hit rate >= 90% of the
oracle's, TTFT p90 >= 3x better than round robin. Run at a moderate and a heavy arrival rate;
the top-level ratios are the worse of the levels.

Last line: one JSON object; also written to benchmarks/results/ with the command.
"""

from __future__ import annotations

import argparse
import heapq
import random
import time
from dataclasses import dataclass, field

from results_io import RESULTS, command_line, emit

from router.policy import Decision, WorkerLoad, get_policy
from router.prefix_index import PrefixIndex
from workers.engine.kv_cache import KVCacheManager
from workers.contract.protocol import SamplingParams
from workers.contract.prefix_cache import hash_prompt_blocks
from workers.engine.request import Request, RequestStatus
from workers.engine.scheduler import Scheduler
from workers.engine.scheduler_records import SchedulerConfig, SchedulerOutput

BLOCK_SIZE = 16
STEP_S, PREFILL_S_PER_TOKEN, DECODE_S_PER_SEQ = 4e-3, 50e-6, 0.2e-3  # the cost model
VOCAB = 32000


@dataclass
class Conversation:
    system: list[int]
    turns: list[tuple[list[int], int]]  # (user message tokens, reply length)
    history: list[int] = field(default_factory=list)  # everything after the system prompt
    next_turn: int = 0


def make_conversations(rng: random.Random, n: int, num_tenants: int) -> list[Conversation]:
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(1024, 2048))]
               for _ in range(num_tenants)]
    weights = [1.0 / (rank + 1) ** 0.8 for rank in range(num_tenants)]  # Zipf tenants
    return [Conversation(rng.choices(systems, weights)[0],
                         [([rng.randrange(VOCAB) for _ in range(rng.randint(32, 256))],
                           rng.randint(32, 160)) for _ in range(rng.randint(2, 6))])
            for _ in range(n)]


def cached_prefix(sched: Scheduler, hashes: list[int]) -> int:
    """How many leading blocks the worker's real prefix cache holds."""
    for depth, block_hash in enumerate(hashes):
        if sched.kv.pool.lookup(block_hash) is None:
            return depth
    return len(hashes)


class Simulation:
    """Four engines on one simulated clock; `route` is the policy under test."""

    def __init__(self, policy: str, convs: list[Conversation], arrivals: list[float],
                 num_blocks: int, seed: int) -> None:
        self.policy_name = policy
        self.policy = None if policy == "oracle" else get_policy(policy)
        self.convs = convs
        self.rng = random.Random(seed)
        self.index = PrefixIndex()
        self.scheds = {f"w{i}": Scheduler(SchedulerConfig(64, 2048, 16384),
                                          KVCacheManager(num_blocks, BLOCK_SIZE))
                       for i in range(4)}
        self.busy: dict[str, SchedulerOutput | None] = dict.fromkeys(self.scheds)
        self.events: list[tuple[float, int, str, object]] = []
        self.counter = 0
        self.arrival: dict[str, float] = {}  # request id -> arrival time
        self.conv_of: dict[str, int] = {}  # request id -> conversation
        self.ttft: list[float] = []
        self.prompt_tokens = self.cached_tokens = self.available_blocks = self.hit_blocks = 0
        self.output_tokens = 0
        self.finished_at = 0.0
        for i, at in enumerate(arrivals):
            self.push(at, "arrive", i)

    def push(self, at: float, kind: str, payload: object) -> None:
        self.counter += 1
        heapq.heappush(self.events, (at, self.counter, kind, payload))

    def loads(self) -> list[WorkerLoad]:
        return [WorkerLoad(w, len(s.waiting), len(s.running), s.kv.usage)
                for w, s in self.scheds.items()]

    def route(self, hashes: list[int]) -> Decision:
        if self.policy is not None:
            return self.policy.choose(hashes, self.loads(), self.index)
        best = max(self.scheds.items(), key=lambda item: (
            cached_prefix(item[1], hashes), -item[1].num_unfinished, item[0]))
        return Decision(best[0], cached_prefix(best[1], hashes))

    def arrive(self, now: float, conv_id: int) -> None:
        conv = self.convs[conv_id]
        user, reply_len = conv.turns[conv.next_turn]
        conv.history += user
        prompt = conv.system + conv.history
        hashes = hash_prompt_blocks(prompt, BLOCK_SIZE)
        worker = self.route(hashes).worker_id
        self.available_blocks += max(cached_prefix(s, hashes) for s in self.scheds.values())
        self.hit_blocks += cached_prefix(self.scheds[worker], hashes)
        rid = f"c{conv_id}-t{conv.next_turn}"
        req = Request(rid, prompt, SamplingParams(max_tokens=reply_len, ignore_eos=True),
                      frozenset(), arrival_time=now)
        req.block_hashes = hashes  # the engine would compute the same chain again
        self.conv_of[rid] = conv_id
        self.arrival[rid] = now
        self.scheds[worker].add(req)
        self.prompt_tokens += len(prompt)
        self.start_step(now, worker)

    def start_step(self, now: float, worker: str) -> None:
        sched = self.scheds[worker]
        if self.busy[worker] is not None or not sched.num_unfinished:
            return
        out = sched.schedule()
        if out.is_empty:
            raise RuntimeError(f"{worker} cannot schedule {sched.num_unfinished} requests: "
                               f"raise --num-blocks")
        prefill = sum(c.num_tokens for c in out.chunks if c.num_tokens > 1)
        self.busy[worker] = out
        self.push(now + STEP_S + PREFILL_S_PER_TOKEN * prefill
                  + DECODE_S_PER_SEQ * out.num_decodes, "step_done", worker)

    def step_done(self, now: float, worker: str) -> None:
        sched, out = self.scheds[worker], self.busy[worker]
        self.busy[worker] = None
        sampled = {c.request.request_id: self.rng.randrange(1, VOCAB)
                   for c in out.chunks if c.samples}
        for req in sched.update(out, sampled):
            if req.num_output_tokens == 1:
                self.ttft.append(now - self.arrival[req.request_id])
                self.cached_tokens += req.num_cached_tokens
            if req.status is RequestStatus.FINISHED:
                self.finish(now, req)
        self.index.apply(worker, sched.kv.events.drain())
        self.start_step(now, worker)

    def finish(self, now: float, req: Request) -> None:
        conv_id = self.conv_of[req.request_id]
        conv = self.convs[conv_id]
        conv.history += req.output_token_ids
        conv.next_turn += 1
        self.output_tokens += req.num_output_tokens
        self.finished_at = now
        if conv.next_turn < len(conv.turns):
            self.push(now + self.rng.expovariate(0.5), "arrive", conv_id)

    def run(self) -> dict:
        wall = time.perf_counter()
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self.arrive(now, payload)
            else:
                self.step_done(now, payload)
        ttft = sorted(self.ttft)
        pct = lambda q: round(ttft[min(len(ttft) - 1, int(q * len(ttft)))], 4)
        return {"requests": len(ttft),
                "hit_rate": round(self.cached_tokens / self.prompt_tokens, 4),
                "hit_blocks_vs_best_available_ratio": round(
                    self.hit_blocks / max(self.available_blocks, 1), 4),
                "ttft_p50_s": pct(0.5), "ttft_p90_s": pct(0.9), "ttft_p99_s": pct(0.99),
                "throughput_req_per_s": round(len(ttft) / self.finished_at, 2),
                "throughput_output_tok_per_s": round(self.output_tokens / self.finished_at, 1),
                "makespan_s": round(self.finished_at, 2),
                "wall_s": round(time.perf_counter() - wall, 1)}


def ratios(results: dict[str, dict]) -> dict[str, float]:
    pa, rr = results["prefix_aware"], results["round_robin"]
    return {
        "prefix_aware_hit_rate_vs_oracle_ratio": round(
            pa["hit_rate"] / results["oracle"]["hit_rate"], 3),
        "prefix_aware_ttft_p90_vs_round_robin_ratio": round(rr["ttft_p90_s"] / pa["ttft_p90_s"], 2),
        "prefix_aware_ttft_p90_vs_least_loaded_ratio": round(
            results["least_loaded"]["ttft_p90_s"] / pa["ttft_p90_s"], 2),
        "prefix_aware_throughput_vs_round_robin_ratio": round(
            pa["throughput_output_tok_per_s"] / rr["throughput_output_tok_per_s"], 3),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=600)
    parser.add_argument("--conv-per-s", type=float, nargs="+", default=[10.0, 20.0],
                        help="conversation arrival rates to run (a moderate and a heavy load)")
    parser.add_argument("--tenants", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=3000, help="KV blocks per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "routing.json"))
    args = parser.parse_args(argv)

    loads = {}
    for rate in args.conv_per_s:
        results = {}
        for policy in ("prefix_aware", "least_loaded", "round_robin", "oracle"):
            rng = random.Random(args.seed)  # the same workload for every policy
            convs = make_conversations(rng, args.conversations, args.tenants)
            at, arrivals = 0.0, []
            for _ in convs:
                at += rng.expovariate(rate)
                arrivals.append(at)
            results[policy] = Simulation(policy, convs, arrivals, args.num_blocks,
                                         args.seed).run()
            print(f"{rate:g} conv/s", policy, results[policy], flush=True)
        loads[f"{rate:g}_conv_per_s"] = {"policies": results, **ratios(results)}

    result = {
        "benchmark": "routing",
        "note": "TTFT and throughput are SIMULATED by a cost model (no model runs): step time = "
                f"{STEP_S * 1e3:g} ms + {PREFILL_S_PER_TOKEN * 1e6:g} us/prefill token + "
                f"{DECODE_S_PER_SEQ * 1e3:g} ms/decoding sequence; hit rates come from the "
                "engines' real block pools. Throughput is requests (output tokens) finished over "
                "the makespan of an open-loop arrival process, so it only separates the "
                "policies once some of them saturate.",
        "setup": {"workers": 4, "num_blocks_per_worker": args.num_blocks,
                  "block_size": BLOCK_SIZE, "tenants": args.tenants,
                  "system_prompt_tokens": "1024-2048", "conversations": args.conversations,
                  "turns": "2-6", "max_num_seqs": 64, "max_num_batched_tokens": 2048},
        "targets": {"hit_rate_vs_oracle": 0.9, "ttft_p90_vs_round_robin": 3.0},
        "loads": loads,
        # headline: the worst case over the load levels
        **{key: min(level[key] for level in loads.values())
           for key in next(iter(loads.values())) if key.endswith("_ratio")},
        "command": command_line(argv),
    }
    return emit(result, args.out)


if __name__ == "__main__":
    main()
