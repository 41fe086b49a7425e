"""`serving.py --layers`: one fixed-concurrency sweep through Cleave's layers on the same
requests, with transformers as the peer.

At each concurrency c, the same N requests (random token ids, seeded by c, exactly
`input_len` tokens, `output_len` output tokens with ignore_eos) go through:

- `offline`: one `workers.engine.core.Engine` in this process, stepped with c requests in it at once
  (the next added as one finishes); output tokens/s, and each step's wall time;
- `inprocess_agg`: `cluster.local_server.LocalServer` with one aggregated worker (the offline
  engine plus the router and HTTP), driven by the load generator over streamed HTTP; the
  server runs in a child process, so the client shares no GIL with it (as with the Ray app);
- `inprocess`: the same server with one prefill and one decode worker (KV over TCP);
- `inprocess_ppw`: the same, each worker in a process of its own (`--process-per-worker`, no
  Ray): the router's HTTP work and the engines' steps then hold no GIL in common;
- `ray`: `cleave serve` as a subprocess on its own local Ray, one prefill and one decode replica;
- `transformers`: `model.generate` on static batches of c of the same prompts (left padded,
  max_new_tokens = min_new_tokens = output_len), at the sweep's largest c only.

The ratios compare neighbouring layers on the same requests (`ray_vs_inprocess`: the Ray app
against the in-process server of the same layout; `inprocess*_vs_offline`: a server against the
bare engine), Cleave against transformers at the largest c, and the streamed inter-token latency
p50 at the largest c against the offline engine's step time (p50) there. `--rounds N` runs the
layers N times in turn and reports each figure from its round of median throughput, and each
comparison of two layers as the median of its rounds' ratios (each round's two runs minutes
apart at most, where one layer's runs in different rounds swing by a third here).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import multiprocessing
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable, Iterator

from cpu_budget import CpuBudget, roles_below
from loadgen import RequestSpec, Workload, measure, percentiles_ms

LAYERS = ("offline", "transformers", "inprocess_agg", "inprocess", "inprocess_ppw", "ray",
          "ray_proxy")
NOTE = ("{cores} CPU core(s) shared by every layer's engines, its router and this load generator "
        "(and by other processes on the machine: see load_average_1m); the Ray app's replicas "
        "run one torch thread each, the offline engine and the in-process servers' engines "
        "{threads} (torch_threads)")
INPROCESS_LAYOUTS = {"inprocess_agg": {"num_workers": 1},
                     "inprocess": {"num_prefill_workers": 1, "num_decode_workers": 1},
                     "inprocess_ppw": {"num_prefill_workers": 1, "num_decode_workers": 1,
                                       "process_per_worker": True}}


@dataclass(frozen=True)
class Sweep:
    """The requests of every level; the same for every layer."""

    concurrencies: tuple[int, ...]
    input_len: int = 128
    output_len: int = 64
    num_prompts: int | None = None  # per level; None: max(16, 2 x concurrency)
    seed: int = 0
    disagg_threshold: int = 64  # the servers' RouterConfig.disagg_threshold_tokens
    time_limit_s: float = 600.0  # per level and layer: requests not started by then fail

    def __post_init__(self) -> None:
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError(f"concurrencies must be >= 1, got {self.concurrencies}")

    def workload(self, concurrency: int, warmup: int = 0) -> Workload:
        n = self.num_prompts or max(16, 2 * concurrency)
        return Workload("random", n, self.input_len, self.output_len,
                        max_concurrency=concurrency, warmup=warmup, seed=self.seed + concurrency)


def run_offline(model: str, sweep: Sweep, vocab_size: int,
                engine_options: dict | None = None) -> dict[int, dict]:
    """The bare engine at each concurrency: {c: figures}. `engine_options`: EngineConfig's
    (device, dtype, load_format, ...), as the servers get them."""
    from workers.engine.config import EngineConfig
    from workers.engine.core import Engine

    engine = Engine(EngineConfig(model=model, **(engine_options or {})))
    try:
        warm = sweep.workload(1, warmup=2)
        _step_engine(engine, warm.warmup_specs(vocab_size), 2, "warm")
        return {c: _step_engine(engine, sweep.workload(c).specs(vocab_size), c, f"c{c}")
                for c in sweep.concurrencies}
    finally:
        engine.close()


def _step_engine(engine, specs: list[RequestSpec], concurrency: int,  # noqa: ANN001 - Engine
                 prefix: str) -> dict:
    """Step `engine` over `specs`, keeping `concurrency` of them in it; figures of the run."""
    from workers.contract.protocol import SamplingParams, WorkerRequest

    pending = list(reversed(specs))
    added: dict[str, float] = {}  # request id -> when it was added
    last: dict[str, float] = {}  # request id -> its latest token's time
    ttft, itl, steps = [], [], []
    tokens = finished = 0

    def add() -> None:
        spec = pending.pop()
        rid = f"{prefix}-{len(added)}"
        params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True)
        engine.generate(WorkerRequest(rid, tuple(spec.prompt), params))
        added[rid] = time.perf_counter()

    start = time.perf_counter()
    while pending and len(added) - finished < concurrency:
        add()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        events = engine.step()
        now = time.perf_counter()
        steps.append(now - t0)
        for e in events:
            if e.token_ids:
                tokens += len(e.token_ids)
                if e.request_id in last:
                    itl.append(now - last[e.request_id])
                else:
                    ttft.append(now - added[e.request_id])
                last[e.request_id] = now
            if e.finish_reason is not None:
                finished += 1
        while pending and len(added) - finished < concurrency:
            add()
    duration = time.perf_counter() - start
    expected = sum(s.max_tokens for s in specs)
    return {"requests": len(specs), "completed": finished, "failed": len(specs) - finished,
            "output_tokens": tokens, "expected_output_tokens": expected,
            "duration_s": round(duration, 2), "output_throughput": round(tokens / duration, 1),
            "steps": len(steps), "step": percentiles_ms(steps), "ttft": percentiles_ms(ttft),
            "itl": percentiles_ms(itl)}


def run_transformers(model: str, sweep: Sweep, vocab_size: int) -> dict[int, dict]:
    """transformers `generate` over static batches at the sweep's largest concurrency."""
    import torch
    from transformers import AutoModelForCausalLM

    c = max(sweep.concurrencies)
    specs = sweep.workload(c).specs(vocab_size)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    pad, n_out = 0, sweep.output_len
    with torch.inference_mode():
        hf.generate(torch.tensor([specs[0].prompt[:16]]), max_new_tokens=2, do_sample=False,
                    eos_token_id=None, pad_token_id=pad)  # warm-up
        start = time.perf_counter()
        for i in range(0, len(specs), c):
            batch = [list(s.prompt) for s in specs[i:i + c]]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=n_out,
                              min_new_tokens=n_out, do_sample=False, eos_token_id=None,
                              pad_token_id=pad)
            if out.shape[1] - width != n_out:
                raise RuntimeError(f"transformers made {out.shape[1] - width} tokens, not {n_out}")
        duration = time.perf_counter() - start
    tokens = len(specs) * n_out
    return {c: {"requests": len(specs), "completed": len(specs), "failed": 0,
                "batch_size": c, "output_tokens": tokens, "duration_s": round(duration, 2),
                "output_throughput": round(tokens / duration, 1)}}


