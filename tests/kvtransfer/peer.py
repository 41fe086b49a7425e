"""A source worker in its own process, driven over a pipe by typed commands.

The child fills each layout's caches from `random_caches(layout, num_blocks, seed + i)`, so the
test rebuilds the expected bytes itself; it offers scattered blocks and sends the handoffs as
JSON (the wire form). Always stop it with `SourceProcess.stop()` (kills after a bounded wait).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from kvtransfer import Handoff, KVLayout, TransferAgent, TransportConfig
from tests.kvtransfer.factories import BlockPool, random_caches, zero_caches


@dataclass(frozen=True)
class SourceSpec:
    transport: str
    layouts: tuple[KVLayout, ...]
    num_blocks: int = 64
    request_blocks: int = 10
    lease_s: float = 30.0
    seed: int = 0


@dataclass(frozen=True)
class FreeCounts:
    pass


@dataclass(frozen=True)
class Stop:
    pass


def _serve(conn, spec: SourceSpec) -> None:
    asyncio.run(_serve_async(conn, spec))


async def _serve_async(conn, spec: SourceSpec) -> None:
    loop = asyncio.get_running_loop()
    pools, agents, handoffs = [], [], []
    for i, layout in enumerate(spec.layouts):
        pool = BlockPool(spec.num_blocks)
        agent = TransferAgent(layout, random_caches(layout, spec.num_blocks, spec.seed + i),
                              TransportConfig(spec.transport), on_release=pool.free)
        await agent.start()
        ids = pool.allocate(spec.request_blocks, scattered=True)
        handoffs.append(agent.offer(f"req-{i}", ids, lease_s=spec.lease_s).to_json())
        pools.append(pool)
        agents.append(agent)
    conn.send(handoffs)
    while True:
        command = await loop.run_in_executor(None, conn.recv)
        if isinstance(command, FreeCounts):
            conn.send([p.num_free for p in pools])
        elif isinstance(command, Stop):
            break
    for agent in agents:
        await agent.close()
    conn.send("stopped")


def _context() -> Any:
    """Processes forked from the tests' forkserver, which has imported torch and this module
    once: each starts in a fraction of a second, where a spawned one imports them again (~3 s
    of CPU). Still a fresh process of its own, as a peer on another host is."""
    from tests.conftest import warm_forkserver

    return warm_forkserver()


class SourceProcess:
    def __init__(self, spec: SourceSpec) -> None:
        ctx = _context()
        self.spec = spec
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, spec), daemon=True)
        self.process.start()
        if not self._conn.poll(60):
            self.stop()
            raise RuntimeError("source process did not start within 60 s")
        self.handoffs = [Handoff.from_json(h) for h in self._conn.recv()]

    def free_counts(self) -> list[int]:
        self._conn.send(FreeCounts())
        if not self._conn.poll(10):
            raise RuntimeError("source process did not answer FreeCounts within 10 s")
        return self._conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(Stop())
                self._conn.poll(10)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(5)
        if self.process.is_alive():
            self.kill()
        self._conn.close()


def _pull_and_hang(layout: KVLayout, handoff_json: str, transport: str, landed) -> None:
    """A puller that stalls once layer 0 has landed (mid-transfer), for the test to kill."""
    def hang(layer: int) -> None:
        landed.set()
        time.sleep(60)

    async def run() -> None:
        agent = TransferAgent(layout, zero_caches(layout, 128), TransportConfig(transport))
        await agent.start()
        handoff = Handoff.from_json(handoff_json)
        await agent.pull(handoff, list(range(handoff.num_blocks)), on_layer=hang, timeout=60)
    asyncio.run(run())


def start_hanging_puller(layout: KVLayout, handoff: Handoff, transport: str):
    """Start a puller process; returns it once layer 0 has landed there."""
    ctx = _context()
    landed = ctx.Event()
    process = ctx.Process(target=_pull_and_hang,
                          args=(layout, handoff.to_json(), transport, landed), daemon=True)
    process.start()
    if not landed.wait(60):
        process.kill()
        process.join(10)
        raise RuntimeError("the puller landed no layer within 60 s")
    return process
