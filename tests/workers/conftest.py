"""Every engine test here with ranks gets them forked from a warm server
(`tests.conftest.ranks_forked_from_a_warm_server`)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _warm_ranks(ranks_forked_from_a_warm_server: None) -> None:
    """(see the module's docstring)"""
