"""How long OpenMP's idle workers spin before they sleep, set once for every process `cleave`
starts (`set_spin_policy`, first thing in `cluster.cli.main`).

libgomp (the OpenMP runtime of torch's CPU wheel and of the C kernels) keeps a pool of worker
threads for each thread that starts parallel regions. Between two regions a worker spins
`GOMP_SPINCOUNT` times (300,000 by default), then sleeps on a futex until the next region
wakes it. Once the process holds more pool threads than it may use cores, libgomp takes the
"throttled" count instead: 100 spins by default, so nearly every one of a decode step's
hundreds of parallel regions (a C call per projection, torch's ops) waits for a wake-up. A
process gets there as soon as two threads have started parallel regions: two engines in one
process (`cleave serve --in-process` runs a prefill and a decode worker side by side), or an
engine's step thread beside an event loop that ran a parallel torch op.

`OMP_WAIT_POLICY=ACTIVE` raises the throttled count to 1,000 spins (tens of microseconds, about
the gap between a step's regions), and `GOMP_SPINCOUNT=300000` keeps the unthrottled count at
libgomp's default: ACTIVE alone spins 30 billion times, so an idle server would hold its cores.
Measured in `benchmarks/openmp_wait.py` (`benchmarks/results/openmp_wait_inprocess.json`,
`openmp_wait_ray.json`).

libgomp reads the variables once, when torch loads it: set before anything imports torch;
the processes `cleave` starts (Ray's raylet and workers, `--process-per-worker`'s) inherit
them. A user's own setting of either variable wins, and then neither is touched.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SPIN_POLICY = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}


def set_spin_policy(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Sets `SPIN_POLICY` in `environ` unless the user set either variable. Returns whether it
    did. Raises `RuntimeError` when torch is already imported (libgomp has read the old
    values: setting them now would change nothing but what the process reports)."""
    if any(name in environ for name in SPIN_POLICY):
        return False
    if "torch" in sys.modules and environ is os.environ:
        raise RuntimeError("set_spin_policy must run before torch is imported: libgomp reads "
                           "OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when it loads")
    environ.update(SPIN_POLICY)
    return True
