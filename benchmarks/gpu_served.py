"""`gpu_all.py`'s served part: the in-process server (`cluster.local_server.LocalServer`, the
stack `cleave serve --in-process` runs: router, HTTP, SSE, in-process engine workers) on the GPU,
aggregated (one worker) and 1P+1D (a prefill and a decode worker on the same GPU, KV over TCP),
loaded by `serving.py`'s load generator at 32 and 256 streams, against the offline engine on
the same requests (`serving_layers.py`'s sweep)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch
from gpu_parts import Shape
from results_io import sig

LAYOUTS = {"agg": "inprocess_agg", "1p1d": "inprocess"}


@contextlib.contextmanager
def thread_server(model: str, layout: dict, threshold: int, torch_threads: int,
                  engine: dict | None = None) -> Iterator[tuple[str, str]]:
    """`serving_layers.inprocess_server`'s stack on a thread of this process (the CPU check:
    no child interpreter to start), as (base URL, model name)."""
    from cluster.local_server import LocalServeConfig, LocalServer

    server = LocalServer(LocalServeConfig(
        model, http_port=0, grpc_port=0, router={"disagg_threshold_tokens": threshold},
        engine=engine or {}, **layout)).start(timeout_s=120)
    try:
        yield f"http://127.0.0.1:{server.http_port}", server.router.model_name
    finally:
        server.stop()


def served(shape: Shape, model: str) -> dict:
    """Output tokens/s of the offline engine, the aggregated server and the 1P+1D server at each
    concurrency, and each server's against the offline engine's
    (`served_{agg,1p1d}_c{c}_vs_offline_ratio`)."""
    import serving_layers as layers

    if shape.small:
        sweep = layers.Sweep((2,), input_len=16, output_len=4, num_prompts=4,
                             disagg_threshold=8, time_limit_s=60)
        options = shape.engine_options(max_num_seqs=4, max_model_len=64)
        server = thread_server
    else:
        sweep = layers.Sweep((32, 256), input_len=128, output_len=64, time_limit_s=120)
        # two engines share the GPU in the 1P+1D server: each gets a fixed KV cache
        options = shape.engine_options(max_num_seqs=256, max_model_len=1024,
                                       kv_cache_memory_bytes=16 << 30)
        server = layers.inprocess_server
    vocab = layers.vocab_of(model)
    levels = {"offline": layers.run_offline(model, sweep, vocab, options)}
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the offline engine's memory, before the servers' engines
    for name, layer in LAYOUTS.items():
        with server(model, layers.INPROCESS_LAYOUTS[layer], sweep.disagg_threshold, 0,
                    options) as (base_url, model_name):
            levels[name] = layers.run_server(base_url, model_name, sweep, vocab,
                                             {"server": ""})
    out: dict = {"concurrencies": list(sweep.concurrencies), "input_len": sweep.input_len,
                 "output_len": sweep.output_len}
    for c in sweep.concurrencies:
        offline = levels["offline"][c]["output_throughput"]
        out[f"offline_c{c}_tokens_per_s"] = offline
        for name in LAYOUTS:
            run = levels[name][c]
            out[f"served_{name}_c{c}_tokens_per_s"] = run["output_throughput"]
            out[f"served_{name}_c{c}_completed"] = f"{run['completed']}/{run['requests']}"
            out[f"served_{name}_c{c}_itl_p50_ms"] = run.get("itl", {}).get("p50_ms")
            out[f"served_{name}_c{c}_vs_offline_ratio"] = (
                sig(run["output_throughput"] / offline) if offline else None)
    return out
