"""Benchmark scripts are not a package: tests import them from `benchmarks/` by module name."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def import_benchmark(name: str) -> Iterator[ModuleType]:
    """Yield `benchmarks/<name>.py` as a module (for a fixture), with `benchmarks/` on the path
    only meanwhile (the scripts import `results_io` as a sibling)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