def run_server(base_url: str, model_name: str, sweep: Sweep, vocab_size: int,
               roles: dict[str, str]) -> dict[int, dict]:
    """The load generator against a running server at each concurrency (warm-up first), with
    the CPU each role's processes spent per output token (`cpu_budget`; `roles`: role ->
    a marker of its processes' command lines)."""
    out = {}
    budget = CpuBudget(roles_below(roles))
    for i, c in enumerate(sweep.concurrencies):
        budget.start()
        summary, _ = measure(base_url, model_name, sweep.workload(c, warmup=2 if i == 0 else 0),
                             math.inf, vocab_size, sweep.time_limit_s)
        summary |= budget.stop(summary["output_throughput"] * summary["duration_s"])
        out[c] = summary
    return out


def run_inprocess(model: str, sweep: Sweep, vocab_size: int, layer: str,
                  torch_threads: int, engine_options: dict | None = None) -> dict[int, dict]:
    with inprocess_server(model, INPROCESS_LAYOUTS[layer], sweep.disagg_threshold,
                          torch_threads, engine_options) as (base_url, model_name):
        return run_server(base_url, model_name, sweep, vocab_size, {"server": ""})


@contextlib.contextmanager
def inprocess_server(model: str, layout: dict, threshold: int, torch_threads: int,
                     engine: dict | None = None) -> Iterator[tuple[str, str]]:
    """A `LocalServer` of `layout` (`engine`: EngineConfig options) in a child process, as
    (base URL, model name): the load generator then shares no interpreter (GIL) with the
    router and engines, as with the Ray app. Stopped on exit."""
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    # a daemonic process may not start processes of its own (`process_per_worker`); this
    # one is stopped below either way
    child = ctx.Process(target=_serve_in_child, name="cleave-inprocess",
                        daemon=not layout.get("process_per_worker", False),
                        args=(model, layout, threshold, torch_threads, child_conn,
                              engine or {}))
    child.start()
    child_conn.close()  # the child's end: recv() then sees EOF if the child dies
    try:
        if not conn.poll(300):
            raise TimeoutError("the in-process server did not start within 300s")
        port, model_name = conn.recv()  # EOFError: it failed (its traceback is on stderr)
        yield f"http://127.0.0.1:{port}", model_name
    finally:
        conn.close()  # the child stops its server when the pipe closes
        child.join(60)
        if child.is_alive():
            child.terminate()


