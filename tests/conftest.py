from __future__ import annotations

import os
from pathlib import Path

import pytest

# Under pytest-xdist (`make test` runs two workers), each worker's Ray instances and core claims
# live apart: a local `ray.init()` attaches to the newest cluster it finds under RAY_TMPDIR, so
# two workers sharing one would join each other's clusters.
if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("RAY_TMPDIR", f"/tmp/ray-{worker}")
    os.environ.setdefault("CLEAVE_CPU_CLAIM_DIR", f"/tmp/cleave-cpu-claims-{worker}")


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
