"""A worker group's ranks as Ray actors: each in its own bundle of the replica's placement group.

`RayActorLauncher` is the cluster's `workers.engine.parallel.group.RankLauncher`. Rank i runs in a
`RankActor` scheduled into bundle i, holding that bundle's resources (so Ray accounts for every
rank, and the engine actor that drives them holds none). Ray owns the actors' lives: they die
with the engine actor that started them.

Messages travel over a socket on 127.0.0.1: the driver listens, the actor connects and proves
it is the rank with a random token. The placement group must therefore be on the driver's node
(STRICT_PACK with the driver in one of its bundles), which is also where the ranks map the KV
cache's shared-memory file. Messages are plain pickles: a tensor in a reply is copied (torch's
shared-memory pickling passes file descriptors, which only works between processes that share a
multiprocessing authkey, i.e. spawned children).
"""

from __future__ import annotations

import hmac
import os
import pickle
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.process_wire import no_delay
from workers.engine.parallel.group import RankHandle, RankLauncher

CONNECT_TIMEOUT_S = 30.0  # an actor that cannot reach its driver this long gives up
TOKEN_TIMEOUT_S = 5.0  # a connection that does not send its token this long is dropped
KILL_WAIT_S = 5.0  # how long `stop` waits for a killed actor to be reported dead
KILLED = -9  # the exit code of a rank whose actor died (killed, or its process lost)


@dataclass(frozen=True)
class RankPlace:
    """Where one rank actor runs."""

    rank: int
    actor_id: str  # hex
    node_id: str  # hex
    pid: int
    placement_group_id: str | None  # hex
    cores: tuple[int, ...] | None = None  # the host cores it is pinned to (None: unpinned)


class _Channel:
    """One end of the driver <-> rank channel: `send`, `poll`, `recv` of whole messages."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def send(self, msg: object) -> None:
        self.conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def poll(self, timeout_s: float) -> bool:
        return self.conn.poll(timeout_s)

    def recv(self) -> object:
        return pickle.loads(self.conn.recv_bytes())

    def close(self) -> None:
        self.conn.close()


def _read_token(sock: socket.socket, size: int) -> bytes:
    """The token a connecting rank sends first (as `Connection.send_bytes` frames it: a 4-byte
    big-endian length, then the bytes), read within TOKEN_TIMEOUT_S in all; b"" when the peer
    sends anything else, too little or too late."""
    want = 4 + size
    got = b""
    deadline = time.monotonic() + TOKEN_TIMEOUT_S
    try:
        while len(got) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                return b""
            sock.settimeout(left)
            chunk = sock.recv(want - len(got))
            if not chunk:
                return b""
            got += chunk
    except OSError:  # a timeout included
        return b""
    if int.from_bytes(got[:4], "big") != size:
        return b""
    return got[4:]


class RankActor:
    """One rank's process. Build with `ray.remote(RankActor)`; `run` serves the rank until it
    ends, `place` answers meanwhile (the actor runs two calls at once)."""

    def __init__(self, rank: int, cpu_affinity: tuple[int, ...] | None = None,
                 cores: int = 1) -> None:
        """`cpu_affinity`: the pool's cores; the rank claims `cores` of them and pins its
        process to them (`cluster.cpu_affinity`). None: unpinned."""
        self.rank = rank
        self._cores = None
        if cpu_affinity is not None:
            from cluster.cpu_affinity import claim_and_pin

            self._cores = claim_and_pin(cpu_affinity, cores)

    def __repr__(self) -> str:  # Ray's name for the actor (`ray list actors`, logs)
        return f"RankActor(rank={self.rank})"

    def place(self) -> RankPlace:
        ctx = ray.get_runtime_context()
        return RankPlace(self.rank, ctx.get_actor_id(), ctx.get_node_id(), os.getpid(),
                         ctx.get_placement_group_id(),
                         self._cores.cores if self._cores is not None else None)

    def run(self, target: Callable[[Any, Any], None], setup: object, port: int,
            token: bytes) -> int:
        """Connect to the driver on 127.0.0.1:`port`, then `target(setup, channel)`; returns
        the rank's exit code (0, or what it raised `SystemExit` with)."""
        sock = socket.create_connection(("127.0.0.1", port), timeout=CONNECT_TIMEOUT_S)
        no_delay(sock)
        sock.settimeout(None)
        channel = _Channel(Connection(sock.detach()))
        try:
            channel.conn.send_bytes(token)
            target(setup, channel)
            return 0
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 1
        finally:
            channel.close()