def _serve_in_child(model: str, layout: dict, threshold: int, torch_threads: int,
                    conn: Connection, engine: dict) -> None:
    """A `LocalServer` until `conn` closes; sends (HTTP port, model name) once it listens."""
    import torch

    from cluster.local_server import LocalServeConfig, LocalServer

    if torch_threads:
        torch.set_num_threads(torch_threads)
    layout = dict(layout)
    per_process = layout.pop("process_per_worker", False)
    server = LocalServer(LocalServeConfig(
        model, http_port=0, grpc_port=0, router={"disagg_threshold_tokens": threshold},
        engine=engine, **layout), process_per_worker=per_process).start(timeout_s=300)
    try:
        conn.send((server.http_port, server.router.model_name))
        try:
            conn.recv()
        except EOFError:
            pass
    finally:
        server.stop()


def run_ray(model: str, sweep: Sweep, vocab_size: int, num_cpus: float,
            ingress: str = "direct") -> dict:
    """{c: figures} plus "_stop": how `cleave serve` ended. `ingress`: direct (the router
    replicas serve the ports) or serve (Ray Serve's proxies in front)."""
    from serving_ray import RayApp

    t0 = time.perf_counter()
    for attempt in (1, 2):  # once more if it exits before ready (seen once, signalled)
        app = RayApp(model, "bench", disagg_threshold=sweep.disagg_threshold, num_cpus=num_cpus,
                     extra_args=("--ingress", ingress))
        try:
            app.start()
            break
        except RuntimeError as exc:
            if attempt == 2:
                raise
            print(f"  ray: cleave serve did not start ({str(exc)[:200]}); trying once more")
    started_s = time.perf_counter() - t0
    try:
        out: dict = run_server(app.base_url, "bench", sweep, vocab_size,
                               {"router": "cleave:router", "engines": "EngineActor"})
    finally:
        stop = app.stop()
    return out | {"_stop": stop | {"start_s": round(started_s, 1), "start_attempts": attempt}}


