"""Every GPU figure of issue 52 from one prepared run: at most 8 minutes on one H200.

Parts, in the order they run, each in a process of its own with its own time budget (seconds):
a part that fails, or runs past its budget (killed), is recorded as such in `parts` and the
others still run; the whole run stops starting parts at `--budget-s` (470).

- `roofline_bf16` (130): `gpu_roofline.py` on the Llama-3-8B shape (dummy weights, bf16):
  decode at batch 1/32/128/256 against the bandwidth bound, prefill of 4,096 tokens against the
  matmul bound, 256 concurrent requests against transformers `generate`, decode attention at
  64/256 x 1,024/8,192 against copy bandwidth.
- `served` (140): the in-process server (`cleave serve --in-process`'s stack), aggregated and
  1P+1D on one GPU, at 32 and 256 streams of `serving.py`'s load generator, against the offline
  engine on the same requests (`gpu_served.py`).
- `roofline_int8kv` (55): `gpu_roofline.py --kv-cache-dtype int8`: the decode step at batch 1
  and 256 (1,024-token contexts) over an int8 cache, against `roofline_bf16`'s.
- `decode_profile` (30): batch-1 decode through the CUDA graph under torch.profiler: kernels
  per step (replayed by the graph, launched outside it), GPU busy time, the gaps between GPU
  operations, copies (`gpu_parts.decode_profile`).
- `attention` (40): the Triton decode kernel at 64 x 1,024 at 1/2/4 splits x 32/64/128-key
  tiles (and 8 warps instead of 4 for two of them) against copy bandwidth; the attention
  alone at 256 x 8,192 over an int8 and a bf16 cache, alternated (`gpu_parts.attention`).
- `quant_gemm` (40): `gpu_quant_gemm.py`'s int4 and FP8 kernels on one decode step's
  projections at 1/16/128 rows against bf16 (`gpu_parts.quant_step`).
- `tests_gpu` (55): `pytest tests/gpu`: greedy on the GPU equal to the CPU's with and without
  CUDA graphs, 8-bit caches through the compiled kernels; the TP=2/NCCL tests where 2 GPUs are.
- `tp2` (120): only where 2 GPUs are: `roofline_tp.py`'s TP=2 decode and TP handoffs.

Headline keys (top level; `_ratio` keys are the issue's targets, `targets` and `met` say
which are reached) come from the parts; `detail` holds every part's own figures.

On an H200 (nothing can be downloaded there; torch, triton, transformers, aiohttp and pytest are
installed, Ray is not and is not needed, the server's FastAPI stack is not, so it travels as
wheels). Here, once, in the repository root:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
      --platform manylinux2014_x86_64 -d .whl fastapi==0.165.0 starlette==1.10.0 \\
      pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 \\
      uvicorn==0.54.0 opentelemetry-api==1.45.2 typing_extensions==4.16.0 sniffio==1.3.1 \\
      grpcio==1.85.3 protobuf==7.36.2

(11 MB; the versions this repository's environment runs; grpcio and protobuf because the
committed gRPC code checks their versions at import; the rest the router's HTTP stack needs:
fastapi imports opentelemetry-api, pydantic needs typing_extensions 4.16),

then one device call, carry [".whl"], timeout_s 560:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target \\
      /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit; \\
    python3 benchmarks/gpu_all.py --out $OUT/gpu_all.json 2>&1 | tee $OUT/gpu_all.log

and copy $OUT/gpu_all.json to benchmarks/results/gpu_all.json. A rerun of parts that failed or
ran out of time: `--parts served,quant_gemm --out $OUT/gpu_all_rerun.json`. Without CUDA (or
with `--small`) every part runs in this process on the tiny preset in fp32 (Triton in its
interpreter): the figures are then no GPU figures, only proof that each is written
(`tests/benchmarks/test_gpu_all.py`).

Last line: one JSON object; also written to `--out` with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
from gpu_headline import headline
from results_io import RESULTS, command_line, emit

ROOT = Path(__file__).resolve().parents[1]
# part -> its budget in seconds, in the order they run (the most figures first). The budgets are
# caps and add up to more than the run's: a part cut short is recorded; rerun it with --parts.
PARTS = {"roofline_bf16": 130, "served": 140, "roofline_int8kv": 55, "attention": 40,
         "decode_profile": 30, "quant_gemm": 40, "tests_gpu": 55, "tp2": 120}
NO_TP = ["--tp-sizes", "", "--disagg", ""]
SMALL_ROOFLINE = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--batches",
                  "1,2", "--context", "32", "--steps", "2", "--kernel-batches", "2",
                  "--kernel-contexts", "64", "--prefill-tokens", "64", "--copy-mb", "16",
                  "--matmul-n", "256", "--kv-cache-mb", "32", *NO_TP]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def junit_summary(path: Path) -> dict:
    """Counts of a pytest JUnit XML report, and the ids of the tests that failed."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures: list[str] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        if "failure" in kinds or "error" in kinds:
            counts["failed" if "failure" in kinds else "errors"] += 1
            failures.append(f"{case.get('classname')}::{case.get('name')}")
        else:
            counts["skipped" if "skipped" in kinds else "passed"] += 1
    return {**counts, "failures": failures}


def tests_gpu(small: bool, tmp: str) -> dict:
    if small:
        return {"not_run": "no CUDA device: tests/gpu skip every test here"}
    report = Path(tmp) / "junit.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/gpu", f"--junitxml={report}"], cwd=ROOT, env=env)
    return {"exit_status": proc.returncode, **junit_summary(report)}


