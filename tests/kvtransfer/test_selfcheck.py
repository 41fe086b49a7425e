"""The transports' start-up self-check: a working path passes, a broken one is an error at
start naming the transport."""

from __future__ import annotations

import asyncio

import pytest

from kvtransfer import SelfCheckFailed, TransportConfig, self_check


@pytest.mark.parametrize("kind", ["tcp", "ucx", "local"])
def test_a_working_transport_passes_its_self_check(kind):
    asyncio.run(self_check(TransportConfig(kind)))


def test_a_transport_that_cannot_bind_fails_at_start_naming_it():
    with pytest.raises(SelfCheckFailed, match="'tcp' transport failed its self-check"):
        asyncio.run(self_check(TransportConfig("tcp", host="203.0.113.7")))  # not ours