def run_layer(layer: str, model: str, sweep: Sweep, vocab_size: int, ray_num_cpus: float,
              torch_threads: int) -> dict:
    if layer == "offline":
        return run_offline(model, sweep, vocab_size)
    if layer == "transformers":
        return run_transformers(model, sweep, vocab_size)
    if layer in INPROCESS_LAYOUTS:
        return run_inprocess(model, sweep, vocab_size, layer, torch_threads)
    if layer == "ray":
        return run_ray(model, sweep, vocab_size, ray_num_cpus)
    if layer == "ray_proxy":
        return run_ray(model, sweep, vocab_size, ray_num_cpus, ingress="serve")
    raise ValueError(f"layer must be one of {LAYERS}, got {layer!r}")


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def ratios(runs: dict[str, list[dict]], levels: dict[str, dict],
           concurrencies: tuple[int, ...]) -> dict[str, float | None]:
    """The comparisons between the layers that ran (keys end in `_ratio`). A comparison of two
    layers is the median over rounds of the ratio within each round (`runs`: each layer's
    rounds, in the order they ran): the two ran minutes apart at most, where runs of one layer
    in different rounds swing by a third on this machine. `levels` (each layer's round of
    median throughput) gives the bounds a layer is compared with alone."""
    def tput(c: int) -> Callable[[dict], float | None]:
        def read(round_: dict) -> float | None:
            run = round_.get(c)
            return run["output_throughput"] if run and not run["failed"] else None
        return read

    def paired(a: str, b: str, of_a: Callable[[dict], float | None],
               of_b: Callable[[dict], float | None]) -> float | None:
        values = [x / y for ra, rb in zip(runs[a], runs[b]) if (x := of_a(ra)) and (y := of_b(rb))]
        return round(statistics.median(values), 3) if values else None

    out: dict[str, float | None] = {}
    top = max(concurrencies)
    pairs = [("ray", "inprocess"), ("inprocess", "offline"), ("inprocess_agg", "offline"),
             ("inprocess_ppw", "offline"), ("inprocess_ppw", "inprocess"), ("ray", "ray_proxy")]
    for a, b in pairs:
        if a in levels and b in levels:
            for c in concurrencies:
                out[f"{a}_vs_{b}_c{c}_ratio"] = paired(a, b, tput(c), tput(c))
    if "transformers" in levels:
        for a in ("ray", "inprocess", "inprocess_agg", "inprocess_ppw", "offline"):
            if a in levels:
                out[f"{a}_vs_transformers_ratio"] = paired(a, "transformers", tput(top),
                                                           tput(top))
    if "offline" in levels and top in levels["offline"]:
        def step(round_: dict) -> float | None:
            return round_[top]["step"]["p50_ms"] if top in round_ else None

        for a in ("ray", "inprocess", "inprocess_agg", "inprocess_ppw"):
            if a in levels and top in levels[a]:
                # ITL: gaps between streamed chunks (near 0 when a client reads several at
                # once); TPOT: each request's decode time per token, which bursts do not skew
                for metric in ("itl", "tpot"):
                    out[f"{a}_{metric}_p50_vs_offline_step_ratio"] = paired(
                        a, "offline", lambda r, m=metric: r[top][m]["p50_ms"] if top in r else None,
                        step)
    for a in ("ray", "inprocess", "inprocess_agg", "inprocess_ppw"):
        for c in concurrencies if a in levels else ():
            # near 1: every core was busy, so only fewer microseconds per token can help
            out[f"{a}_c{c}_tokens_vs_cpu_bound_ratio"] = _ratio(
                tput(c)(levels[a]), levels[a].get(c, {}).get("cpu_bound_tokens_per_s"))
    return out


def vocab_of(model: str) -> int:
    """Prompt ids are drawn below this: the model's vocabulary (at most 32,000)."""
    from workers.models.model_config import ModelConfig

    return min(ModelConfig.from_pretrained(model).vocab_size, 32000)


def sweep_model(model: str, layers: list[str], sweep: Sweep, ray_num_cpus: float,
                torch_threads: int, rounds: int = 1) -> dict:
    """Every layer in `layers` on `model`, `rounds` times in turn (layer after layer, then
    again), each (layer, c) reported by its round of median throughput, the rounds' figures
    beside it: {"levels": {layer: {c: figures}}, "ratios": ...}. On a shared 2-core machine one
    pass swings by a third; interleaved rounds spread the swings over every layer alike."""
    vocab_size = vocab_of(model)
    runs: dict[str, list[dict]] = {}
    seconds: dict[str, float] = {}
    errors: dict[str, str] = {}
    for _ in range(rounds):
        for layer in layers:
            if layer in errors:
                continue
            t0 = time.perf_counter()
            try:
                got = run_layer(layer, model, sweep, vocab_size, ray_num_cpus, torch_threads)
            except Exception as exc:  # one failing layer (say, Ray) still reports the others
                errors[layer] = f"{type(exc).__name__}: {exc}"[-2000:]
                print(f"  {layer}: FAILED {errors[layer]}")
                continue
            finally:
                seconds[layer] = round(seconds.get(layer, 0) + time.perf_counter() - t0, 1)
                gc.collect()  # the layer's engines and KV caches, before the next layer's
            runs.setdefault(layer, []).append(got)
            for c, run in got.items():
                if isinstance(c, int):
                    print(f"  {layer} c={c}: {run['output_throughput']} tok/s, "
                          f"{run['completed']}/{run['requests']} ok, ITL p50 "
                          f"{run.get('itl', {}).get('p50_ms')} ms, TTFT p50 "
                          f"{run.get('ttft', {}).get('p50_ms')} ms")
    levels = {layer: _median_rounds(got) for layer, got in runs.items() if layer not in errors}
    return {"levels": levels, "rounds": rounds, "layer_seconds": seconds, "errors": errors,
            "ratios": ratios({layer: got for layer, got in runs.items() if layer not in errors},
                             levels, sweep.concurrencies),
            "load_average_1m": round(os.getloadavg()[0], 2)}


