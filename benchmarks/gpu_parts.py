"""The parts of `gpu_all.py` that no other benchmark measures: the batch-1 decode step's profiler
timeline, the short-context attention launch sweep with the 8-bit KV kernel against bf16, the
quantized projections of one decode step, and the served path against the offline engine.

Each part takes a `Shape` (the GPU's: Llama-3-8B in bf16; `--small`: the tiny preset in fp32
on the CPU) and returns a dict of figures; `gpu_all.py` runs each in a process of its own.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton reads it at @jit

import gpu_roofline
from results_io import sig


@dataclass(frozen=True)
class Shape:
    """What a part runs on: the device, dtype and model preset, and how big each part is."""

    small: bool
    device: str
    dtype: str
    preset: str

    @classmethod
    def of(cls, small: bool) -> Shape:
        if small:
            return cls(True, "cpu", "float32", "tiny")
        return cls(False, "cuda", "bfloat16", "llama-3-8b")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def model(self, tmp: str) -> str:
        """A config-only checkpoint folder of the preset (weights drawn at load: `dummy`)."""
        from workers.models.make_model import make_model

        return str(make_model(Path(tmp) / self.preset, arch="llama", preset=self.preset,
                              dtype=self.dtype, weights=False))

    def engine_options(self, **extra: object) -> dict:
        kv = None if self.device == "cuda" else 256 << 20
        return {"dtype": self.dtype, "device": self.device, "load_format": "dummy",
                "kv_cache_memory_bytes": kv, **extra}


# ---- the batch-1 decode step's timeline -------------------------------------------------------

def summarize_trace(events: list[dict], steps: int, wall_s: float) -> dict:
    """Per decode step, from a Chrome trace of `steps` steps taking `wall_s` in all: GPU kernels
    (those a CUDA-graph launch replayed, and the rest: launched outside the graph), copies,
    the time the GPU was busy (kernels and copies, overlaps once), the gaps between one GPU
    operation's end and the next one's start, and the host ops. Graph launches with no kernel
    of theirs in the trace mean the profiler did not trace inside the graphs: then the kernel
    figures count only what ran outside them."""
    launches = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "GraphLaunch" in e.get("name", "")]
    graph_ids = {e["args"]["correlation"] for e in launches if "correlation" in e.get("args", {})}
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    copies = [e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")
              and e.get("ph") == "X"]
    in_graph = [k for k in kernels if k.get("args", {}).get("correlation") in graph_ids]
    outside = [k for k in kernels if k.get("args", {}).get("correlation") not in graph_ids]
    ops = sorted(kernels + copies, key=lambda e: e["ts"])
    busy, gaps, end = 0.0, [], None
    for e in ops:
        start, stop = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        if end is None or start >= end:
            if end is not None:
                gaps.append(start - end)
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    per = max(steps, 1)
    totals: dict[str, float] = {}
    for k in kernels:
        totals[k["name"][:80]] = totals.get(k["name"][:80], 0.0) + float(k.get("dur", 0))
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:5]
    step_us = wall_s * 1e6 / per
    return {
        "steps": steps, "step_ms": sig(step_us / 1e3),
        "graph_launches_per_step": sig(len(launches) / per),
        "kernels_per_step": sig(len(kernels) / per),
        "graph_kernels_per_step": sig(len(in_graph) / per),
        "outside_graph_kernels_per_step": sig(len(outside) / per),
        "outside_graph_us_per_step": sig(sum(float(k.get("dur", 0)) for k in outside) / per),
        "copies_per_step": sig(len(copies) / per),
        "copy_us_per_step": sig(sum(float(c.get("dur", 0)) for c in copies) / per),
        "gpu_busy_ms_per_step": sig(busy / per / 1e3),
        "gpu_busy_ratio": sig(busy / per / step_us) if step_us else 0.0,
        "launch_gaps_per_step": sig(len(gaps) / per),
        "launch_gap_us_sum_per_step": sig(sum(gaps) / per),
        "launch_gap_us_p50": sig(statistics.median(gaps)) if gaps else 0.0,
        "launch_gap_us_max": sig(max(gaps)) if gaps else 0.0,
        "host_ops_per_step": sig(sum(1 for e in events if e.get("cat") == "cpu_op") / per),
        "top_kernels_us_per_step": {name: sig(us / per) for name, us in top},
    }


def decode_profile(shape: Shape) -> dict:
    """Batch-1 decode at 1,024 tokens of context (64 on the CPU) through the engine (CUDA
    graphs on a GPU): unprofiled step time, then `summarize_trace` of `steps` profiled steps
    (after two of the profiler's warm-up)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from workers import Engine, EngineConfig, SamplingParams

    context, steps = (64, 3) if shape.small else (1024, 16)
    # roofline_bf16's engine's longest context (4,096-token prefill + 512), which its CUDA
    # graphs plan their attention splits for: the timeline of the step that figure measured
    max_model_len = context + 64 if shape.small else 4096 + 512
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(EngineConfig(model=shape.model(tmp), max_num_seqs=1,
                                     max_model_len=max_model_len, **shape.engine_options()))
        try:
            params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 16, ignore_eos=True)
            gpu_roofline._fill(engine, 1, context, min(engine.model_config.vocab_size, 32000),
                               random.Random(0), params)
            plain = []
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                plain.append(time.perf_counter() - t0)
            activities = [ProfilerActivity.CPU]
            if shape.device == "cuda":
                activities.append(ProfilerActivity.CUDA)
            # two steps' warm-up (the profiler's own start-up), then `steps` traced
            with profile(activities=activities,
                         schedule=schedule(wait=0, warmup=2, active=steps, repeat=1)) as prof:
                for i in range(steps + 2):
                    if i == 2:
                        t0 = time.perf_counter()
                    engine.step()
                    if i == steps + 1:
                        wall = time.perf_counter() - t0
                    prof.step()
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
            events = json.loads(trace.read_text()).get("traceEvents", [])
        finally:
            engine.close()
    out = summarize_trace(events, steps, wall)
    out["unprofiled_step_ms"] = sig(statistics.median(plain) * 1e3)
    out["context"] = context
    return out


