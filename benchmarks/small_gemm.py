"""The CPU small-batch matmul kernel (`workers/kernels/csrc/small_gemm.c`) against torch's `linear`, in
the same run: the projection shapes of the `small` preset (hidden 512, MLP 1408, vocabulary
8192) and of a 0.6B Llama (hidden 2048, MLP 5632), fp32 and bf16 weights, 1-16 rows. Each figure
is the best of 5 means of 20 calls, on torch's threads; the ratio is torch's time over the
kernel's (above 1: the kernel is faster). `workers/kernels/small_gemm.py` routes each dtype's rows by
these figures.

Then the fused gated MLP (`small_mlp`: both projections and the SiLU product in one call) against
the same MLP as a layer runs it without the fusion (the kernel's gate/up matmul, SiLU and product
in torch, the kernel's down matmul), fp32, 1-8 rows, on 8 layers' weights in turn so they come
from memory as in a decode step; the ratio is the unfused time over the fused.

Last line: one JSON object; also written to benchmarks/results/small_gemm.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from results_io import RESULTS, command_line, emit

SHAPES = {"small_mlp_up": (1408, 512), "small_mlp_down": (512, 1408),
          "small_lm_head": (8192, 512), "0.6b_mlp_up": (5632, 2048),
          "0.6b_mlp_down": (2048, 5632)}


def timed(fn, calls: int = 20, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--streams", default="1,4,8", help="decoding sequences, engine section")
    p.add_argument("--rounds", type=int, default=8, help="paired rounds, engine section")
    p.add_argument("--sections", default="gemm,mlp,engine", help="which of them to run")
    p.add_argument("--out", default=str(RESULTS / "small_gemm.json"))
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    sections = args.sections.split(",")
    result: dict = {"command": command_line(argv), "threads": torch.get_num_threads(),
                    "ms": {}}
    if "gemm" in sections:
        gemm(result, rows)
    if "mlp" in sections:
        fused_mlp(result, [m for m in rows if m <= 8])
    if "engine" in sections:
        fused_layers(result, [int(n) for n in args.streams.split(",")], args.rounds)
    return emit(result, args.out)


def gemm(result: dict, rows: list[int]) -> None:
    from workers.kernels.small_gemm import small_gemm

    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for shape, (n, k) in SHAPES.items():
            w = torch.randn(n, k).to(dtype)
            for m in rows:
                x = torch.randn(m, k).to(dtype)
                ours = timed(lambda: small_gemm(x.float(), w).to(dtype))
                theirs = timed(lambda: torch.nn.functional.linear(x, w))
                key = f"{name}_{shape}_rows{m}"
                result["ms"][key] = {"kernel": round(ours * 1e3, 4),
                                     "torch": round(theirs * 1e3, 4)}
                result[f"{key}_torch_vs_kernel_ratio"] = round(theirs / ours, 3)


def fused_mlp(result: dict, rows: list[int], layers: int = 8) -> None:
    from workers.kernels.small_gemm import small_gemm, small_mlp

    for name, (hidden, inter) in (("small", (512, 1408)), ("0.6b", (2048, 5632))):
        weights = [(torch.randn(2 * inter, hidden) / 8, torch.randn(hidden, inter) / 8)
                   for _ in range(layers)]

        def unfused(x: torch.Tensor) -> None:
            for gate_up, down in weights:
                gate, up = small_gemm(x, gate_up).chunk(2, dim=-1)
                small_gemm(torch.nn.functional.silu(gate, inplace=True).mul_(up), down)

        def fused(x: torch.Tensor) -> None:
            for gate_up, down in weights:
                small_mlp(x, gate_up, down, False)

        for m in rows:
            x = torch.randn(m, hidden)
            ours, theirs = timed(lambda: fused(x)), timed(lambda: unfused(x))
            key = f"fp32_{name}_mlp_rows{m}"
            result["ms"][key] = {"fused": round(ours * 1e3 / layers, 4),
                                 "unfused": round(theirs * 1e3 / layers, 4)}
            result[f"{key}_unfused_vs_fused_ratio"] = round(theirs / ours, 3)


def decode_steps(engine, streams: int, tag: str, first_fused: bool, prompt_len: int = 128,
                 output_len: int = 64) -> dict:
    """Median decode step (ms), fused and not, of `streams` greedy sequences run to the end
    together, the two alternating step by step (`first_fused`: which one the first step takes),
    so both see the same minute of this shared machine and the same context lengths; "all":
    every step's median (an engine without the fused stack runs every step unfused)."""
    from workers import SamplingParams
    from workers.contract.protocol import WorkerRequest

    model = engine.runner.executor.model.model
    stack = model.fused_stack
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(streams):
        prompt = tuple((7 * i + 13 * t) % 4000 + 3 for t in range(prompt_len))
        engine.generate(WorkerRequest(f"{tag}-{i}", prompt, params))
    engine.step()  # the prompts
    steps: dict[bool, list[float]] = {True: [], False: []}
    fused = first_fused
    while engine.has_unfinished():
        model.fused_stack = stack if fused else None
        start = time.perf_counter()
        engine.step()
        steps[fused].append(time.perf_counter() - start)
        fused = not fused
    model.fused_stack = stack
    medians: dict = {k: statistics.median(v) * 1e3 for k, v in steps.items()}
    return {**medians, "all": statistics.median(steps[True] + steps[False]) * 1e3}