def _median_rounds(rounds: list[dict]) -> dict:
    """One layer's rounds as one: per concurrency, the round of median throughput (of an even
    count, the lower middle one), with every round's throughput under
    "rounds_output_throughput"; other keys from the last round."""
    merged = dict(rounds[-1])
    for c in [k for k in merged if isinstance(k, int)]:
        ordered = sorted((r[c] for r in rounds if c in r), key=lambda f: f["output_throughput"])
        merged[c] = dict(ordered[(len(ordered) - 1) // 2],
                         rounds_output_throughput=[r[c]["output_throughput"] for r in rounds
                                                   if c in r])
    return merged


def resolve_model(name: str, tmp: str) -> str:
    """tiny: the embedded default `cleave serve` uses; small: the preset, written under `tmp`;
    anything else: a model folder."""
    if name == "tiny":
        from workers.models.make_model import default_model_path

        return str(default_model_path())
    if name == "small":
        from workers.models.make_model import make_model

        return str(make_model(Path(tmp) / "small", arch="llama", preset="small"))
    if not Path(name, "config.json").is_file():
        raise ValueError(f"--models: {name!r} is neither tiny, small nor a model folder")
    return name


def code_state() -> dict:
    """The commit measured, and the serving code's files that differed from it (uncommitted)."""
    import subprocess

    root = Path(__file__).parents[1]

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True).stdout

    changed = git("status", "--porcelain", "--", "workers", "router", "cluster", "kvtransfer")
    return {"commit": git("rev-parse", "HEAD").strip(),
            "uncommitted": sorted(line[3:] for line in changed.splitlines())}


def layers_main(args: argparse.Namespace, command: str) -> dict:
    """The sweep `serving.py --layers` describes, for each model; emits and returns the JSON."""
    import torch
    from results_io import RESULTS, emit

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    sweep = Sweep(args.concurrencies, args.input_len, args.output_len or 64, args.num_prompts,
                  args.seed, args.disagg_threshold, args.time_limit_s)
    result: dict = {"benchmark": "serving_layers", "command": command,
                    "layers": args.layer_list, "sweep": dataclasses.asdict(sweep),
                    "torch_threads": torch.get_num_threads(),
                    "cpu_cores": len(os.sched_getaffinity(0)), "code": code_state(),
                    "models": {}}
    with tempfile.TemporaryDirectory(prefix="cleave-bench-") as tmp:
        for entry in args.models.split(","):
            name, _, path = entry.rpartition("=")
            name = name or Path(path).name
            model = resolve_model(path, tmp)
            print(f"{name} ({model}):")
            report = sweep_model(model, args.layer_list, sweep, args.ray_num_cpus,
                                 args.torch_threads, args.rounds)
            if args.guidellm:
                from serving_guidellm import compare_guidellm

                c = max(sweep.concurrencies)
                with inprocess_server(model, INPROCESS_LAYOUTS["inprocess"],
                                      sweep.disagg_threshold, args.torch_threads) as server:
                    report["guidellm"] = compare_guidellm(
                        *server, model, sweep.workload(c, warmup=2), vocab_of(model),
                        args.guidellm_bin, sweep.time_limit_s)
                report["ratios"]["guidellm_vs_loadgen_ratio"] = report["guidellm"]["ratio"]
            result["models"][name] = report
            for key, value in report["ratios"].items():
                result[f"{name}_{key}"] = value
                print(f"  {key}: {value}")
    result["note"] = NOTE.format(cores=result["cpu_cores"], threads=result["torch_threads"])
    return emit(result, Path(args.out or RESULTS / "serving_layers.json"))