# ---- attention: the short-context launch sweep, and the 8-bit cache against bf16 ----------------

def _bench(fn, device: str) -> float:
    """Median seconds of `fn()`: triton's do_bench on a GPU; one call on the CPU (the
    interpreter: a figure only to be written)."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=20, return_mode="median") / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def model_config(shape: Shape):  # -> ModelConfig
    from workers.models.model_config import ModelConfig

    with tempfile.TemporaryDirectory() as tmp:
        return ModelConfig.from_pretrained(shape.model(tmp))


def launch_sweep(shape: Shape, mc, copy_bw: float) -> dict:
    """The Triton decode kernel alone (no KV write, no allocation) over one layer's bf16 cache
    at 64 sequences x 1,024 tokens (the 0.36 of issue 52, measured through the backend), at
    each split count, tile and warp count: KV bytes read per second against the copy
    bandwidth, and the largest difference from the default launch's output."""
    from workers.attention.decode_splits import (
        DecodeScratch,
        choose_num_splits,
        decode_launches,
        device_num_sms,
    )
    from workers.attention.triton_decode import TILE_N, paged_decode_attention

    batch, context = (2, 64) if shape.small else (64, 1024)
    grid = ([(1, TILE_N, 4), (2, 32, 4)] if shape.small else
            [(s, t, 4) for s in (1, 2, 4) for t in (32, 64, 128)] + [(1, 64, 8), (1, 128, 8)])
    device = torch.device(shape.device)
    q, _, _, cache, meta, kv_bytes = gpu_roofline.attention_inputs(
        mc, batch, context, 16, shape.torch_dtype, device)
    scale = q.shape[-1] ** -0.5
    # the output and the splits' scratch allocated once, as the engine's graphs hold them
    out = torch.empty_like(q)
    scratch = DecodeScratch.allocate(batch * max(s for s, _, _ in grid), q.shape[1], q.shape[2],
                                     device)

    def run(splits: int, tile: int, warps: int) -> torch.Tensor:
        return paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, scale, splits,
                                      out=out, scratch=scratch, tile=tile, num_warps=warps)

    want = run(1, TILE_N, 4).clone()
    variants = []
    for splits, tile, warps in grid:
        err = (run(splits, tile, warps).float() - want.float()).abs().max().item()
        seconds = _bench(lambda s=splits, t=tile, w=warps: run(s, t, w), shape.device)
        variants.append({"splits": splits, "tile": tile, "num_warps": warps,
                         "us": sig(seconds * 1e6), "max_abs_diff": sig(err, 3),
                         "copy_bw_ratio": sig(kv_bytes / seconds / copy_bw)})
    planned = choose_num_splits(batch, mc.num_key_value_heads, context, device_num_sms(device))
    best = max(variants, key=lambda v: v["copy_bw_ratio"])
    default = next((v for v in variants
                    if (v["splits"], v["tile"], v["num_warps"]) == (planned, TILE_N, 4)), None)
    key = f"attention_b{batch}_c{context}"
    return {f"{key}_variants": variants, f"{key}_planned_splits": planned,
            f"{key}_planned_launches": decode_launches(planned),
            f"{key}_planned_copy_bw_ratio": default and default["copy_bw_ratio"],
            f"{key}_best_copy_bw_ratio": best["copy_bw_ratio"],
            f"{key}_best_launch": {k: best[k] for k in ("splits", "tile", "num_warps")}}


