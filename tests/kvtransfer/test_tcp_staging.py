"""The TCP transport's host staging: a CPU cache is sent from and received into its own memory
(zero copy, nothing staged), and the staging buffer device caches go through is reused across
views and transfers, growing only for a larger view. Pinning and device copies need a GPU:
tests/gpu/test_tcp_staging.py."""

from __future__ import annotations

import asyncio
import socket

import torch

from kvtransfer import tcp
from tests.kvtransfer.test_agent import blocks_equal, close, make_pair


def test_a_contiguous_cpu_view_is_sent_in_place_and_never_staged():
    staging = tcp.HostStaging(pin=False)
    t = torch.arange(24, dtype=torch.float32).view(2, 12)
    assert tcp.host_view(t, staging) is t
    strided = t[:, ::2]
    copied = tcp.host_view(strided, staging)
    assert copied.is_contiguous() and torch.equal(copied, strided)
    assert staging.allocations == 0  # CPU tensors are not staged, contiguous or not


def test_the_staging_buffer_is_reused_and_grows_only_for_a_larger_view():
    staging = tcp.HostStaging(pin=False)
    big = torch.randn(4, 16, dtype=torch.float32)[:, ::2]  # 128 bytes, strided
    out = staging.copy_out(big)
    assert torch.equal(out, big) and out.is_contiguous() and staging.allocations == 1
    first = out.data_ptr()
    small = torch.arange(6, dtype=torch.int16).view(2, 3)
    out = staging.copy_out(small)
    assert torch.equal(out, small) and out.dtype == torch.int16
    assert out.data_ptr() == first and staging.allocations == 1
    larger = torch.randn(64, dtype=torch.float64)  # 512 bytes
    assert torch.equal(staging.copy_out(larger), larger) and staging.allocations == 2


def test_a_strided_view_is_received_whole():
    async def run():
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        want = torch.randn(3, 8)
        target = torch.zeros(3, 16)
        view = target[:, ::2]
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(a, want.numpy().tobytes())
        await tcp.recv_into_view(b, view, tcp.HostStaging(pin=False))
        a.close()
        b.close()
        assert torch.equal(view, want) and not target[:, 1::2].any()

    asyncio.run(run())


def test_a_cpu_cache_transfer_never_touches_the_staging_buffer(monkeypatch):
    def refuse(self, like):
        raise AssertionError(f"staged a {like.device} view of {tuple(like.shape)}")

    monkeypatch.setattr(tcp.HostStaging, "host", refuse)

    async def run():
        src, dst = await make_pair("tcp")
        ids = src.pool.allocate(5, scattered=True)
        local = dst.pool.allocate(5)
        for _ in range(2):  # a second transfer takes the first one's (returned) buffer
            await dst.agent.pull(src.agent.offer("r", ids), local)
            assert blocks_equal(src.caches, ids, dst.caches, local)
            ids = src.pool.allocate(5)
        await close(src, dst)
        return src.agent._transport, dst.agent._transport

    served, fetched = asyncio.run(run())
    # one buffer on each side served both transfers in turn
    assert len(served._staging) == 1 and len(fetched._staging) == 1