def _engines(tmp: str, streams: list[int]) -> dict[str, tuple]:
    """The `small` preset's engines by checkpoint: fp32 (fused, no partner), int8 and int4 (group
    32; compressed-tensors, lm_head too, as peer_llamacpp.py serves them) kept packed in fp32
    (`fp32_int_kernels`), each with a bf16 engine of the same checkpoint as its partner."""
    from workers import Engine, EngineConfig
    from workers.models.make_model import make_model
    from workers.quant.writer import quantize_checkpoint

    def engine(path: Path, **options) -> Engine:
        return Engine(EngineConfig(model=str(path), device="cpu", block_size=16, num_blocks=128,
                                   max_num_seqs=max(streams), **options))

    fp32 = make_model(Path(tmp) / "small", arch="llama", preset="small")
    engines = {"fp32": (engine(fp32), None)}
    for name, bits, group in (("int8", 8, None), ("int4", 4, 32)):
        path = quantize_checkpoint(fp32, Path(tmp) / name, "compressed-tensors", bits=bits,
                                   group_size=group, lm_head=True)
        engines[name] = (engine(path, dtype="float32", fp32_int_kernels=True),
                         engine(path, dtype="bfloat16"))
    for name, (fused, _) in engines.items():
        assert fused.runner.executor.model.model.fused_stack is not None, (
            f"the small preset ({name}) should take the fused decoder stack")
    return engines


def fused_layers(result: dict, streams: list[int], rounds: int) -> None:
    """Per checkpoint and stream count: fused and unfused steps alternating in one engine
    (`decode_steps`), and for int8/int4 the bf16 engine's steps in the same round (before or
    after, alternately): `*_unfused_vs_fused_ratio` and `*_bf16_vs_fused_ratio`, each the median
    over rounds of the round's ratio."""
    with tempfile.TemporaryDirectory() as tmp:
        engines = _engines(tmp, streams)
        for fused, partner in engines.values():
            decode_steps(fused, 1, "warm", True)
            if partner is not None:
                decode_steps(partner, 1, "warm", True)
        for name, (engine, partner) in engines.items():
            for n in streams:
                rounds_ms = []
                for r in range(rounds):
                    pair = [engine] + ([partner] if partner is not None else [])
                    got = {id(e): decode_steps(e, n, f"{n}-{r}-{i}", r % 2 == 0)
                           for i, e in enumerate(pair if r % 2 == 0 else pair[::-1])}
                    rounds_ms.append({**got[id(engine)], "bf16": got[id(partner)]["all"]
                                      if partner is not None else None})
                _record(result, f"{name}_small_engine_streams{n}", rounds_ms)
        for fused, partner in engines.values():
            fused.close()
            if partner is not None:
                partner.close()


def _record(result: dict, key: str, rounds_ms: list[dict]) -> None:
    have_bf16 = rounds_ms[0]["bf16"] is not None
    names = (("fused", True), ("unfused", False)) + ((("bf16", "bf16"),) if have_bf16 else ())
    result["ms"][key] = {name: round(statistics.median(ms[k] for ms in rounds_ms), 3)
                         for name, k in names}
    result[f"{key}_unfused_vs_fused_ratio"] = round(statistics.median(
        ms[False] / ms[True] for ms in rounds_ms), 3)
    if have_bf16:
        result[f"{key}_bf16_vs_fused_ratio"] = round(statistics.median(
            ms["bf16"] / ms[True] for ms in rounds_ms), 3)


if __name__ == "__main__":
    main()