def int8_kv_attention(shape: Shape, mc, backend: str) -> dict:
    """The decode attention alone at 256 sequences x 8,192 tokens over an int8 cache and a
    bf16 one (the model dtype), alternated twice in this process: the speed-up is bf16's time
    over int8's (`_vs_bf16_ratio` above 1: the int8 cache is faster)."""
    batch, context = (4, 64) if shape.small else (256, 8192)
    device = torch.device(shape.device)
    times: dict[str, list[float]] = {"int8": [], "bf16": []}
    for _ in range(2):
        for name, kv_dtype in (("int8", torch.int8), ("bf16", None)):
            seconds, _ = gpu_roofline.attention_seconds(backend, mc, batch, context, 16,
                                                        shape.torch_dtype, device, kv_dtype)
            times[name].append(seconds)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    int8, bf16 = min(times["int8"]), min(times["bf16"])
    key = f"int8_kv_attention_b{batch}_c{context}"
    return {f"{key}_us": sig(int8 * 1e6), f"bf16_kv_attention_b{batch}_c{context}_us":
            sig(bf16 * 1e6), f"{key}_vs_bf16_ratio": sig(bf16 / int8)}


def attention(shape: Shape) -> dict:
    device = torch.device(shape.device)
    copy_bw = gpu_roofline.copy_bandwidth(device, (1 << 30) if shape.device == "cuda"
                                          else (64 << 20))
    mc = model_config(shape)
    backend = "triton" if shape.device == "cuda" else "torch"
    return {"copy_bandwidth_gb_s": sig(copy_bw / 1e9), "attention_backend": backend,
            **launch_sweep(shape, mc, copy_bw), **int8_kv_attention(shape, mc, backend)}


# ---- the quantized projections of one decode step ---------------------------------------------

# Llama-3-8B's projections per layer, N x K: q/k/v fused, the output, gate and up (timed as
# two 14,336-row halves of the fused 28,672: the CPU quantizes each weight before the GPU times
# it, and a half is what the earlier runs measured), down; and its layers
STEP_SHAPES = ((6144, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336))
STEP_LAYERS = 32


def quant_step(shape: Shape) -> dict:
    """`gpu_quant_gemm.py`'s kernels on every projection of one decode step at 1, 16 and 128
    rows, and their sum over the layers at each row count against bf16's
    (`*_step_linears_m{m}_vs_bf16_ratio` = bf16's time over the kernel's). The engine's own
    int4/FP8 step is not measurable yet: on a GPU the loader dequantizes those weights
    (`workers/quant/linear.py`), so an engine step with them is a bf16 step."""
    import gpu_quant_gemm

    shapes, layers, rows = (((48, 128), (48, 128), (32, 128)), 2, [1]) if shape.small else (
        STEP_SHAPES, STEP_LAYERS, [1, 16, 128])
    per_shape: dict[str, dict] = {}
    for n, k in dict.fromkeys(shapes):
        per_shape.update(gpu_quant_gemm.one_shape(n, k, rows, shape.device))
    out: dict = {"shapes": per_shape, "layers": layers,
                 "engine_quantized_decode_step": "not measurable: the loader dequantizes int4 "
                 "and FP8 weights on a GPU (workers/quant/linear.py)"}
    for m in rows:
        total = {kind: layers * sum(per_shape[f"n{n}_k{k}_m{m}"][f"{kind}_us"]
                                    for n, k in shapes) for kind in ("bf16", "int4", "fp8")}
        out[f"bf16_step_linears_m{m}_us"] = sig(total["bf16"])
        for kind in ("int4", "fp8"):
            out[f"{kind}_step_linears_m{m}_us"] = sig(total[kind])
            out[f"{kind}_step_linears_m{m}_vs_bf16_ratio"] = sig(total["bf16"] / total[kind])
    return out
