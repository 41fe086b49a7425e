from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# what the test process's one forkserver imports before it forks: a rank's modules (its module,
# the model definitions, the loader) and the KV-transfer peers' (`tests/kvtransfer/peer.py`)
FORKSERVER_PRELOAD = ["workers.engine.parallel.rank", "workers.models.registry",
                      "workers.models.loader", "tests.kvtransfer.peer"]


def warm_forkserver() -> Any:
    """The forkserver context of this test process. Python keeps one forkserver a process and
    fixes its preloads when it starts, so every user asks for the same list. (Through
    `torch.multiprocessing`: tensors sent over its pipes go by shared memory.)"""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


# The test files that take longest, longest first (seconds in a two-worker `make test` on 2
# cores, 2026-11-29: the soak 107, the Ray app 102, ..., the chat 15). `make test` hands whole
# files to its workers in collection order (`--dist loadfile --no-loadscope-reorder`): xdist's
# own order puts the files with fewest tests last, and the long Ray-app files have one to five,
# so one worker ran the last of them alone for minutes (728 s in all; with this order, 618 s on
# the same machine). These go first, the rest after in collection order; a file missing here
# runs as any other, a stale entry costs only time. (Three workers: 623 s, three Ray apps at
# once on 2 cores; four: 610 s with two tests failing their start-up deadlines.)
LONGEST_FIRST = (
    "tests/benchmarks/test_soak.py", "tests/cluster/test_ray_app.py",
    "tests/cluster/test_ray_burst.py", "tests/cluster/test_partial_cluster.py",
    "tests/cluster/test_ray_app_tp.py", "tests/cluster/test_two_nodes.py", "tests/test_cli.py",
    "tests/workers/test_triton_attention.py", "tests/workers/test_faithfulness.py",
    "tests/workers/test_parallel_engine.py", "tests/cluster/test_role_switch_ray.py",
    "tests/cluster/test_serve_command.py", "tests/workers/test_gguf_smollm2.py",
    "tests/cluster/test_rank_actors.py", "tests/benchmarks/test_serving.py",
    "tests/workers/test_lora.py", "tests/benchmarks/test_scale_down.py",
    "tests/workers/test_fused_kernels.py", "tests/router/test_migration.py",
    "tests/cluster/test_in_process.py", "tests/workers/test_host_syncs.py",
    "tests/cluster/test_chat.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest test files first (`LONGEST_FIRST`); a file's own tests keep their order."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The embedded default's shape (tiny Llama with tokenizer), written fresh for this run."""
    from workers.models.make_model import make_model

    return str(make_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", preset="tiny"))


def cache_dir(root: Path) -> Path:
    """A fresh `CLEAVE_CACHE_DIR` for a command the test runs, for its models, sharing this
    test run's compiled kernels (a fresh folder compiles every C kernel again, ~8 s, as a
    user's first run does)."""
    from workers.kernels.native import kernel_dir

    cache = root / "cache"
    if not cache.exists():
        cache.mkdir()
        kernel_dir().mkdir(parents=True, exist_ok=True)
        (cache / "kernels").symlink_to(kernel_dir(), target_is_directory=True)
    return cache


_SPAWN: dict[str, Any] = {}  # the product's `SpawnLauncher.launch`, kept for `spawned_ranks`


@pytest.fixture(scope="session")
def ranks_forked_from_a_warm_server() -> Iterator[None]:
    """`SpawnLauncher` ranks forked from one forkserver that has imported torch and the rank's
    modules, instead of each rank a fresh interpreter importing them again (~3 s of CPU a
    rank; the suite starts over a hundred). A rank still gets its target and setup pickled,
    as a spawned one does. `tests/workers/conftest.py` uses it for every test there (it imports
    torch: not for the torch-free router tests); `spawned_ranks` gives a test the real spawn."""
    from workers.engine.parallel import group

    ctx = warm_forkserver()

    def launch(self: group.SpawnLauncher, target: Callable[[Any, Any], None],
               setup: object) -> group.RankHandle:
        driver_end, rank_end = ctx.Pipe()
        process = ctx.Process(target=_as_spawned, daemon=True, args=(
            target, dict(os.environ), os.getcwd(), setup, rank_end))
        process.start()
        rank_end.close()
        return group._ProcessHandle(process, driver_end)

    _SPAWN["launch"] = group.SpawnLauncher.launch
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(group.SpawnLauncher, "launch", launch)
        yield


def _as_spawned(target: Callable[[Any, Any], None], environ: dict[str, str], cwd: str,
                setup: object, channel: object) -> None:
    """Run a forked rank in the launching process's environment and folder, as a spawned
    rank would be (the forkserver's are those of when it started)."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    target(setup, channel)


@pytest.fixture
def spawned_ranks(ranks_forked_from_a_warm_server: None,
                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The product's own `SpawnLauncher.launch` (a fresh interpreter per rank) for one test."""
    from workers.engine.parallel import group

    monkeypatch.setattr(group.SpawnLauncher, "launch", _SPAWN["launch"])