def roofline(argv: list[str], tmp: str) -> dict:
    import gpu_roofline

    return gpu_roofline.main([*argv, "--out", str(Path(tmp) / "roofline.json")])


def tp2(small: bool, tmp: str) -> dict:
    gpus = torch.cuda.device_count()
    if small or gpus < 2:
        return {"skipped": f"needs 2 GPUs, found {gpus}"}
    return roofline(["--skip-hf", "--skip-faithfulness", "--batches", "1,32",
                     "--kernel-batches", "64", "--kernel-contexts", "1024",
                     "--prefill-tokens", "1024"], tmp)


def run_part(name: str, small: bool, tmp: str) -> dict:
    """One part's figures (this process; `gpu_all` gives each a process of its own)."""
    from gpu_parts import Shape, attention, decode_profile, quant_step

    shape = Shape.of(small)
    if name == "tests_gpu":
        return tests_gpu(small, tmp)
    if name == "roofline_bf16":
        # greedy against the CPU: tests_gpu's test_gpu_path checks it
        argv = [*SMALL_ROOFLINE, "--hf-requests", "2", "--hf-prompt-len", "8,16",
                "--hf-output-len", "2,4"] if small else NO_TP
        return roofline([*argv, "--skip-faithfulness"], tmp)
    if name == "roofline_int8kv":
        argv = SMALL_ROOFLINE if small else ["--batches", "1,256", "--kernel-batches", "256",
                                             "--kernel-contexts", "8192", *NO_TP]
        return roofline([*argv, "--skip-hf", "--skip-faithfulness", "--kv-cache-dtype",
                         "int8"], tmp)
    if name == "served":
        from gpu_served import served

        return served(shape, shape.model(tmp))
    if name == "decode_profile":
        return decode_profile(shape)
    if name == "attention":
        return attention(shape)
    if name == "quant_gemm":
        return quant_step(shape)
    if name == "tp2":
        return tp2(small, tmp)
    raise ValueError(f"part must be one of {', '.join(PARTS)}, got {name!r}")


def run_isolated(command: list[str], out: Path, timeout_s: float) -> tuple[str, dict]:
    """(status, figures) of a part run as `command`, which writes its figures to `out`: "ok",
    "failed: ..." or "timeout after N s" (its whole process group killed)."""
    proc = subprocess.Popen(command, stdout=sys.stderr, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return f"timeout after {timeout_s:.0f} s", {}
    figures = json.loads(out.read_text()) if out.is_file() else {}
    if code != 0:
        return f"failed: exit status {code}: {figures.pop('error', 'see the log')}"[:2000], {}
    return "ok", figures


def run_in_process(name: str, small: bool, tmp: str) -> tuple[str, dict]:
    try:
        return "ok", run_part(name, small, tmp)
    except Exception as exc:  # noqa: BLE001 - one part's failure is recorded
        traceback.print_exc()
        return f"failed: {type(exc).__name__}: {exc}"[:2000], {}


def run_all(names: list[str], small: bool, budget_s: float) -> tuple[dict, dict]:
    """({part: status, seconds, budget_s}, {part: figures}); each part in a process of its
    own on a GPU, in this one with `small`."""
    start = time.monotonic()
    parts: dict[str, dict] = {}
    detail: dict[str, dict] = {}
    for name in names:
        left = budget_s - (time.monotonic() - start)
        budget = min(PARTS[name], left)
        t0 = time.monotonic()
        figures: dict
        if budget < 10 and not small:
            status, figures = f"skipped: {left:.0f} s of the run's budget left", {}
        else:
            log(f"== {name} (budget {budget:.0f} s)")
            with tempfile.TemporaryDirectory(prefix=f"gpu_all_{name}_") as tmp:
                if small:
                    status, figures = run_in_process(name, small, tmp)
                else:
                    out = Path(tmp) / "part.json"
                    status, figures = run_isolated(
                        [sys.executable, __file__, "--part", name, "--part-out", str(out)],
                        out, budget)
        parts[name] = {"status": status, "seconds": round(time.monotonic() - t0, 1),
                       "budget_s": PARTS[name]}
        detail[name] = figures
        log(f"== {name}: {status} in {parts[name]['seconds']} s")
    return parts, detail


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true",
                        help="the CPU check: tiny shapes, in this process (default without CUDA)")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated, in order")
    parser.add_argument("--budget-s", type=float, default=470.0)
    parser.add_argument("--out", default=str(RESULTS / "gpu_all.json"))
    parser.add_argument("--part", help=argparse.SUPPRESS)  # a part's own process
    parser.add_argument("--part-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    small = args.small or not torch.cuda.is_available()
    if args.part:
        with tempfile.TemporaryDirectory() as tmp:
            status, figures = run_in_process(args.part, small, tmp)
        Path(args.part_out).write_text(json.dumps(figures if status == "ok" else
                                                  {"error": status.removeprefix("failed: ")}))
        if status != "ok":
            sys.exit(1)
        return figures
    names = [n for n in args.parts.split(",") if n]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
    parts, detail = run_all(names, small, args.budget_s)
    result = {"benchmark": "gpu_all", "command": command_line(argv), "small": small,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "gpus": torch.cuda.device_count(), "budget_s": args.budget_s, "parts": parts,
              **headline(detail, small), "detail": detail}
    return emit(result, args.out)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
