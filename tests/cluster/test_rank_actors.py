"""A worker group's ranks as Ray actors (`cluster.rank_actor`): each rank in its own bundle of a
placement group, the same greedy tokens as one process, and a lost rank actor fails the next
step by name instead of hanging the driver. Nothing is left behind: no rank actor, no cache
file in /dev/shm."""

from __future__ import annotations

import glob
import os
import re
import time

import pytest

from tests.cluster.conftest import free_ports, wait_for
from workers.engine.parallel.shared_cache import FILE_PREFIX, SHM_DIR

pytestmark = pytest.mark.timeout(300)

PROMPT = [1, 17, 42, 99, 7, 256, 3, 88, 150, 21, 5, 400, 9, 33, 64, 128, 2, 11, 300]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def ray_with_state():
    """Local Ray for this module, with the dashboard the state API reads actors through."""
    import ray

    ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=True, dashboard_port=free_ports(1)[0],
             log_to_driver=False, object_store_memory=128 * 1024**2)
    yield ray
    ray.shutdown()


@pytest.fixture
def two_bundles(ray_with_state):
    """A placement group like a TP=2 pool replica's: one bundle per rank, packed on one node."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 0.5}, {"CPU": 0.5}], strategy="STRICT_PACK")
    ray_with_state.get(pg.ready(), timeout=60)
    yield pg
    remove_placement_group(pg)


def tp2_engine(model: str, pg: object, cpu_affinity: tuple[int, ...] | None = None,
               **options: object) -> tuple[object, object]:
    """A TP=2 engine whose ranks are actors in `pg`, and its launcher."""
    from cluster.rank_actor import RayActorLauncher
    from workers.engine.config import EngineConfig
    from workers.engine.core import Engine

    launcher = RayActorLauncher(pg, cpu_affinity)
    config = EngineConfig(model=model, device="cpu", tensor_parallel_size=2, num_blocks=64,
                          **options)
    return Engine(config, launcher), launcher


def greedy(engine: object, prompt: list[int], max_tokens: int) -> list[int]:
    from workers.contract.protocol import SamplingParams, WorkerRequest

    engine.generate(WorkerRequest("r", tuple(prompt), SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
    tokens: list[int] = []
    while engine.has_unfinished():
        for event in engine.step():
            tokens.extend(event.token_ids)
    return tokens


def alive_rank_actors() -> list[object]:
    import ray
    from ray.util.state import list_actors

    # this module's own Ray, named: the state API fails when it finds another one running
    return list_actors(address=ray.get_runtime_context().gcs_address,
                       filters=[("class_name", "=", "RankActor"), ("state", "=", "ALIVE")],
                       detail=True)


def bundle_index(actor: object, pg_id: str) -> int:
    """The bundle an actor's resources come from (`CPU_group_<i>_<pg id>`)."""
    indexes = {int(m.group(1)) for name in actor.required_resources
               if (m := re.fullmatch(rf"\w+_group_(\d+)_{pg_id}", name))}
    if len(indexes) != 1:
        raise AssertionError(f"actor {actor.actor_id} holds {actor.required_resources}")
    return indexes.pop()


def cache_files() -> list[str]:
    return glob.glob(os.path.join(SHM_DIR, f"{FILE_PREFIX}{os.getpid()}-*"))


def test_a_tp2_engine_of_rank_actors_matches_one_process_and_leaves_nothing_behind(
        tiny_model, two_bundles):
    import ray

    from workers.engine.config import EngineConfig
    from workers.engine.core import Engine

    expected = greedy(Engine(EngineConfig(model=tiny_model, device="cpu", num_blocks=64)),
                      PROMPT, MAX_TOKENS)
    engine, launcher = tp2_engine(tiny_model, two_bundles)
    try:
        assert not cache_files()  # unlinked once both ranks had mapped it
        assert greedy(engine, PROMPT, MAX_TOKENS) == expected
        places = ray.get([r.actor.place.remote() for r in launcher.ranks])
        assert [p.rank for p in places] == [0, 1]
        assert all(p.pid != os.getpid() for p in places)
        pg_id = two_bundles.id.hex()
        listed = {a.actor_id: a for a in alive_rank_actors()}
        assert [listed[p.actor_id].placement_group_id for p in places] == [pg_id, pg_id]
        assert [bundle_index(listed[p.actor_id], pg_id) for p in places] == [0, 1]
    finally:
        engine.close()
    ids = {p.actor_id for p in places}
    wait_for(lambda: not ids & {a.actor_id for a in alive_rank_actors()}, 30,
             "the rank actors to be gone")
    assert all(r.exitcode() == 0 for r in launcher.ranks)  # both ended on Shutdown
    assert not cache_files()


