"""The event loop of Cleave's own processes (`cleave serve --in-process`, its worker processes,
`LocalServer`): uvloop's where it is installed, as Ray's workers already run theirs
(`RAY_USE_UVLOOP`), so the in-process server and the Ray app stream through the same loop.
`CLEAVE_USE_UVLOOP=0` keeps asyncio's own.

Why: the router's work per streamed chunk is mostly the loop's (a task step, a socket write).
On the embedded model at 64 streams the in-process server made 6.4k tokens/s on uvloop against
5.5k on asyncio's loop (`benchmarks/serving.py`, this 2-core machine)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def use_uvloop() -> bool:
    if os.environ.get("CLEAVE_USE_UVLOOP", "1").strip().lower() in ("0", "false", "no"):
        return False
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def new_event_loop() -> asyncio.AbstractEventLoop:
    if use_uvloop():
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on `new_event_loop()`."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
