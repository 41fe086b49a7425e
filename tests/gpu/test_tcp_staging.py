"""The TCP transport's staging of GPU KV blocks through one reused pinned host buffer: sent
bytes and received blocks equal the device's, the buffer is pinned and not reallocated per view.
Needs a CUDA device; the CPU half is tests/kvtransfer/test_tcp_staging.py."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from kvtransfer import tcp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (pinned staging of GPU tensors)")


def test_device_views_go_through_one_pinned_buffer():
    staging = tcp.HostStaging()
    cache = torch.randn(2, 8, 16, 4, 32, device="cuda", dtype=torch.bfloat16)
    sent = tcp.host_view(cache[:, 3], staging)
    assert sent.device.type == "cpu" and sent.is_pinned()
    assert torch.equal(sent, cache[:, 3].cpu())
    again = tcp.host_view(cache[:, 5], staging)
    assert again.data_ptr() == sent.data_ptr() and staging.allocations == 1
    assert torch.equal(again, cache[:, 5].cpu())


def test_a_device_view_is_received_through_the_staging_buffer():
    async def run():
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        want = torch.randn(2, 16, 4, 32)
        target = torch.zeros(2, 8, 16, 4, 32, device="cuda")
        staging = tcp.HostStaging()
        await asyncio.get_running_loop().sock_sendall(a, want.numpy().tobytes())
        await tcp.recv_into_view(b, target[:, 2], staging)
        a.close()
        b.close()
        assert torch.equal(target[:, 2].cpu(), want) and staging.allocations == 1
        assert target[:, 3].abs().sum() == 0

    asyncio.run(run())
