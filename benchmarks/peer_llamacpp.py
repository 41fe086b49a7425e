"""Cleave against llama.cpp's server on the same weights, full precision and quantized, one run.

The peer: `llama-server` built from the `llama-cpp-python` source distribution's vendored
llama.cpp (downloaded from the package registry, built with cmake for this CPU, cached under
`--cache`; not a dependency of Cleave). The weights: one `make-model` checkpoint (default the
`small` preset, ~40M parameters, fp32) converted by llama.cpp's own `convert_hf_to_gguf.py` to
F32 GGUF (its tokenizer check is bypassed: the prompts are token ids, so the tokenizer never
runs) and quantized by `llama-quantize` to Q8_0 and Q4_0; for Cleave, the same checkpoint and
`cleave quantize` copies in compressed-tensors int8 (one scale per output channel) and int4
(groups of 32, as Q4_0's blocks), each with its output projection in int8 (`--quantize-lm-head`:
llama-quantize stores `output.weight` in Q8_0 and Q6_K in its files). Pairs: fp32 against F32,
int8 against Q8_0, int4 against Q4_0 (Cleave's quantized pairs run in bf16, where its packed
kernels run).

The workload (`benchmarks/serving.py`'s load generator, `loadgen.py`): random token-id prompts
of `--input-len` tokens, `--output-len` tokens out (ignore_eos), streamed `/v1/completions` at a
fixed concurrency (1, 8, 32), the same requests for both servers, on the same cores:
`llama-server -np 32 -t <threads>` and `cleave serve --in-process` (one aggregated worker,
`<threads>` torch threads), each in a child process.

This shared 2-core machine's speed changes within minutes (15-25% between runs, and a run of
either server alone moves its ratio at one stream by +-0.2), so both servers of a pair are up at
once and measured in turn at each concurrency, who goes first alternating by round: each
round's ratio pairs two runs seconds apart. An idle server's CPU while the other is measured is
reported (`idle_cpu_s`: both servers' threads sleep when idle). Each pair runs `--rounds` rounds
(default 5). Reported per pair and concurrency: output tokens/s, TTFT and ITL p50/p99 of both
(medians over rounds), each round's throughput ratio, and
`cleave_vs_llamacpp_<pair>_c<c>_ratio` (output tokens/s, Cleave over llama.cpp: the median of the
rounds' paired ratios), plus the inter-token latency p50 ratio at concurrency 1
(`..._itl_p50_c1_ratio`, Cleave over llama.cpp, median of the paired rounds: under 1 is faster).

Last line: one JSON object; also written to benchmarks/results/peer_llamacpp.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from loadgen import measure
from results_io import RESULTS, command_line, emit
from serving_layers import Sweep, inprocess_server
from serving_ray import ServerProcess, free_ports

VERSION = "0.3.36"  # llama-cpp-python's sdist (its vendored llama.cpp)
# int8 / int4 in float32 with the weights kept packed (`fp32_int_kernels`): a decode step then runs
# every layer in one C call (workers/models/fused_layer.py), where bf16 activations run them one
# kernel at a time; measured (benchmarks/small_gemm.py, engine section, paired in the same minutes
# on this 2-core machine, one run, quiet): int8 1.67 / 4.23 / 6.98 ms a decode step at 1 / 4 / 8
# streams against bf16's 3.60 / 6.82 / 9.07, int4 1.40 / 4.75 / 8.71 against 3.18 / 6.59 / 10.94
# (2.1x / 1.5x / 1.3x)
PAIRS = {  # name: (cleave checkpoint, cleave engine options, llama.cpp GGUF type)
    "fp32": ("fp32", {"dtype": "float32"}, "f32"),
    "int8": ("int8", {"dtype": "float32", "fp32_int_kernels": True}, "q8_0"),
    "int4": ("int4", {"dtype": "float32", "fp32_int_kernels": True}, "q4_0"),
}
_CONVERT = '''import runpy, sys
from pathlib import Path
root = Path(sys.argv[1]); sys.path.insert(0, str(root)); sys.path.insert(1, str(root / "gguf-py"))
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
def _no_sentencepiece(self, *args, **kwargs):
    raise FileNotFoundError("a tokenizer.json model")
base.TextModel._set_vocab_sentencepiece = _no_sentencepiece
sys.argv = [str(root / "convert_hf_to_gguf.py"), *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


# /proc/cpuinfo flag -> the ggml option building for it, for a build without AMX
GGML_ISA = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
            "bmi2": "GGML_BMI2", "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
            "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
            "avx_vnni": "GGML_AVX_VNNI"}


def isa_options() -> list[str]:
    """cmake options for this CPU: native, except where it lists AMX tiles. There (a VM of this
    project's) llama.cpp's q8_0 AMX kernel stopped llama-server on an invalid opcode
    (`tilezero` before any tile configuration), so the build takes every other extension the CPU
    lists, one by one."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if "amx_tile" not in flags:
        return ["-DGGML_NATIVE=ON"]
    return ["-DGGML_NATIVE=OFF", *(f"-D{opt}={'ON' if flag in flags else 'OFF'}"
                                   for flag, opt in GGML_ISA.items())]


def llama_cpp(cache: Path) -> Path:
    """The vendored llama.cpp source tree with `build/bin/llama-server` built (cached)."""
    tree = cache / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    options = isa_options()
    stamp = tree / "build" / "cleave-options"  # what the cached build was configured with
    if ((tree / "build" / "bin" / "llama-server").exists() and stamp.exists()
            and stamp.read_text() == " ".join(options)):
        return tree
    sdist = cache / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", f"llama-cpp-python=={VERSION}", "-d", str(cache)], check=True)
    if not tree.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    subprocess.run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", *options,
                    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF"], cwd=tree, check=True)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server", "llama-quantize",
                    f"-j{os.cpu_count()}"], cwd=tree, check=True)
    stamp.write_text(" ".join(options))
    return tree


