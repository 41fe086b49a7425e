"""What OpenTelemetry tracing costs the in-process disaggregated server (`serving.py --layers
inprocess`'s layout: one prefill and one decode worker, KV over TCP, in a child process).

Two servers run side by side for the whole run, on the same model and the same requests:
`off` (no `OTEL_*` endpoint: `workers.contract.tracing` is a shared no-op and imports nothing
of OpenTelemetry, the default) and `on` (an endpoint set: every request's spans, router and
workers, made and exported over OTLP/HTTP to a receiver in this process that decodes nothing
and answers 200). They are measured alternately, `--rounds` times (off, on, off, on, ...), so
the machine's load swings hit both alike. Reported: each arm's output tokens/s per round, the
median of the per-round `on / off` ratios (`on_vs_off_throughput_ratio`), and the noise: the
median of `off`'s round-to-round ratios (`off_vs_off_throughput_ratio` spread), the ratio an
arm shows against itself.

`off` does strictly less than `on` (the same calls, each returning at its first check), so an
`on` within the noise of `off` bounds what `off` costs against a tree without tracing code.

Last line: one JSON object; also written to benchmarks/results/tracing_overhead.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from results_io import RESULTS, command_line, emit
from serving_layers import (
    INPROCESS_LAYOUTS,
    Sweep,
    inprocess_server,
    resolve_model,
    run_server,
    vocab_of,
)

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


class Sink(ThreadingHTTPServer):
    """An OTLP/HTTP endpoint that takes every export (counting its bytes) and answers 200."""

    def __init__(self) -> None:
        self.num_bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                sink.num_bytes += len(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@contextlib.contextmanager
def _environment(endpoint: str | None) -> Iterator[None]:
    """The tracing environment `endpoint` gives (None: none), while the block runs (a spawned
    server copies it as it starts)."""
    saved = {k: os.environ.pop(k, None) for k in _ENDPOINT_VARS}
    if endpoint is not None:
        os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = endpoint
    try:
        yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny, small or a model folder")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=48, help="per measurement")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS / "tracing_overhead.json"))
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error(f"--rounds must be at least 2 (the noise needs two), got {args.rounds}")
    import tempfile

    sink = Sink()
    sweep = Sweep((args.concurrency,), args.input_len, args.output_len, args.num_prompts,
                  disagg_threshold=16)
    endpoints = {"off": None, "on": f"http://127.0.0.1:{sink.server_address[1]}/v1/traces"}
    tput: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model = resolve_model(args.model, tmp)
        arms = {}
        for name, endpoint in endpoints.items():
            with _environment(endpoint):
                arms[name] = stack.enter_context(inprocess_server(
                    model, INPROCESS_LAYOUTS["inprocess"], sweep.disagg_threshold,
                    args.torch_threads))
        for i in range(args.rounds + 1):  # round 0 warms both up, unreported
            # new prompts each round (none cached: each is handed off), the same for both arms
            prompts = dataclasses.replace(sweep, seed=1000 * i)
            for name, (base_url, model_name) in arms.items():
                got = run_server(base_url, model_name, prompts, vocab_of(model), {"server": ""})
                if i > 0:
                    tput[name].append(got[args.concurrency]["output_throughput"])
    sink.shutdown()
    on_vs_off = [on / off for on, off in zip(tput["on"], tput["off"])]
    off_vs_off = [b / a for a, b in zip(tput["off"], tput["off"][1:])]
    result = {
        "benchmark": "tracing_overhead", "command": command_line(argv),
        "layout": "inprocess (1 prefill + 1 decode worker, KV over TCP)",
        "concurrency": args.concurrency, "num_prompts": args.num_prompts,
        "input_len": args.input_len, "output_len": args.output_len, "rounds": args.rounds,
        "output_tokens_per_s": tput, "span_bytes_exported": sink.num_bytes,
        "on_vs_off_per_round": on_vs_off,
        "on_vs_off_throughput_ratio": statistics.median(on_vs_off),
        "off_vs_off_throughput_ratio": statistics.median(off_vs_off),
        "noise_off_vs_off_range": [min(off_vs_off), max(off_vs_off)],
    }
    return emit(result, args.out)


if __name__ == "__main__":
    main()
