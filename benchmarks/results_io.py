"""What every benchmark does last: record the command, keep the JSON, print it as the last line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def sig(x: float, digits: int = 4) -> float:
    """`x` to `digits` significant digits: figures span microseconds to seconds, and a small
    rate measured on a CPU must not round to zero."""
    return float(f"{x:.{digits}g}")


def command_line(argv: list[str] | None) -> str:
    """The command that reproduces this run."""
    return "python " + " ".join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)])


def emit(result: dict, out: str | Path) -> dict:
    """Write `result` to `out` (under benchmarks/results/ by default) and print it as one line."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result
