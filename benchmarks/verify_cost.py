"""What a speculative verification row costs on this CPU, against what its arithmetic alone must
cost: the bound behind n-gram speculation's 1.8x at one stream (issue 48).

SmolLM2-135M-Instruct (the shipped Q4_1 file on the GGUF VNNI kernel, `--fp32-int-kernels`),
offline, greedy, on `speculative.py`'s `repeat` prompts:

1. the engine speculating (n-gram, the match rule, at most 8 drafted) fits a one-row step's
   seconds and the seconds a drafted token adds (`StepClock.fit`): c measured;
2. `port_probe.c` times one core's 512-bit byte dot products (VPDPBUSD, the VNNI kernel's: 64
   multiply-adds each) and fp32 FMAs (the attention kernel's: 16), 12 independent chains;
3. a row's floor: its multiply-adds through the linear layers and the output projection at one
   VPDPBUSD per 64, and its attention's (2 x heads x context x head_dim, at the decode steps'
   mean context) at one FMA per 16, on each of the kernels' threads, nothing else counted (the
   activations' quantization, the scaling, norms, softmax, the KV write all free); c floor is
   that over the measured one-row step;
4. the greedy outputs replayed (`speculative_replay.py`): the engine's rule and the oracle (the
   bound of every prompt-lookup policy, knowing the output) at c measured and at c floor, and
   the largest c at which the engine's rule still reaches 1.8x (bisected).

    python benchmarks/verify_cost.py [--out benchmarks/results/verify_cost.json]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import math
from pathlib import Path
from typing import Any

import torch
from results_io import RESULTS, command_line, emit
from speculative import MAX_TOKENS, WORKLOADS
from speculative_replay import REQUESTS, Replay, greedy_outputs, oracle, speculating_clock

from workers import LLM
from workers.models.checkpoint_shapes import hf_weight_shapes
from workers.models.model_config import ModelConfig
from workers.kernels.native import build_library

PROBE = Path(__file__).parent / "port_probe.c"
K = 8  # drafted tokens at most, as `speculative.py`'s n-gram setting
TARGET = 1.8


@functools.cache
def _probe() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(PROBE)))
    lib.port_probe.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.POINTER(ctypes.c_int32)]
    lib.port_probe.restype = ctypes.c_double
    return lib


def per_ns(kind: int, rounds: int = 20_000_000, repeats: int = 5) -> float:
    """One core's instructions a nanosecond (kind 0: VPDPBUSD, 1: 512-bit FMA), the best of
    `repeats`; ValueError on a CPU without AVX-512 VNNI."""
    sink = ctypes.c_int32()
    best = min(_probe().port_probe(kind, rounds, ctypes.byref(sink)) for _ in range(repeats))
    if best <= 0:
        raise ValueError("port_probe needs AVX-512 VNNI, which this CPU lacks")
    return 12 * rounds / best / 1e9


def row_multiply_adds(config: ModelConfig) -> tuple[int, int]:
    """(multiply-adds through the linear layers and the output projection, attention's per
    token of context) of one row of a dense `config`: every weight matrix of its checkpoint
    (`hf_weight_shapes`) but the input embedding, the output projection counted when tied too."""
    linear = sum(math.prod(shape) for name, shape in hf_weight_shapes(config)
                 if len(shape) == 2 and name != "model.embed_tokens.weight")
    if config.tie_word_embeddings:
        linear += config.vocab_size * config.hidden_size
    return linear, config.num_hidden_layers * 2 * config.num_attention_heads * config.head_dim


def row_floor_seconds(linear: int, attention_per_token: int, context: float,
                      dot_per_ns: float, fma_per_ns: float, threads: int) -> float:
    """A row's products alone: `linear` multiply-adds at 64 a VPDPBUSD, attention's at 16 an
    FMA, over `threads` cores issuing `dot_per_ns` and `fma_per_ns` each."""
    return (linear / 64 / dot_per_ns + attention_per_token * context / 16 / fma_per_ns) \
        / threads / 1e9


def cost_for(outputs: list[tuple[list, list]], target: float, iterations: int = 30) -> float:
    """The largest c at which the engine's rule (`Replay("match")`) still yields `target`
    tokens per step cost on `outputs`, bisected; 0 when it does not even at c = 0."""
    low, high = 0.0, 1.0
    if Replay("match", K, low).run(outputs)["ratio"] < target:
        return 0.0
    for _ in range(iterations):
        mid = (low + high) / 2
        if Replay("match", K, mid).run(outputs)["ratio"] >= target:
            low = mid
        else:
            high = mid
    return low


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "verify_cost.json"))
    args = parser.parse_args(argv)
    from workers.models.trained_default import smollm2_gguf

    path = str(smollm2_gguf())
    prompts, max_tokens = WORKLOADS["repeat"][:REQUESTS], MAX_TOKENS["repeat"]
    llm = LLM(path, fp32_int_kernels=True)
    outputs = greedy_outputs(llm, prompts, max_tokens)
    linear, attention = row_multiply_adds(llm.engine.runner.executor.model.config)
    del llm
    fitted = speculating_clock(path, prompts, max_tokens, K, True).fit()
    if fitted is None:
        raise RuntimeError("the engine's clock did not fit a drafted token's cost")
    one_row, per_token = fitted
    dot, fma = per_ns(0), per_ns(1)
    # the decode steps' mean context: the prompt, then each output token's position
    contexts = [len(p) + i for p, o in outputs for i in range(1, len(o))]
    context = sum(contexts) / len(contexts)
    threads = torch.get_num_threads()
    floor = row_floor_seconds(linear, attention, context, dot, fma, threads)
    measured, floor_cost = per_token / one_row, floor / one_row
    result: dict[str, Any] = {
        "one_row_ms": round(one_row * 1e3, 3), "row_ms": round(per_token * 1e3, 3),
        "row_floor_ms": round(floor * 1e3, 3), "row_vs_floor_ratio": round(per_token / floor, 3),
        "measured_token_cost": round(measured, 3), "floor_token_cost": round(floor_cost, 3),
        "token_cost_for_1_8": round(cost_for(outputs, TARGET), 3),
        "dpbusd_per_ns": round(dot, 3), "fma512_per_ns": round(fma, 3), "threads": threads,
        "context_mean": round(context, 1), "row_linear_multiply_adds": linear,
    }
    for label, c in (("measured", measured), ("floor", floor_cost)):
        result[f"match_at_{label}_cost_ratio"] = Replay("match", K, c).run(outputs)["ratio"]
        result[f"oracle_at_{label}_cost_ratio"] = oracle(outputs, K, c)["ratio"]
    result["command"] = command_line(argv)
    return emit(result, args.out)


if __name__ == "__main__":
    main()
