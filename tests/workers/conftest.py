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
