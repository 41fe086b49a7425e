"""The one thread an engine's steps run on, and why the engine is built on it too."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from workers.engine.core import Engine

if TYPE_CHECKING:
    from workers.engine.config import EngineConfig
    from workers.engine.parallel.group import RankLauncher


def step_thread() -> ThreadPoolExecutor:
    """A one-thread executor for an engine's steps."""
    return ThreadPoolExecutor(1, thread_name_prefix="cleave-engine")


def build_on_step_thread(config: EngineConfig, rank_launcher: RankLauncher | None, *,
                         detokenize: bool) -> tuple[Engine, ThreadPoolExecutor]:
    """An `Engine` built on a new step thread, and that thread (shut down if building fails).

    The engine is built on the thread its steps will run on. The CPU's OpenMP runtime
    (libgomp, torch's and the C kernels') keeps a pool of worker threads per thread that
    starts parallel regions; once a second thread has one (loading and profiling the model
    here, steps there), the process has more pool threads than cores, and libgomp then
    parks idle workers after a short spin, so each of a step's ~40 parallel regions waits
    for a wake-up. Measured on this 2-core machine, `small` preset int8, one sequence:
    3.1-3.3 ms a decode step with one thread doing both, 5.3-6.0 ms with any parallel
    region run on another thread first. Where two threads cannot be avoided (two engines in
    one process), `cleave` lengthens the throttled spin (`cluster/openmp_wait.py`)."""
    thread = step_thread()
    try:
        engine = thread.submit(Engine, config, rank_launcher, detokenize=detokenize).result()
    except BaseException:
        thread.shutdown(wait=False)
        raise
    return engine, thread
