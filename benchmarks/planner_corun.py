"""How much a worker's steps slow while the other worker on the same machine steps too (the two
cores share the memory bus and the last-level cache): `benchmarks/planner_calibrate.py`'s
co-run factor. The Ray app's single-request figures, to which the simulator's profile is
anchored, are taken with the other worker idle; under the trace both step at once.

A neighbour process pinned to one core runs an aggregated worker's mix without pause (4
fresh 128-token prompts, 32 tokens out each, over and over); this process, pinned to the
other core, times a decode step at batch 1 and 4 and a 128-token prefill with the neighbour
stopped (SIGSTOP) and running (SIGCONT), alternated `rounds` times so that both sides see the
same background load. Each figure: the median of the rounds' ratios. Then how single engine
steps spread on the machine, alone and beside the running neighbour (`step_spread`): what
the steps' own jitter adds to the gaps between tokens.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time

NEIGHBOUR = """
import os, random, sys, torch
os.sched_setaffinity(0, {%d})
torch.set_num_threads(1)
from workers import LLM, SamplingParams
llm = LLM(sys.argv[1], max_num_seqs=16, max_num_batched_tokens=2048)
rng = random.Random(1)
params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
print("ready", flush=True)
while True:
    llm.generate([[rng.randrange(10, 1000) for _ in range(128)] for _ in range(4)], params)
"""


def corun_slowdown(model: str, cores: tuple[int, int] = (0, 1),
                   rounds: int = 5) -> dict[str, dict]:
    """{"decode_b1", "decode_b4", "prefill_128"}: each step's time with the neighbour running
    over its time with the neighbour stopped (see the module), {"median", "rounds"}; the same
    with "_cpu": this thread's CPU time (the memory bus and cache alone, without the time the
    core was lent to other processes). Pins this process to `cores[0]` (and leaves it
    pinned)."""
    import random

    import torch

    from workers import LLM, SamplingParams

    os.sched_setaffinity(0, {cores[0]})
    torch.set_num_threads(1)
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR % cores[1], model],
                                 stdout=subprocess.PIPE, text=True)
    try:
        if neighbour.stdout is None or neighbour.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the neighbour process did not start (exit {neighbour.poll()})")
        llm = LLM(model, max_num_seqs=16, max_num_batched_tokens=2048)
        rng = random.Random(0)

        def timed(n: int, tokens: int, max_tokens: int) -> tuple[float, float]:
            """(wall, this thread's CPU) seconds of `n` fresh prompts."""
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            prompts = [[rng.randrange(10, 1000) for _ in range(tokens)] for _ in range(n)]
            wall, cpu = time.perf_counter(), time.thread_time()
            llm.generate(prompts, params)
            return time.perf_counter() - wall, time.thread_time() - cpu

        def figures() -> dict[str, float]:
            out = {}
            for name, n, tokens, steps in (("decode_b1", 1, 16, 32), ("decode_b4", 4, 16, 32),
                                           ("prefill_128", 1, 128, 0)):
                long = timed(n, tokens, steps + 1)
                short = timed(n, tokens, 1) if steps else (0.0, 0.0)
                out[name] = (long[0] - short[0]) / max(1, steps)
                out[name + "_cpu"] = (long[1] - short[1]) / max(1, steps)
            return out

        timed(1, 16, 2)  # warm-up
        ratios: dict[str, list[float]] = {}
        for _ in range(rounds):
            os.kill(neighbour.pid, signal.SIGSTOP)
            alone = figures()
            os.kill(neighbour.pid, signal.SIGCONT)
            time.sleep(0.5)  # the neighbour back in its loop
            both = figures()
            for k in alone:
                ratios.setdefault(k, []).append(both[k] / alone[k])
        out: dict[str, dict] = {
            k: {"median": round(statistics.median(v), 3), "rounds": [round(x, 3) for x in v]}
            for k, v in ratios.items()}
        out["step_spread"] = step_spread(model, neighbour.pid)
        return out
    finally:
        os.kill(neighbour.pid, signal.SIGCONT)
        neighbour.kill()
        neighbour.wait()


def step_spread(model: str, neighbour: int, rounds: int = 2) -> dict[str, dict]:
    """How single engine steps spread on this machine: 4 streams decoding 128 steps, each step
    timed (wall), with the neighbour process stopped ("alone") and running ("both"),
    alternated `rounds` times; {state: {"median_ms", "over_median": {quantile: step over the
    median}}}."""
    import random

    from workers.contract.protocol import SamplingParams, WorkerRequest
    from workers.engine.config import EngineConfig
    from workers.engine.core import Engine

    engine = Engine(EngineConfig(model=model, max_num_seqs=16))
    rng, ids = random.Random(1), iter(range(1 << 30))

    def steps(n: int) -> list[float]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        for _ in range(4):
            engine.generate(WorkerRequest(f"spread-{next(ids)}", tuple(
                rng.randrange(10, 1000) for _ in range(16)), params))
        out = []
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            out.append(time.perf_counter() - start)
        return out[2:]  # the prefill step and the first decode step

    try:
        steps(8)  # warm-up
        times: dict[str, list[float]] = {"alone": [], "both": []}
        for _ in range(rounds):
            for state in times:
                os.kill(neighbour, signal.SIGSTOP if state == "alone" else signal.SIGCONT)
                time.sleep(0.5 if state == "both" else 0.0)
                times[state] += steps(129)
    finally:
        engine.close()
    spread = {}
    for state, xs in times.items():
        xs, med = sorted(xs), statistics.median(xs)
        spread[state] = {"median_ms": round(med * 1e3, 2), "over_median": {
            str(q): round(xs[int(q * (len(xs) - 1))] / med, 2)
            for q in (0.1, 0.25, 0.75, 0.9, 0.95, 0.99)}}
    return spread


__all__ = ["corun_slowdown", "step_spread"]
