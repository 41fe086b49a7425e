"""The CPU small-batch matmul kernel (`workers/csrc/small_gemm.c`) against torch's `linear`, in
the same run: the projection shapes of the `small` preset (hidden 512, MLP 1408, vocabulary
8192) and of a 0.6B Llama (hidden 2048, MLP 5632), fp32 and bf16 weights, 1-16 rows. Each figure
is the best of 5 means of 20 calls, on torch's threads; the ratio is torch's time over the
kernel's (above 1: the kernel is faster). `workers/small_gemm.py` routes each dtype's rows by
these figures.

Then the fused gated MLP (`small_mlp`: both projections and the SiLU product in one call) against
the same MLP as a layer runs it without the fusion (the kernel's gate/up matmul, SiLU and product
in torch, the kernel's down matmul), fp32, 1-8 rows, on 8 layers' weights in turn so they come
from memory as in a decode step; the ratio is the unfused time over the fused.

Last line: one JSON object; also written to benchmarks/results/small_gemm.json.
"""

from __future__ import annotations

import argparse
import time

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
    from workers.small_gemm import small_gemm

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--out", default=str(RESULTS / "small_gemm.json"))
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    result: dict = {"command": command_line(argv), "threads": torch.get_num_threads(),
                    "ms": {}}
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
    fused_mlp(result, [m for m in rows if m <= 8])
    return emit(result, args.out)


def fused_mlp(result: dict, rows: list[int], layers: int = 8) -> None:
    from workers.small_gemm import small_gemm, small_mlp

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


if __name__ == "__main__":
    main()
