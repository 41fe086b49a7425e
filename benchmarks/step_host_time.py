"""The engine's per-step host work (issue 17): what one decode step costs beyond the model.

A batch of requests (default 64, 128 prompt tokens, 64 output tokens, greedy, ignore_eos) runs
through `Engine.step()`; every decode step is timed whole and inside the model executor (the
forward pass with its input staging). Host time = step - model: scheduling, batch metadata,
sampling, bookkeeping, detokenization and token events. Reported per step and per sequence,
for the `tiny` and `small` presets on the CPU, against the model's own time in the same run.

Last line: one JSON object; also written to benchmarks/results/ with the command.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from results_io import RESULTS, command_line, emit


class TimedExecutor:
    """Wraps a model executor, adding up the seconds spent in `execute`."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.seconds = 0.0

    def execute(self, msg: object) -> torch.Tensor:
        start = time.perf_counter()
        logits = self.inner.execute(msg)
        self.seconds += time.perf_counter() - start
        return logits

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def measure(model: str, batch: int, prompt_len: int, output_len: int,
            repeats: int) -> dict[str, float]:
    """Medians over the decode steps of `repeats` runs: wall, model and host milliseconds."""
    from workers import Engine, EngineConfig, SamplingParams
    from workers.contract.protocol import WorkerRequest

    blocks_per_seq = -(-(prompt_len + output_len) // 16)
    engine = Engine(EngineConfig(model=model, device="cpu", block_size=16,
                                 num_blocks=batch * blocks_per_seq + 16, max_num_seqs=batch,
                                 max_num_batched_tokens=batch * prompt_len))
    timed = TimedExecutor(engine.runner.executor)
    engine.runner.executor = timed
    vocab = min(engine.model_config.vocab_size, 4096)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    step_ms, model_ms, host_ms = [], [], []
    for run in range(repeats + 1):  # the first warms up
        for i in range(batch):
            prompt = tuple(rng.randrange(3, vocab) for _ in range(prompt_len))
            engine.generate(WorkerRequest(f"{run}-{i}", prompt, params))
        engine.step()  # every prompt in one step
        while engine.has_unfinished():
            timed.seconds = 0.0
            start = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
            if run:
                step_ms.append(elapsed * 1e3)
                model_ms.append(timed.seconds * 1e3)
                host_ms.append((elapsed - timed.seconds) * 1e3)
    engine.close()
    # medians over every decode step: robust to other processes' bursts on a shared machine
    step, forward, host = (statistics.median(t) for t in (step_ms, model_ms, host_ms))
    return {"step_ms": round(step, 3), "model_ms": round(forward, 3), "host_ms": round(host, 3),
            "host_us_per_seq": round(host / batch * 1e3, 2),
            "host_to_model_ratio": round(host / forward, 3)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--out", default=str(RESULTS / "step_host_time.json"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from workers.models.make_model import make_model

    result: dict[str, object] = {
        "benchmark": "step_host_time", "command": command_line(argv), "device": "cpu",
        "torch_threads": torch.get_num_threads(), "batch": args.batch,
        "prompt_len": args.prompt_len, "output_len": args.output_len,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            model = str(make_model(Path(tmp) / preset, arch="llama", preset=preset))
            times = measure(model, args.batch, args.prompt_len, args.output_len, args.repeats)
            print(f"{preset}: {times['step_ms']} ms/step, model {times['model_ms']} ms, host "
                  f"{times['host_ms']} ms ({times['host_us_per_seq']} us/seq)", file=sys.stderr)
            result.update({f"{preset}_{key}": value for key, value in times.items()})
    return emit(result, args.out)


if __name__ == "__main__":
    main()
