"""Every engine test here with ranks gets them forked from a warm server
(`tests.conftest.ranks_forked_from_a_warm_server`)."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(scope="session", autouse=True)
def _warm_ranks(ranks_forked_from_a_warm_server: None) -> None:
    """(see the module's docstring)"""


@pytest.fixture(scope="module")
def run():
    """Run a coroutine on the module's one event loop (its workers' agents live on it), within
    60 s."""
    loop = asyncio.new_event_loop()
    yield lambda coro: loop.run_until_complete(asyncio.wait_for(coro, 60))
    loop.close()


@pytest.fixture(scope="module")
def tiny_q4_1(tmp_path_factory):
    """A tiny llama (tied embeddings) as a Q4_1 GGUF file, the embedding Q4_1 too."""
    from tests.workers.gguf_files import write_gguf
    from workers.models.make_model import make_model

    folder = tmp_path_factory.mktemp("tiny-hf")
    hf_dir = make_model(folder, arch="llama", preset="tiny",
                        overrides={"tie_word_embeddings": True})
    return write_gguf(hf_dir, tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf", "Q4_1")
