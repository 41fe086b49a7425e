"""Tensor, expert and pipeline parallelism on CPU (gloo, one process per rank), one run.

1. Bytes communicated per token per layer, measured by counting every collective's payload on
   every rank during decode steps, against the analytic count:
   - TP (Llama, tp ranks): two all-reduces of [T, hidden] per layer on each rank,
     tp * 2 * hidden * bytes per token (summed over ranks).
   - EP (Mixtral, experts split over ep ranks): per MoE layer, summed over ranks: dispatch and
     combine of the k (token, expert) rows (2 * k * hidden * bytes), the rows' expert ids
     (k * 8), the all-gather of the ceil(T / ep)-token chunks and the ep x ep counts exchange,
     plus the attention all-reduce (ep * hidden * bytes).
   The two must agree (ratio 1.0).
2. Decode step time split into compute and communication (rank means), against the same
   batch in one process.
3. Pipeline: with PP=2 and M micro-batches per decode step, the measured bubble fraction
   against the ideal (P - 1) / (M + P - 1).
GPU: none was lent to this run; these are CPU/gloo figures for the record.

Last line: one JSON object; also written to benchmarks/results/ with the command.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from results_io import RESULTS, command_line, emit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, LAYERS, EXPERTS, TOP_K = 64, 2, 4, 2


def write_checkpoint(arch: str, out: Path) -> str:
    """A random fp32 checkpoint written by transformers (Llama or Mixtral, hidden 64)."""
    import transformers as tf

    shape = {"vocab_size": 256, "hidden_size": HIDDEN, "intermediate_size": 128,
             "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2}
    if arch == "mixtral":
        config = tf.MixtralConfig(**shape, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
        model = tf.MixtralForCausalLM(config)
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**shape))
    model.float().save_pretrained(out / arch)
    return str(out / arch)


def decode_steps(path: str, batch: int, steps: int, **sizes: int) -> tuple[list, float]:
    """Per decode step: the ranks' timings (empty in one process); and the mean step seconds."""
    import time

    from workers import LLM, SamplingParams
    from workers.contract.protocol import WorkerRequest

    llm = LLM(path, block_size=16, num_blocks=256, max_num_seqs=batch, **sizes)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    try:
        for i in range(batch):
            prompt = tuple(3 + (i * 7 + j) % 200 for j in range(16))
            engine.generate(WorkerRequest(str(i), prompt, params))
        engine.step()  # every prompt in one prefill step
        timings, seconds = [], []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            seconds.append(time.perf_counter() - start)
            timings.append(list(getattr(engine.runner.executor, "last_timings", [])))
        return timings, statistics.median(seconds)
    finally:
        engine.close()


def site_bytes(timings: list, sites: tuple[str, ...]) -> float:
    """Mean over steps of the bytes all ranks handed to collectives at `sites`."""
    return statistics.mean(sum(t.comm_bytes.get(s, 0) for t in step for s in sites)
                           for step in timings)


def split_time(timings: list) -> dict[str, float]:
    comm = statistics.mean(statistics.mean(t.comm_s for t in step) for step in timings)
    wall = statistics.mean(max(t.wall_s for t in step) for step in timings)
    return {"step_ms": wall * 1e3, "comm_ms": comm * 1e3, "compute_ms": (wall - comm) * 1e3}


def ep_analytic(tokens: int, ep: int, elem: int) -> float:
    """Bytes per token per MoE layer, all ranks, as the module docstring counts them."""
    chunk = math.ceil(tokens / ep)
    per_layer = (2 * TOP_K * HIDDEN * elem * tokens + TOP_K * 8 * tokens
                 + ep * chunk * HIDDEN * elem + ep * ep * 8 + ep * HIDDEN * elem * tokens)
    return per_layer / tokens


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="decoding sequences")
    parser.add_argument("--steps", type=int, default=12, help="decode steps measured")
    parser.add_argument("--microbatches", type=int, default=2, help="PP micro-batches")
    parser.add_argument("--out", default=str(RESULTS / "parallel_scaling.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    elem, b = 4, args.batch  # fp32
    with tempfile.TemporaryDirectory() as tmp:
        llama, mixtral = write_checkpoint("llama", Path(tmp)), write_checkpoint("mixtral", Path(tmp))
        _, single_s = decode_steps(llama, b, args.steps)
        tp_t, tp_s = decode_steps(llama, b, args.steps, tensor_parallel_size=2)
        ep_t, _ = decode_steps(mixtral, b, args.steps, tensor_parallel_size=2,
                                  expert_parallel_size=2)
        pp_t, _ = decode_steps(llama, b, args.steps, pipeline_parallel_size=2,
                                  pipeline_microbatches=args.microbatches)
    tp_measured = site_bytes(tp_t, ("attn", "mlp")) / (b * LAYERS)
    tp_analytic = 2 * 2 * HIDDEN * elem
    moe_sites = ("attn", "moe_counts", "moe_dispatch", "moe_dispatch_ids", "moe_combine",
                 "moe_gather")
    ep_measured = site_bytes(ep_t, moe_sites) / (b * LAYERS)
    ep_expected = ep_analytic(b, 2, elem)
    stage_busy = [[sum(t.microbatch_busy_s) for t in step] for step in pp_t]
    bubble = statistics.mean(
        max(0.0, 1 - sum(busy) / (len(busy) * max(t.wall_s for t in step)))
        for busy, step in zip(stage_busy, pp_t))
    ideal = (2 - 1) / (args.microbatches + 2 - 1)
    result = {
        "benchmark": "parallel_scaling",
        "device": "cpu (gloo, one process and one torch thread per rank); no GPU lent",
        "model": f"hidden {HIDDEN}, {LAYERS} layers; Mixtral {EXPERTS} experts top-{TOP_K}; fp32",
        "batch": b,
        "tp2_bytes_per_token_per_layer": tp_measured,
        "tp2_bytes_analytic": tp_analytic,
        "tp2_bytes_ratio": tp_measured / tp_analytic,
        "ep2_bytes_per_token_per_layer": ep_measured,
        "ep2_bytes_analytic": ep_expected,
        "ep2_bytes_ratio": ep_measured / ep_expected,
        "single_process_step_ms": single_s * 1e3,
        "tp2_step": split_time(tp_t),
        "tp2_vs_single_step_time_ratio": tp_s / single_s,
        "ep2_step": split_time(ep_t),
        "pp2_step": split_time(pp_t),
        "pp2_microbatches": args.microbatches,
        "pp2_bubble_fraction": bubble,
        "pp2_bubble_ideal": ideal,
        "pp2_bubble_vs_ideal_ratio": bubble / ideal,
        "command": command_line(argv),
    }
    return emit(result, args.out)


if __name__ == "__main__":
    main()