def checkpoints(cache: Path, preset: str, tree: Path) -> tuple[dict[str, Path], dict[str, Path]]:
    """(Cleave's checkpoints by name, llama.cpp's GGUF files by type), written once."""
    from workers.models.make_model import make_model
    from workers.quant.writer import quantize_checkpoint

    fp32 = cache / f"llama-{preset}"
    if not (fp32 / "config.json").exists():
        make_model(fp32, arch="llama", preset=preset)
    cleave = {"fp32": fp32}
    for name, bits, group in (("int8", 8, None), ("int4", 4, 32)):
        # the output projection in int8 too, as llama-quantize stores output.weight in Q8_0 and
        # Q6_K in these files (`cleave quantize --quantize-lm-head`)
        path = cache / f"llama-{preset}-{name}-qhead"
        if not (path / "config.json").exists():
            quantize_checkpoint(fp32, path, "compressed-tensors", bits=bits, group_size=group,
                                lm_head=True)
        cleave[name] = path
    gguf = {"f32": cache / f"llama-{preset}-f32.gguf"}
    if not gguf["f32"].exists():
        script = cache / "convert_no_tokenizer_check.py"
        script.write_text(_CONVERT)
        subprocess.run([sys.executable, str(script), str(tree), str(fp32), "--outtype", "f32",
                        "--outfile", str(gguf["f32"])], check=True, capture_output=True)
    for kind in ("q8_0", "q4_0"):
        gguf[kind] = cache / f"llama-{preset}-{kind}.gguf"
        if not gguf[kind].exists():
            subprocess.run([str(tree / "build/bin/llama-quantize"), str(gguf["f32"]),
                            str(gguf[kind]), kind.upper()], check=True, capture_output=True)
    return cleave, gguf


class LlamaServer(ServerProcess):
    """`llama-server` on a free port: `-np` slots, `threads` threads, a context for them all."""

    def __init__(self, tree: Path, gguf: Path, slots: int, threads: int, ctx: int) -> None:
        (self.http_port,) = free_ports(1)
        self.command = [str(tree / "build/bin/llama-server"), "-m", str(gguf), "--host",
                        "127.0.0.1", "--port", str(self.http_port), "-np", str(slots),
                        "-t", str(threads), "-tb", str(threads), "-c", str(ctx)]

    def start(self, timeout_s: float = 120.0) -> LlamaServer:
        self._spawn()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.stderr_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self._terminate(10)
        raise TimeoutError("llama-server not ready")

    def stop(self) -> None:
        self._terminate(30)


