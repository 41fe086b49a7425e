"""Transports are built by name, and naming one imports only that one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtransfer import LocalHub, TransportConfig, make_transport


def test_each_kind_builds_its_transport() -> None:
    assert make_transport(TransportConfig(kind="local"), hub=LocalHub()).name == "local"
    assert make_transport(TransportConfig(kind="tcp")).name == "tcp"


def test_unknown_kind_and_local_without_hub_are_refused_in_plain_words() -> None:
    with pytest.raises(ValueError, match=r"transport 'rdma'; expected one of \['local', 'nccl'"):
        make_transport(TransportConfig(kind="rdma"))
    with pytest.raises(ValueError, match="needs the LocalHub"):
        make_transport(TransportConfig(kind="local"))


def test_the_registry_imports_no_transport_until_one_is_built() -> None:
    code = ("import sys\n"
            "from kvtransfer import TransferAgent, TRANSPORTS\n"
            "loaded = [m for m in ('kvtransfer.tcp', 'kvtransfer.ucx', 'kvtransfer.collective',\n"
            "                      'kvtransfer.local') if m in sys.modules]\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
