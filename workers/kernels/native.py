"""C kernels compiled at first use with the system C compiler (`$CC`, default `cc`) for the host
CPU and cached under `$CLEAVE_CACHE_DIR/kernels/` (default `~/.cache/cleave/kernels/`), keyed by
the source, the flags and the CPU, as Triton and torch's extensions cache theirs. Each kernel is
one C file linked against libgomp, so it runs on torch's own OpenMP threads.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from collections.abc import Callable

logger = logging.getLogger(__name__)

# -ffast-math lets the dot products vectorize (reassociation) and expf use libmvec; the kernel
# never forms an infinity or NaN from finite inputs, so the finite-math assumption holds. It is
# given when compiling only: linked with it, gcc (before 13) adds crtfastmath.o, whose constructor
# turns on flush-to-zero for the whole process when the library loads, changing every float
# computation after it (torch's included).
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-fopenmp")
LDFLAGS = ("-shared", "-fopenmp")


class KernelBuildError(RuntimeError):
    """The C compiler is missing or failed on the kernel."""


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))  # one copy per distinct line (every core repeats them)


def kernel_dir() -> Path:
    root = Path(os.environ.get("CLEAVE_CACHE_DIR") or Path.home() / ".cache" / "cleave")
    return root / "kernels"


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _source_bytes(path: Path, seen: set[Path] | None = None) -> list[bytes]:
    """The file's bytes and those of every `#include "..."` it reaches, so an edit to a shared
    header changes the cache key of every kernel built from it."""
    seen = set() if seen is None else seen
    path = path.resolve()
    if path in seen:
        return []
    seen.add(path)
    source = path.read_bytes()
    parts = [source]
    for name in _LOCAL_INCLUDE.findall(source):
        included = path.parent / name.decode()
        if included.is_file():
            parts += _source_bytes(included, seen)
    return parts


def build_library(path: Path, compiler: str | None = None,
                  sources: tuple[Path, ...] = ()) -> Path:
    """The compiled library of the C file `path` (linked with the C files `sources`, compiled
    each on its own), compiling it unless these sources (and the headers they include),
    compiler, flags and CPU were compiled before. Concurrent builds (several engine processes
    starting) each build in a private folder and rename the library into place, so a reader
    never sees a partial one."""
    compiler = compiler or os.environ.get("CC") or "cc"
    files = (path, *sources)
    parts = [b for f in files for b in _source_bytes(f)]
    flags = " ".join(CFLAGS + LDFLAGS)
    key = hashlib.sha256(b"\0".join([*parts, compiler.encode(), flags.encode(),
                                     _cpu_identity().encode()])).hexdigest()[:16]
    target = kernel_dir() / f"{path.stem}-{key}.so"
    if target.exists():
        return target
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"C compiler {compiler!r} not found (set $CC to one)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objs = [os.path.join(tmp, f"{i}-{f.stem}.o") for i, f in enumerate(files)]
        lib = os.path.join(tmp, f"{path.stem}.so")
        steps = [[compiler, *CFLAGS, "-c", "-o", obj, str(f)] for obj, f in zip(objs, files)]
        for step in [*steps, [compiler, *LDFLAGS, "-o", lib, *objs, "-lm"]]:
            proc = subprocess.run(step, capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise KernelBuildError(f"{' '.join(step)} failed (exit {proc.returncode}):\n"
                                       f"{proc.stderr.strip()}")
        os.replace(lib, target)
    return target


def loads(load: Callable[[], object], what: str, log: logging.Logger = logger) -> bool:
    """Whether a kernel's `load()` builds and loads it here; warns on `log`, with the reason and
    `what` is used instead, when it does not (callers cache the answer: once per process)."""
    try:
        load()
    except (KernelBuildError, OSError, subprocess.TimeoutExpired) as e:
        log.warning("%s: %s", what, e)
        return False
    return True