def test_a_killed_rank_actor_fails_the_next_step_by_name_and_stops_the_other(
        tiny_model, two_bundles):
    import ray

    from workers.engine.parallel.group import RankGroupError
    from workers.contract.protocol import SamplingParams, WorkerRequest

    engine, launcher = tp2_engine(tiny_model, two_bundles, rank_timeout_s=20)
    try:
        engine.generate(WorkerRequest("r", tuple(PROMPT), SamplingParams(
            temperature=0.0, max_tokens=900, ignore_eos=True)))
        for _ in range(3):
            engine.step()
        ray.kill(launcher.ranks[1].actor)  # returns at once; the actor dies while we step
        start = time.monotonic()
        with pytest.raises(RankGroupError, match=r"rank 1 exited with code -9 during step"):
            while time.monotonic() - start < 20:
                engine.step()
        assert time.monotonic() - start < 20
        assert launcher.ranks[0].exitcode() is not None  # stopped, not left blocked
        with pytest.raises(RankGroupError, match="has been stopped"):
            engine.step()
    finally:
        engine.close()
    wait_for(lambda: not alive_rank_actors(), 30, "the rank actors to be gone")
    assert not cache_files()


def test_a_connection_that_stalls_before_its_token_is_dropped_in_time(monkeypatch):
    """The driver reads a connecting rank's token within a bound: a peer that sends part of
    it and stops (or anything else) is dropped, and the real rank still gets in."""
    import socket
    from multiprocessing.connection import Connection

    from cluster import rank_actor

    monkeypatch.setattr(rank_actor, "TOKEN_TIMEOUT_S", 0.3)
    server = socket.create_server(("127.0.0.1", 0))
    token = b"t" * 32
    rank = rank_actor.ActorRank(0, None, None, server, token)
    port = server.getsockname()[1]
    stray = socket.create_connection(("127.0.0.1", port))
    stray.sendall(b"\x00\x00")  # half a length header, then silence
    started = time.monotonic()
    rank._accept(2.0)
    assert rank.channel is None and time.monotonic() - started < 1.5
    real = socket.create_connection(("127.0.0.1", port))
    Connection(real.detach()).send_bytes(token)
    rank._accept(2.0)
    assert rank.channel is not None
    stray.close()
    rank.channel.close()


CORES = tuple(sorted(os.sched_getaffinity(0)))


def test_pinned_rank_actors_each_hold_a_core_of_their_own(tiny_model, two_bundles):
    import ray

    from cluster.cpu_affinity import affinity_of

    if len(CORES) < 2:
        pytest.skip(f"two ranks need two cores to claim; this machine lets us use {CORES}")
    engine, launcher = tp2_engine(tiny_model, two_bundles, cpu_affinity=CORES[:2])
    try:
        assert len(greedy(engine, PROMPT, MAX_TOKENS)) == MAX_TOKENS
        places = ray.get([r.actor.place.remote() for r in launcher.ranks])
        assert sorted(p.cores for p in places) == [(CORES[0],), (CORES[1],)]
        assert all(affinity_of(p.pid) == p.cores for p in places)
    finally:
        engine.close()


def test_a_pinned_engine_actor_holds_its_core_and_a_second_one_is_refused_by_name(tiny_model,
                                                                                 ray_with_state):
    import ray

    from cluster.cpu_affinity import affinity_of
    from cluster.engine_actor import EngineActor, EngineSpec
    from cluster.settings import WorkerOptions
    from workers.engine.config import EngineConfig

    def start(name: str) -> object:
        spec = EngineSpec(name, "both", EngineConfig(model=tiny_model, device="cpu",
                                                     num_blocks=64), WorkerOptions(),
                          torch_threads=1, cpu_affinity=CORES[-1:])
        return ray.remote(EngineActor).options(num_cpus=0).remote(spec)

    first = start("w1")
    info = ray.get(first.ready.remote(), timeout=120)
    assert info.cores == CORES[-1:] and affinity_of(info.pid) == CORES[-1:]
    second = start("w2")
    with pytest.raises(ray.exceptions.RayActorError,
                       match=rf"cpu_affinity=\[{CORES[-1]}\].*held by other workers"):
        ray.get(second.ready.remote(), timeout=120)
    ray.kill(first)  # a dead worker's core is free again, with nothing cleaned up
    wait_for(lambda: _claims(start("w3")), 120, "a new worker to claim the freed core")


def _claims(actor: object) -> bool:
    import ray

    try:
        return ray.get(actor.ready.remote(), timeout=120).cores == CORES[-1:]
    except ray.exceptions.RayActorError:
        return False
