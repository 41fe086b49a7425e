"""A worker group's ranks: started by a pluggable launcher, driven by one driver.

The driver sends every rank the same message and collects every rank's reply. Nothing waits
forever: a rank that dies, raises or stays silent past `timeout_s` makes the driver raise
`RankGroupError` naming it, after stopping the whole group (a group with a lost rank cannot
continue: its collectives would hang).
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn, TypeVar

from workers.engine.parallel.messages import (
    MemoryReport,
    RankFailed,
    Ready,
    Shutdown,
    StepMessage,
    StepReply,
)

logger = logging.getLogger(__name__)

_POLL_S = 0.05


class RankGroupError(RuntimeError):
    """A rank of a worker group failed; the group has been stopped."""


class RankHandle(abc.ABC):
    """The driver's end of one rank: a message channel plus the process's fate."""

    @abc.abstractmethod
    def send(self, msg: object) -> None: ...

    @abc.abstractmethod
    def poll(self, timeout_s: float) -> bool:
        """True when a reply is ready to `recv` (waits up to `timeout_s`)."""

    @abc.abstractmethod
    def recv(self) -> object: ...

    @abc.abstractmethod
    def exitcode(self) -> int | None:
        """None while the rank runs."""

    @abc.abstractmethod
    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the rank to exit, then kill it."""


class RankLauncher(abc.ABC):
    """Starts ranks: spawned processes here, Ray actors in the cluster
    (`cluster.rank_actor.RayActorLauncher`). A `RankGroup` launches its ranks in rank order."""

    @abc.abstractmethod
    def launch(self, target: Callable[[Any, Any], None], setup: object) -> RankHandle:
        """Start `target(setup, channel)` as a new rank without waiting for it; returns the
        driver's handle. `setup` and the messages must pickle; `channel` has `send` and
        `recv`, and `target` returning (or raising `SystemExit(code)`) ends the rank."""


class _ProcessHandle(RankHandle):
    def __init__(self, process: BaseProcess, conn: Connection) -> None:
        self.process, self.conn = process, conn

    def send(self, msg: object) -> None:
        self.conn.send(msg)

    def poll(self, timeout_s: float) -> bool:
        return self.conn.poll(timeout_s)

    def recv(self) -> object:
        return self.conn.recv()

    def exitcode(self) -> int | None:
        return self.process.exitcode

    def stop(self, timeout_s: float) -> None:
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        self.conn.close()


class SpawnLauncher(RankLauncher):
    """Ranks as `spawn`ed daemon processes, a pipe each."""

    def launch(self, target: Callable[[Any, Any], None], setup: object) -> RankHandle:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        driver_end, rank_end = ctx.Pipe()
        process = ctx.Process(target=target, args=(setup, rank_end), daemon=True)
        process.start()
        rank_end.close()
        return _ProcessHandle(process, driver_end)


def _died(handle: RankHandle) -> bool:
    """True when the rank is gone without reporting a failure of its own (killed, its process
    lost): its channel is closed, or it exited with nothing left to read. Reads a pending
    message."""
    try:
        if handle.poll(0) and isinstance(handle.recv(), RankFailed):
            return False  # it failed on its own, and said why
    except (EOFError, OSError):
        return True
    return handle.exitcode() is not None


_Setup = TypeVar("_Setup")
_Reply = TypeVar("_Reply")


