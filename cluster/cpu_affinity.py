"""Host cores of a worker's own: each worker process pinned as if it had a GPU to itself.

A pool's `cpu_affinity` lists the cores its ranks may run on, on every node. A rank claims the
cores it reserves (`cpus_per_rank`, at least one) from that list: the first ones no live process
on the node holds. A claim is an exclusive `flock` on one file per core under `CLAIM_DIR`; the
kernel drops the lock when its process ends, so a dead worker's cores are free again at once and
nothing is left to clean up. Two pools may list the same cores: a core is still held by one rank
at a time, whichever pool it belongs to.

The claimed cores become the affinity of every thread of the process (Linux sets affinity per
thread, and Ray's and torch's threads already run when an actor starts; threads started later
inherit it) and torch's intra-op thread count. The router pins to its cores without claiming
them: its replicas may share them (`pin_process`).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path


def _claim_dir() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return Path(os.environ.get("CLEAVE_CPU_CLAIM_DIR", base / "cleave-cpu-claims"))


class CoreClaimError(RuntimeError):
    """Fewer cores of the list are free on this node than the rank reserves."""


class CoreClaim:
    """Cores this process holds (`cores`, ascending) until `release()` or its end."""

    def __init__(self, cores: tuple[int, ...], fds: list[int]) -> None:
        self.cores = cores
        self._fds = fds

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the file drops its lock
        self._fds = []

    def __repr__(self) -> str:
        return f"CoreClaim(cores={self.cores})"


def usable_cores() -> set[int]:
    """The cores this process may run on at all (its cgroup's and the machine's)."""
    return set(os.sched_getaffinity(0))


def claim_cores(allowed: Sequence[int], count: int) -> CoreClaim:
    """Take `count` cores of `allowed` that no other process on this node holds, in the list's
    order. Raises `CoreClaimError` naming the list, the cores that exist here and those taken."""
    if count < 1:
        raise ValueError(f"a rank claims at least one core, got count={count}")
    usable = usable_cores()
    missing = [c for c in allowed if c not in usable]
    if missing:
        raise CoreClaimError(f"cpu_affinity={list(allowed)} names cores {missing} this node "
                             f"does not let this process run on; it may use "
                             f"{sorted(usable)}")
    folder = _claim_dir()
    folder.mkdir(parents=True, exist_ok=True)
    got: list[int] = []
    fds: list[int] = []
    for core in allowed:
        if len(got) == count:
            break
        fd = os.open(folder / f"core-{core}", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())  # who holds it, for a person looking
        got.append(core)
        fds.append(fd)
    if len(got) < count:
        for fd in fds:
            os.close(fd)
        taken = [c for c in allowed if c not in got]
        raise CoreClaimError(f"cpu_affinity={list(allowed)}: this rank reserves {count} "
                             f"cores but only {len(got)} are free on this node ({taken} are "
                             f"held by other workers); list more cores or run fewer replicas "
                             f"per node")
    return CoreClaim(tuple(sorted(got)), fds)


def claim_and_pin(allowed: Sequence[int], count: int) -> CoreClaim:
    """`claim_cores`, then this process pinned to the claimed cores (`pin_process`)."""
    claim = claim_cores(allowed, count)
    pin_process(claim.cores)
    return claim


def pin_process(cores: Iterable[int], torch_threads: bool = True) -> tuple[int, ...]:
    """Every thread of this process onto `cores`; torch's intra-op threads to their number
    (`torch_threads`). Returns the cores, ascending."""
    mask = set(cores)
    if not mask:
        raise ValueError("pin_process needs at least one core")
    os.sched_setaffinity(0, mask)  # this thread first: threads it starts inherit the mask
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mask)
        except (ProcessLookupError, PermissionError):  # a thread that has just ended
            pass
    if torch_threads:
        import torch

        torch.set_num_threads(len(mask))
    return tuple(sorted(mask))


def affinity_of(pid: int) -> tuple[int, ...]:
    """The cores process `pid` (its main thread) may run on."""
    return tuple(sorted(os.sched_getaffinity(pid)))
