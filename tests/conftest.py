from __future__ import annotations

from pathlib import Path

import pytest


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