class RankGroup:
    """`len(setups)` ranks; `replies()` of rank i come back in `[i]`."""

    def __init__(self, target: Callable[[_Setup, Any], None], setups: Sequence[_Setup],
                 launcher: RankLauncher, timeout_s: float,
                 start_timeout_s: float | None = None, *, measure_first: bool = False) -> None:
        """`timeout_s`: the longest a step may take; `start_timeout_s` (default the same):
        the longest the ranks may take to start and load their shards. `measure_first`: the
        ranks answer with a `MemoryReport` each (`reports`), and are `ready` only after
        `allocate`."""
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s or timeout_s
        self.handles: list[RankHandle] = []
        self.closed = False
        self.ready: list[Ready] = []
        self.reports: list[MemoryReport] = []
        try:
            for setup in setups:
                self.handles.append(launcher.launch(target, setup))
            if measure_first:
                self.reports = self._collect("start-up", MemoryReport, self.start_timeout_s)
            else:
                self.ready = self._collect("start-up", Ready, self.start_timeout_s)
        except BaseException:
            self.close()
            raise

    def allocate(self, messages: list[object]) -> None:
        """A two-phase start's second phase: rank i gets `messages[i]` (its
        `AllocateCaches`); returns once every rank is `ready`."""
        if len(messages) != len(self.handles) or self.ready:
            raise ValueError(f"{len(messages)} cache messages for {len(self.handles)} ranks "
                             f"({len(self.ready)} ready already)")
        for rank, (handle, msg) in enumerate(zip(self.handles, messages)):
            try:
                handle.send(msg)
            except (OSError, EOFError):
                self._lost(rank, "cache allocation")
        self.ready = self._collect("cache allocation", Ready, self.start_timeout_s)

    def step(self, msg: StepMessage) -> list[StepReply]:
        """Send `msg` to every rank; every rank's reply, in rank order."""
        return self.broadcast(msg, StepReply, f"step {msg.step_id}", self.timeout_s)

    def broadcast(self, msg: object, kind: type[_Reply], what: str,
                  timeout_s: float) -> list[_Reply]:
        """Send `msg` to every rank, in rank order; every rank's reply (a `kind`), in rank
        order, within `timeout_s`. `what` names the exchange in errors."""
        if self.closed:
            raise RankGroupError("the worker group has been stopped")
        for rank, handle in enumerate(self.handles):
            try:
                handle.send(msg)
            except (OSError, EOFError):  # the channel is closed: the rank is gone or going
                self._lost(rank, what)
        return self._collect(what, kind, timeout_s)

    def _collect(self, what: str, kind: type[_Reply], timeout_s: float) -> list[_Reply]:
        deadline = time.monotonic() + timeout_s
        replies: dict[int, _Reply] = {}
        while len(replies) < len(self.handles):
            pending = [r for r in range(len(self.handles)) if r not in replies]
            for i, rank in enumerate(pending):
                handle = self.handles[rank]
                if handle.poll(_POLL_S if i == 0 else 0):  # block on one, peek at the rest
                    reply = self._recv(rank, what)
                    if isinstance(reply, RankFailed):
                        self._failed(rank, reply, what)
                    if not isinstance(reply, kind):
                        self._fail(f"rank {rank} sent {type(reply).__name__} during {what}; "
                                   f"expected {kind.__name__}")
                    replies[rank] = reply
                elif handle.exitcode() is not None:
                    self._fail(f"rank {rank} exited with code {handle.exitcode()} during {what}")
            if time.monotonic() > deadline:
                missing = [r for r in range(len(self.handles)) if r not in replies]
                self._fail(f"ranks {missing} did not answer {what} within {timeout_s} s")
        return [replies[r] for r in range(len(self.handles))]

    def _failed(self, rank: int, reply: RankFailed, what: str) -> NoReturn:
        """A rank raised. Ranks that died meanwhile are named first: a rank's collective fails
        when a peer dies ("Connection closed by peer")."""
        gone = [r for r, h in enumerate(self.handles) if r != rank and _died(h)]
        for r in gone:
            self.handles[r].stop(2.0)
        cause = "".join(f"rank {r} exited with code {self.handles[r].exitcode()} during "
                        f"{what}; " for r in gone)
        self._fail(f"{cause}rank {rank} failed during {what}: {reply.summary}\n{reply.error}")

    def _recv(self, rank: int, what: str) -> object:
        try:
            return self.handles[rank].recv()
        except (EOFError, OSError):  # the channel closed: the rank is gone or going
            self._lost(rank, what)

    def _lost(self, rank: int, what: str) -> NoReturn:
        handle = self.handles[rank]
        handle.stop(2.0)
        self._fail(f"rank {rank} exited with code {handle.exitcode()} during {what}")

    def _fail(self, message: str) -> NoReturn:
        self.close(timeout_s=1.0)
        raise RankGroupError(message)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every rank (idempotent): ask politely, then kill what is left."""
        if self.closed:
            return
        self.closed = True
        for handle in self.handles:
            if handle.exitcode() is None:
                try:
                    handle.send(Shutdown())
                except (OSError, EOFError, BrokenPipeError):
                    pass  # already gone
        for handle in self.handles:
            handle.stop(timeout_s)
