"""guidellm as an outside client: its own measurement of a server (`serving.py --layers
--guidellm`: the in-process server, one prefill and one decode worker, at the sweep's largest
concurrency) against the load generator's on the same server in the same run, as
`guidellm_vs_loadgen_ratio` (output tokens/s; near 1: both clients see the same server).

guidellm (`pip install -e .[bench]`) sends its own synthetic text prompts of `input_len` tokens
(by the model's tokenizer), `output_len` output tokens with ignore_eos, `/v1/completions`
streamed, `concurrency` streams, as many requests as the load generator sends. Its streams run
in one worker process (`GUIDELLM__MAX_WORKER_PROCESSES=1`), as the load generator's run in one
event loop: by default it starts 10, which on a 2-core machine took about 0.8 of a core from
the server it measured (the tiny model at 64 streams).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadgen import Workload, measure


def find_guidellm(explicit: str | None) -> str:
    """The guidellm command: `explicit`, else the one next to this Python, else on PATH."""
    for candidate in (explicit, str(Path(sys.executable).parent / "guidellm"),
                      shutil.which("guidellm")):
        if candidate and Path(candidate).is_file():
            return candidate
    raise FileNotFoundError("guidellm is not installed (pip install -e .[bench], or pass "
                            "--guidellm-bin)")


def guidellm_command(guidellm: str, base_url: str, model_name: str, tokenizer: str,
                     concurrency: int, num_requests: int, input_len: int, output_len: int,
                     out: Path) -> list[str]:
    return [guidellm, "run",
            "--backend", json.dumps({"kind": "openai_http", "target": base_url,
                                     "model": model_name, "request_format": "/v1/completions",
                                     "http2": False, "timeout": 600}),
            "--profile", json.dumps({"kind": "concurrent", "streams": [concurrency]}),
            "--data", json.dumps({"kind": "synthetic_text", "prompt_tokens": input_len,
                                  "output_tokens": output_len}),
            "--tokenizer", json.dumps({"kind": "huggingface_auto", "model": tokenizer}),
            "--constraint", json.dumps({"kind": "max_requests", "count": num_requests}),
            "--output", json.dumps({"kind": "json", "path": str(out)}),
            "--disable-console-interactive"]


def guidellm_figures(report: dict[str, Any]) -> dict[str, Any]:
    """The (one) benchmark of guidellm's JSON report: output tokens/s (successful requests'
    output tokens over the benchmark's duration), request counts, TTFT and ITL medians."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]
    tokens = m["output_token_count"]["successful"]["total_sum"]
    return {"output_throughput": round(tokens / bench["duration"], 1),
            "output_tokens": tokens, "duration_s": round(bench["duration"], 2),
            "request_totals": m["request_totals"],
            "ttft_p50_ms": round(m["time_to_first_token_ms"]["successful"]["median"], 2),
            "itl_p50_ms": round(m["inter_token_latency_ms"]["successful"]["median"], 2)}


def compare_guidellm(base_url: str, model_name: str, tokenizer: str, workload: Workload,
                     vocab_size: int, guidellm_bin: str | None,
                     time_limit_s: float | None = None) -> dict:
    """The load generator, then guidellm, against the server at `base_url`, with `workload`'s
    concurrency, request count and lengths; both figures and the ratio."""
    guidellm = find_guidellm(guidellm_bin)
    c = workload.max_concurrency
    if c is None:
        raise ValueError("the workload must set max_concurrency (guidellm's streams)")
    loadgen, _ = measure(base_url, model_name, workload, math.inf, vocab_size, time_limit_s)
    with tempfile.TemporaryDirectory(prefix="cleave-guidellm-") as tmp:
        out = Path(tmp) / "guidellm.json"
        cmd = guidellm_command(guidellm, base_url, model_name, tokenizer, c,
                               workload.num_prompts, workload.input_len, workload.output_len,
                               out)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                              env={**os.environ, "GUIDELLM__MAX_WORKER_PROCESSES": "1"})
        seconds = time.perf_counter() - t0
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"guidellm failed ({proc.returncode}): "
                               f"{(proc.stderr or proc.stdout)[-2000:]}")
        guide = guidellm_figures(json.loads(out.read_text()))
    rate = loadgen["output_throughput"]
    return {"concurrency": c, "requests": workload.num_prompts,
            "loadgen": {k: loadgen[k] for k in ("completed", "failed", "output_throughput",
                                                 "duration_s")}
            | {"ttft_p50_ms": loadgen["ttft"]["p50_ms"], "itl_p50_ms": loadgen["itl"]["p50_ms"]},
            "guidellm": guide, "guidellm_seconds": round(seconds, 1),
            "ratio": round(guide["output_throughput"] / rate, 3) if rate else None,
            "command": " ".join(["GUIDELLM__MAX_WORKER_PROCESSES=1", "guidellm", cmd[1]]
                                + [repr(x) if x.startswith("{") else x for x in cmd[2:]])}
