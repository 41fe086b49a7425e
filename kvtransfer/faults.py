"""Fault injection for the soak (`benchmarks/soak.py`) and tests: named points the code passes.

Faults can be armed only in a process started with `CLEAVE_FAULT_INJECTION=1` (Ray workers
started by a driver that has it inherit it). Off, passing a point costs one empty-dict test.
This module sits at the bottom layer (no Cleave or third-party imports) so every package can
name its points:

- `engine.step`: the engine's step thread, before each step (`stall` hangs the step);
- `kv.pull`: a KV pull on the decode side, before it reads (`raise` fails it, `stall` delays it);
- `kv.serve`: a transfer source, while serving a read (`stall` holds it mid-transfer).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass

ENV = "CLEAVE_FAULT_INJECTION"
ENABLED = os.environ.get(ENV) == "1"
ACTIONS = ("raise", "stall")


class InjectedFault(RuntimeError):
    """Raised at a point armed with `raise`."""


@dataclass
class Fault:
    action: str  # "raise" or "stall"
    seconds: float = 0.0  # how long a stall lasts
    times: int = 1  # how many passes it fires on


_armed: dict[str, Fault] = {}
_lock = threading.Lock()


def arm(point: str, action: str, seconds: float = 0.0, times: int = 1) -> None:
    """Make the next `times` passes of `point` fail or stall."""
    if not ENABLED:
        raise RuntimeError(f"fault injection is off in this process; start it with {ENV}=1")
    if action not in ACTIONS:
        raise ValueError(f"fault action {action!r}: expected one of {ACTIONS}")
    if times < 1 or seconds < 0:
        raise ValueError(f"fault at {point!r}: times must be >= 1 and seconds >= 0")
    with _lock:
        _armed[point] = Fault(action, seconds, times)


def disarm(point: str | None = None) -> None:
    with _lock:
        if point is None:
            _armed.clear()
        else:
            _armed.pop(point, None)


def _take(point: str) -> float | None:
    """Spend one pass of an armed `point`: raise for `raise`, return the seconds to stall for
    `stall`; None when it is not armed."""
    with _lock:
        fault = _armed.get(point)
        if fault is None:
            return None
        fault.times -= 1
        if fault.times <= 0:
            del _armed[point]
    if fault.action == "raise":
        raise InjectedFault(f"injected fault at {point}")
    return fault.seconds


def hit(point: str) -> None:
    """Pass `point` on a thread: raise or sleep if it is armed."""
    if _armed and (seconds := _take(point)) is not None:
        time.sleep(seconds)


async def ahit(point: str) -> None:
    """Pass `point` on an event loop: raise or sleep (without blocking the loop) if armed."""
    if _armed and (seconds := _take(point)) is not None:
        await asyncio.sleep(seconds)