def level(base_url: str, model: str, sweep: Sweep, c: int, vocab: int, warmup: int,
          round_: int) -> dict:
    """One server's figures at concurrency `c` (`warmup` requests first, not counted), with
    prompts of round `round_`'s own (a server's prefix cache keeps earlier rounds' prompts)."""
    # a connection per request for both servers: llama-server closes kept-alive ones
    workload = sweep.workload(c, warmup=warmup)
    workload = dataclasses.replace(workload, keep_alive=False,
                                   seed=workload.seed + 1000 * round_)
    summary, _ = measure(base_url, model, workload, math.inf, vocab, sweep.time_limit_s)
    if summary.get("failed"):
        raise RuntimeError(f"{summary['failed']} requests failed at concurrency {c}: "
                           f"{summary.get('errors')}")
    return _figures(summary)


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far, all its threads (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_pair(gguf: Path, cleave_model: str, engine: dict, level_of: Callable[..., dict],
                 concurrencies: tuple[int, ...], ctx: int, tree: Path,
                 args: argparse.Namespace) -> dict:
    """Every round of a pair (llama-server on `gguf`, Cleave on `cleave_model` with `engine`
    options), both servers up at once and measured in turn at each concurrency (who goes first
    alternating by round), so that each ratio pairs two runs seconds apart on this machine,
    whose speed changes within minutes. `level_of(base_url, model, c, warmup, round_)` measures
    one server at one concurrency. Returns per round and concurrency each side's figures, and
    the CPU seconds each server used while the other was measured."""
    server = LlamaServer(tree, gguf, max(concurrencies), args.threads, ctx).start()
    try:
        with inprocess_server(cleave_model, {"num_workers": 1}, 64, args.threads,
                              engine) as (base_url, model_name):
            (child,) = [p for p in multiprocessing.active_children()
                        if p.name == "cleave-inprocess"]
            sides = {"llama_cpp": (server.base_url, gguf.name, server.pid),
                     "cleave": (base_url, model_name, child.pid)}
            rounds: list[dict] = []
            idle_cpu = dict.fromkeys(sides, 0.0)
            for r in range(args.rounds):
                figures: dict = {side: {} for side in sides}
                for c in concurrencies:
                    for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                        url, model, _ = sides[side]
                        (other,) = (s for s in sides if s != side)
                        before = cpu_seconds(sides[other][2])
                        figures[side][c] = level_of(url, model, c, 2 if r == 0 else 0, r)
                        idle_cpu[other] += cpu_seconds(sides[other][2]) - before
                rounds.append(figures)
    except RuntimeError as e:
        raise RuntimeError(f"{gguf.name}: {e}; llama-server's log ends: "
                           f"{server.stderr_tail(1500)}") from None
    finally:
        server.stop()
    return {"rounds": rounds, "idle_cpu_s": {k: round(v, 2) for k, v in idle_cpu.items()}}


def _median_level(levels: list[dict]) -> dict:
    """Each figure's median over rounds (this machine's runs differ by 15-25%)."""
    return {key: round(statistics.median(level[key] for level in levels), 2)
            for key in levels[0]}


def _figures(level: dict) -> dict:
    return {"output_throughput": level["output_throughput"],
            **{f"{k}_{q}_ms": level[k][f"{q}_ms"] for k in ("ttft", "itl") for q in ("p50", "p99")}}


def summarize_pair(pair: str, measured: dict, result: dict) -> dict:
    """A pair's figures by concurrency (medians over rounds, each round's throughput ratio);
    its `_ratio` keys (medians of the rounds' paired ratios) go into `result`."""
    rounds = measured["rounds"]
    levels: dict = {}
    for c in rounds[0]["cleave"]:
        ours = _median_level([r["cleave"][c] for r in rounds])
        peer = _median_level([r["llama_cpp"][c] for r in rounds])
        # each round's ratio pairs two runs seconds apart; their median is the figure
        paired = [r["cleave"][c]["output_throughput"] / r["llama_cpp"][c]["output_throughput"]
                  for r in rounds]
        ratio = statistics.median(paired)
        levels[c] = {"cleave": ours, "llama_cpp": peer,
                     "cleave_rounds": [r["cleave"][c]["output_throughput"] for r in rounds],
                     "llama_cpp_rounds": [r["llama_cpp"][c]["output_throughput"]
                                          for r in rounds],
                     "paired_ratios": [round(x, 3) for x in paired]}
        result[f"cleave_vs_llamacpp_{pair}_c{c}_ratio"] = round(ratio, 3)
        print(f"{pair} c={c}: cleave {ours['output_throughput']:.1f} tok/s, llama.cpp "
              f"{peer['output_throughput']:.1f} tok/s ({ratio:.2f}x: median of {len(rounds)} "
              f"paired rounds)", file=sys.stderr)
    if 1 in levels:
        result[f"cleave_vs_llamacpp_{pair}_itl_p50_c1_ratio"] = round(statistics.median(
            r["cleave"][1]["itl_p50_ms"] / r["llama_cpp"][1]["itl_p50_ms"] for r in rounds), 3)
    return {**levels, "idle_cpu_s": measured["idle_cpu_s"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", default=str(Path.home() / ".cache/cleave/peer_llamacpp"))
    p.add_argument("--preset", default="small")
    p.add_argument("--pairs", default=",".join(PAIRS))
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=5,
                   help="paired rounds per pair (both servers at each concurrency, in turn)")
    p.add_argument("--out", default=str(RESULTS / "peer_llamacpp.json"))
    args = p.parse_args(argv)
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    tree = llama_cpp(cache)
    cleave_ckpts, ggufs = checkpoints(cache, args.preset, tree)
    concurrencies = tuple(int(c) for c in args.concurrency.split(","))
    sweep = Sweep(concurrencies, args.input_len, args.output_len, args.num_prompts)
    from workers.models.model_config import ModelConfig

    vocab = min(ModelConfig.from_pretrained(str(cleave_ckpts["fp32"])).vocab_size, 4096)
    slots = max(concurrencies)
    result: dict = {"command": command_line(argv), "preset": args.preset,
                    "threads": args.threads, "sweep": {"input_len": args.input_len,
                                                      "output_len": args.output_len},
                    "llama_cpp": f"llama-cpp-python {VERSION} (vendored llama.cpp)",
                    "rounds": args.rounds,
                    "pairs": {}}
    for pair in args.pairs.split(","):
        ckpt, engine, kind = PAIRS[pair]
        measured = measure_pair(
            ggufs[kind], str(cleave_ckpts[ckpt]), engine,
            lambda url, model, c, warmup, r: level(url, model, sweep, c, vocab, warmup, r),
            concurrencies, slots * (args.input_len + args.output_len + 16), tree, args)
        result["pairs"][pair] = summarize_pair(pair, measured, result)
    return emit(result, args.out)


if __name__ == "__main__":
    main()
