"""`gpu_all.py`'s headline: issue 52's figures by name, read from its parts' figures, with the
issue's target for each and whether the run reached it.

The names are the GPU run's (Llama-3-8B shape); a `--small` run (tiny preset, CPU) fills the
same names from its own small shapes (`SIZES`), so that each is known to be written: those
values are no GPU figures. A figure whose part failed, ran out of time or was skipped is None.
"""

from __future__ import annotations

# the sizes each headline name reads in the parts' figures, GPU run and small run
SIZES = {False: {"b_short": 64, "c_short": 1024, "b_big": 256, "b_kern": 256, "c_kern": 8192,
                 "c_lo": 32, "c_hi": 256},
         True: {"b_short": 2, "c_short": 64, "b_big": 2, "b_kern": 4, "c_kern": 64,
                "c_lo": 2, "c_hi": 2}}

# headline name -> (part, key in that part's figures, formatted with SIZES)
SOURCES = {
    "tests_gpu_passed": ("tests_gpu", "passed"),
    "tests_gpu_failed": ("tests_gpu", "failed"),
    "tests_gpu_errors": ("tests_gpu", "errors"),
    "tests_gpu_skipped": ("tests_gpu", "skipped"),
    "decode_b1_ms": ("roofline_bf16", "decode_b1_ms"),
    "decode_b1_bound_ratio": ("roofline_bf16", "decode_b1_bound_ratio"),
    "decode_b256_bound_ratio": ("roofline_bf16", "decode_b{b_big}_bound_ratio"),
    "attention_b64_c1024_copy_bw_ratio": (
        "roofline_bf16", "attention_b{b_short}_c{c_short}_copy_bw_ratio"),
    "attention_b64_c1024_best_launch_copy_bw_ratio": (
        "attention", "attention_b{b_short}_c{c_short}_best_copy_bw_ratio"),
    "attention_b64_c1024_best_launch": ("attention", "attention_b{b_short}_c{c_short}_best_launch"),
    "prefill_4096_ms": ("roofline_bf16", "prefill_ms"),
    "prefill_matmul_bound_ratio": ("roofline_bf16", "prefill_matmul_bound_ratio"),
    "throughput_vs_transformers_ratio": ("roofline_bf16", "throughput_vs_transformers_ratio"),
    "int4_step_linears_b1_vs_bf16_ratio": ("quant_gemm", "int4_step_linears_m1_vs_bf16_ratio"),
    "fp8_step_linears_b1_vs_bf16_ratio": ("quant_gemm", "fp8_step_linears_m1_vs_bf16_ratio"),
    "int8_kv_attention_b256_c8192_vs_bf16_ratio": (
        "attention", "int8_kv_attention_b{b_kern}_c{c_kern}_vs_bf16_ratio"),
    "served_agg_c32_vs_offline_ratio": ("served", "served_agg_c{c_lo}_vs_offline_ratio"),
    "served_agg_c256_vs_offline_ratio": ("served", "served_agg_c{c_hi}_vs_offline_ratio"),
    "served_1p1d_c32_vs_offline_ratio": ("served", "served_1p1d_c{c_lo}_vs_offline_ratio"),
    "served_1p1d_c256_vs_offline_ratio": ("served", "served_1p1d_c{c_hi}_vs_offline_ratio"),
    "served_agg_c256_tokens_per_s": ("served", "served_agg_c{c_hi}_tokens_per_s"),
    "profile_b1_kernels_per_step": ("decode_profile", "kernels_per_step"),
    "profile_b1_outside_graph_kernels_per_step": ("decode_profile",
                                                  "outside_graph_kernels_per_step"),
    "profile_b1_gpu_busy_ratio": ("decode_profile", "gpu_busy_ratio"),
    "profile_b1_launch_gap_us_sum_per_step": ("decode_profile", "launch_gap_us_sum_per_step"),
    "tp2_decode_b1_vs_tp1_ratio": ("tp2", "tp2_decode_b1_vs_tp1_ratio"),
    "disagg_tp2_tp1_greedy_equal": ("tp2", "disagg_tp2_tp1_greedy_equal"),
}

# issue 52's targets: (comparison, value)
TARGETS = {
    "decode_b1_bound_ratio": (">=", 0.85),
    "attention_b64_c1024_copy_bw_ratio": (">=", 0.6),
    "prefill_4096_ms": ("<=", 90.0),
    "throughput_vs_transformers_ratio": (">=", 15.0),
    "int4_step_linears_b1_vs_bf16_ratio": (">=", 1.5),
    "fp8_step_linears_b1_vs_bf16_ratio": (">=", 1.2),
    "int8_kv_decode_b256_vs_bf16_ratio": (">=", 1.0),
    "int8_kv_attention_b256_c8192_vs_bf16_ratio": (">=", 1.5),
    "served_agg_c256_vs_offline_ratio": (">=", 0.9),
    "tests_gpu_failed": ("<=", 0),
}


def headline(detail: dict[str, dict], small: bool) -> dict:
    """{name: figure} for every name of SOURCES, the int8 step against bf16's, `targets` and
    `met` (None where the figure is missing)."""
    sizes = SIZES[small]
    out: dict = {}
    for name, (part, key) in SOURCES.items():
        out[name] = detail.get(part, {}).get(key.format(**sizes))
    b = sizes["b_big"]
    int8 = detail.get("roofline_int8kv", {}).get(f"decode_b{b}_ms")
    bf16 = detail.get("roofline_bf16", {}).get(f"decode_b{b}_ms")
    out["int8_kv_decode_b256_vs_bf16_ratio"] = round(bf16 / int8, 4) if int8 and bf16 else None
    out["targets"] = {name: f"{op} {value}" for name, (op, value) in TARGETS.items()}
    out["met"] = {name: None if small or out[name] is None else
                  (out[name] >= value if op == ">=" else out[name] <= value)
                  for name, (op, value) in TARGETS.items()}
    if small:
        out["note"] = ("--small: the tiny preset in fp32 on the CPU, Triton in its interpreter; "
                       "these are no GPU figures, only proof that each is written")
    return out