class ActorRank(RankHandle):
    """The driver's end of one rank actor. The channel is accepted on the first `poll`."""

    def __init__(self, rank: int, actor: Any, done: Any, server: socket.socket,
                 token: bytes) -> None:
        """`done`: the ObjectRef of the actor's `run` (its exit code, or the actor's death)."""
        self.rank, self.actor, self.done = rank, actor, done
        self.server, self.token = server, token
        self.channel: _Channel | None = None
        self._exitcode: int | None = None

    def send(self, msg: object) -> None:
        if self.channel is None:
            raise BrokenPipeError(f"rank {self.rank} has not connected")
        self.channel.send(msg)

    def poll(self, timeout_s: float) -> bool:
        if self.channel is None:
            self._accept(timeout_s)
            if self.channel is None:
                return False
            timeout_s = 0.0
        return self.channel.poll(timeout_s)

    def _accept(self, timeout_s: float) -> None:
        self.server.settimeout(timeout_s)  # 0: don't wait
        try:
            sock, _ = self.server.accept()
        except (BlockingIOError, TimeoutError):
            return
        if hmac.compare_digest(_read_token(sock, len(self.token)), self.token):
            sock.setblocking(True)
            no_delay(sock)
            self.channel = _Channel(Connection(sock.detach()))
            self.server.close()
            return
        sock.close()  # not our rank (or too slow to say so): keep listening

    def recv(self) -> object:
        if self.channel is None:
            raise EOFError(f"rank {self.rank} has not connected")
        return self.channel.recv()

    def exitcode(self) -> int | None:
        if self._exitcode is None and ray.is_initialized():
            finished, _ = ray.wait([self.done], timeout=0)
            if finished:
                try:
                    self._exitcode = ray.get(self.done)
                except RayActorError:
                    self._exitcode = KILLED
                except RayError:  # run raised: it could not connect
                    self._exitcode = 1
        return self._exitcode

    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the rank to end, then kill its actor either way (an
        idle actor would still hold its bundle)."""
        if ray.is_initialized():
            ray.wait([self.done], timeout=timeout_s)
            ray.kill(self.actor)
            if self.exitcode() is None:
                ray.wait([self.done], timeout=KILL_WAIT_S)
        if self.exitcode() is None:
            self._exitcode = KILLED
        if self.channel is not None:
            self.channel.close()
        self.server.close()


class RayActorLauncher(RankLauncher):
    """Rank i (the i-th launch) as a `RankActor` in bundle i of `placement_group`, with that
    bundle's resources. The group must be on this process's node. `ranks`: the handles, in
    launch order."""

    def __init__(self, placement_group: PlacementGroup,
                 cpu_affinity: tuple[int, ...] | None = None, cores_per_rank: int = 1) -> None:
        """`cpu_affinity`, `cores_per_rank`: each rank claims that many of those cores and is
        pinned to them (None: unpinned)."""
        self.placement_group = placement_group
        self.cpu_affinity = cpu_affinity
        self.cores_per_rank = cores_per_rank
        self.bundles: list[dict[str, float]] = placement_group.bundle_specs
        self.ranks: list[ActorRank] = []

    def launch(self, target: Callable[[Any, Any], None], setup: object) -> RankHandle:
        rank = len(self.ranks)
        if rank >= len(self.bundles):
            raise ValueError(f"rank {rank} has no bundle: the placement group has "
                             f"{len(self.bundles)}; a worker group needs one per rank")
        server = socket.create_server(("127.0.0.1", 0))
        token = secrets.token_bytes(32)
        try:
            actor = ray.remote(RankActor).options(**self._options(rank)).remote(
                rank, self.cpu_affinity, self.cores_per_rank)
            done = actor.run.remote(target, setup, server.getsockname()[1], token)
        except BaseException:
            server.close()
            raise
        handle = ActorRank(rank, actor, done, server, token)
        self.ranks.append(handle)
        return handle

    def _options(self, rank: int) -> dict[str, Any]:
        """Ray actor options holding all of bundle `rank`."""
        custom = dict(self.bundles[rank])
        cpus, gpus, memory = custom.pop("CPU", 0.0), custom.pop("GPU", 0.0), custom.pop("memory", 0)
        options: dict[str, Any] = {
            "num_cpus": cpus, "num_gpus": gpus, "resources": custom,
            "max_concurrency": 2,  # `run`, and `place` meanwhile
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=rank)}
        if memory:
            options["memory"] = int(memory)
        return options
