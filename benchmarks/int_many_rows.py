"""Many rows over int8/int4 weights packed for the VNNI kernels in an fp32 model
(`fp32_int_kernels`): the VNNI kernels against unpacking to bf16 and oneDNN's bf16 matmul
(`QuantizedMatmul` from `UNPACK_ROWS` rows, `int_kernels.unpacked_mm`).

Kernels: one matmul of M fp32 rows (16, 32, 128, 512) by the `small` preset's weights (gate/up
2816 x 512, down 512 x 1408, qkv 1024 x 512, lm_head 8192 x 512) and a 0.6B model's MLP
(5632 x 2048, 2048 x 5632), int8 per channel and int4 in groups of 32; each path timed in
turn, the best of `--repeats` kept; the peer is fp32 `torch.mm` (MKL) of the same shape.

Engine: the `small` preset written as int8 and int4 (groups of 32, lm_head quantized), loaded
once each with `fp32_int_kernels`; a 128-token prompt's prefill and a decode step at 16 and 32
streams (the best 33-token generation's time less the best 1-token one's, over 32), with every
layer's `unpack_rows` set (after) and cleared (before), alternately, the best of `--rounds`
kept. Ratios: before's time over after's (above 1: the unpacked path is
faster); the kernels' likewise, and each path's against fp32 torch.mm.

Last line: one JSON object; also written to benchmarks/results/int_many_rows.json.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch
from results_io import RESULTS, command_line, emit

STEPS = 32  # decode steps timed: a 33-token generation less a 1-token one
SHAPES = {"gate_up": (2816, 512), "down": (512, 1408), "qkv": (1024, 512),
          "lm_head": (8192, 512), "up_0.6b": (5632, 2048), "down_0.6b": (2048, 5632)}


def best_of(fns: dict, repeats: int) -> dict[str, float]:
    """Seconds of each callable, called in turn `repeats` times: the best."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def kernels(rows: list[int], repeats: int) -> dict:
    from workers.kernels import int_gemm as ik

    g = torch.Generator().manual_seed(0)
    out = {}
    for shape, (n, k) in SHAPES.items():
        q4 = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g)
        s4 = torch.rand(n, k // 32, generator=g) * 0.01
        b4 = ik.block_int4(q4, s4, torch.zeros_like(s4))
        q8, s8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), torch.rand(n)
        b8, w = ik.block_int8(q8), torch.randn(n, k)
        unpack8 = functools.partial(ik.unpack_int8, b8, n, k)
        unpack4 = functools.partial(ik.unpack_int4, b4, n, k, 32)
        for m in rows:
            x = torch.randn(m, k)
            t = best_of({"fp32_mm": lambda: x @ w.t(),
                         "int8_vnni": lambda: ik.int8_gemm(x, b8, s8),
                         "int8_unpacked": lambda: ik.unpacked_mm(x, unpack8, n, k, s8),
                         "int4_vnni": lambda: ik.int4_gemm(x, b4, n, 32),
                         "int4_unpacked": lambda: ik.unpacked_mm(x, unpack4, n, k)}, repeats)
            gmac = {p: m * n * k / s / 1e9 for p, s in t.items()}
            out[f"{shape}_m{m}"] = {"gmac_per_s": gmac}
            for bits in ("int8", "int4"):
                out[f"{shape}_m{m}"][f"{bits}_unpacked_vs_vnni_ratio"] = (
                    t[f"{bits}_vnni"] / t[f"{bits}_unpacked"])
            print(f"{shape:9s} {n}x{k} M={m:3d} GMAC/s: " + " ".join(
                f"{p} {v:.0f}" for p, v in gmac.items()), file=sys.stderr)
    return out


def checkpoint(cache: Path, bits: int) -> Path:
    from workers.models.make_model import make_model
    from workers.quant.writer import quantize_checkpoint

    fp32 = cache / "llama-small"
    if not (fp32 / "config.json").exists():
        make_model(fp32, arch="llama", preset="small")
    path = cache / f"llama-small-int{bits}-g32-lm-head"
    if not (path / "config.json").exists():
        quantize_checkpoint(fp32, path, "compressed-tensors", bits=bits,
                            group_size=32 if bits == 4 else None, lm_head=True)
    return path


def engine(cache: Path, rounds: int) -> dict:
    from workers import LLM, SamplingParams
    from workers.quant.linear import UNPACK_ROWS, QuantizedMatmul

    out = {}
    for bits in (8, 4):
        llm = LLM(str(checkpoint(cache, bits)), dtype="float32", fp32_int_kernels=True,
                  block_size=16, num_blocks=32 * 12 + 8, max_num_seqs=32,
                  max_num_batched_tokens=32 * 128, enable_prefix_caching=False)
        matmuls = [m.matmul for m in llm.engine.runner.executor.model.modules()
                   if isinstance(getattr(m, "matmul", None), QuantizedMatmul)]

        def timed(prompts: list[list[int]], tokens: int) -> float:
            params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(prompts, params)
            return time.perf_counter() - start

        def measure() -> dict[str, float]:
            res = {"prefill128_ms": timed([list(range(3, 131))], 1) * 1e3}
            for streams in (16, 32):
                prompts = [[3 + (i * 7 + j) % 500 for j in range(16)] for i in range(streams)]
                res[f"decode{streams}_one_ms"] = timed(prompts, 1) * 1e3
                res[f"decode{streams}_all_ms"] = timed(prompts, STEPS + 1) * 1e3
            return res

        best: dict[str, dict[str, float]] = {"before": {}, "after": {}}
        for _ in range(rounds):
            for when in ("before", "after"):
                for m in matmuls:
                    m.unpack_rows = UNPACK_ROWS[m.kernel] if when == "after" else None
                for key, ms in measure().items():
                    best[when][key] = min(best[when].get(key, ms), ms)
        for times in best.values():  # a decode step: the best generation less the best prefill
            for streams in (16, 32):
                times[f"decode{streams}_step_ms"] = (times.pop(f"decode{streams}_all_ms")
                                                     - times.pop(f"decode{streams}_one_ms")) / STEPS
        llm.engine.close()
        for key in best["after"]:
            out[f"int{bits}_{key}"] = {when: best[when][key] for when in best}
            out[f"int{bits}_{key.rsplit('_', 1)[0]}_ratio"] = (
                best["before"][key] / best["after"][key])
            print(f"int{bits} {key}: before {best['before'][key]:.1f} after "
                  f"{best['after'][key]:.1f}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", default=str(Path.home() / ".cache/cleave/int_many_rows"))
    parser.add_argument("--rows", default="16,32,128,512")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--sections", default="kernels,engine")
    parser.add_argument("--out", default=str(RESULTS / "int_many_rows.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from workers.kernels import int_gemm as int_kernels

    if not int_kernels.dequant_available():
        raise SystemExit("this CPU lacks AVX-512 VNNI, AVX-512 BF16 or AMX: no unpacked path")
    result: dict = {"command": command_line(argv), "threads": args.threads}
    sections = args.sections.split(",")
    if "kernels" in sections:
        result["kernels"] = kernels([int(r) for r in args.rows.split(",")], args.repeats)
        for key, run in result["kernels"].items():
            result.update({f"{key}_{k}": v for k, v in run.items() if k.endswith("_ratio")})
    if "engine" in sections:
        result["engine"] = engine(Path(args.cache), args.rounds)
        result.update({k: v for k, v in result["engine"].items() if k.endswith("_ratio")})
    return emit(result, args.out)


if __name__ == "__main__":
    main()
