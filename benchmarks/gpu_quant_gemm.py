"""The Triton matmuls for quantized weights (`workers.kernels.quant_triton`: FP8 e4m3 with
128 x 128 block scales, int4 weight-only in groups of 128) against torch's bf16 matmul on the same
(dequantized) weights, at decode and small-prefill row counts, on Llama-3-8B's projection shapes.

Written for a GPU (weights read per second against bf16's; `*_vs_bf16_ratio` = bf16 time over
the kernel's, so above 1.0 means faster); on a CPU it runs the kernels in Triton's interpreter
on one small shape, so the script itself is checked without one. Each kernel's output is also
compared with x times its dequantized weights (relative error of the whole product).

Last line: one JSON object; also written to benchmarks/results/ with the command.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton reads it at @jit

from results_io import RESULTS, command_line, emit  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in pair.split("x")) for pair in text.split(",")]


def bench(fn, device: str) -> float:
    """Median seconds of `fn()`: triton's do_bench on a GPU, a few timed calls in the
    interpreter."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, return_mode="median") / 1e3
    import statistics
    import time

    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(f"{((got - want).norm() / want.norm()).item():.3g}")


def one_shape(n: int, k: int, rows: list[int], device: str) -> dict:
    from workers.kernels.quant_triton import fp8_gemm, int4_gemm, pack_int4_pairs
    from workers.quant.weights import Fp8Weight, expand_fp8_scales, quantize_fp8, quantize_int

    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    q8, s8 = quantize_fp8(w, (128, 128))
    fp8 = Fp8Weight(q8.to(device), expand_fp8_scales(s8, n, k, (128, 128)).to(device))
    int4 = quantize_int(w, 4, 128, True)
    packed = pack_int4_pairs(int4.q).to(device)
    scales, zeros = int4.scales.to(device), int4.zeros.to(device)
    bf16 = w.to(device, torch.bfloat16)
    deq8, deq4 = fp8.dequantize().float(), int4.dequantize().to(device).float()
    out = {}
    for m in rows:
        x = torch.randn(m, k, device=device)
        xb = x.to(torch.bfloat16)
        t_bf16 = bench(lambda: xb @ bf16.t(), device)
        t_fp8 = bench(lambda: fp8_gemm(x, fp8.w, fp8.scales), device)
        t_int4 = bench(lambda: int4_gemm(x, packed, scales, zeros), device)
        out[f"n{n}_k{k}_m{m}"] = {
            "bf16_us": round(t_bf16 * 1e6, 2), "fp8_us": round(t_fp8 * 1e6, 2),
            "int4_us": round(t_int4 * 1e6, 2),
            "fp8_vs_bf16_ratio": float(f"{t_bf16 / t_fp8:.3g}"),
            "int4_vs_bf16_ratio": float(f"{t_bf16 / t_int4:.3g}"),
            "bf16_weight_gb_s": round(2 * n * k / t_bf16 / 1e9, 1),
            "fp8_weight_gb_s": round(n * k / t_fp8 / 1e9, 1),
            "int4_weight_gb_s": round(n * k / 2 / t_int4 / 1e9, 1),
            "fp8_rel_err": relative_error(fp8_gemm(x, fp8.w, fp8.scales), x @ deq8.t()),
            "int4_rel_err": relative_error(int4_gemm(x, packed, scales, zeros), x @ deq4.t()),
        }
        print(f"n{n} k{k} m{m}: {out[f'n{n}_k{k}_m{m}']}", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336" if cuda
                        else "256x256", help="N x K of each weight, comma-separated")
    parser.add_argument("--rows", default="1,16,128" if cuda else "1,16")
    parser.add_argument("--out", default=str(RESULTS / "gpu_quant_gemm.json"))
    args = parser.parse_args(argv)
    device = "cuda" if cuda else "cpu"
    result = {"benchmark": "gpu_quant_gemm", "command": command_line(argv),
              "device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"}
    rows = [int(r) for r in args.rows.split(",")]
    for n, k in shapes(args.shapes):
        result.update(one_shape(n, k, rows, device))
    return emit(result, args.out)


if __name__ == "__main__":
    main()
