"""KV handoff of one request between two processes, per transport, against two same-run bounds.

Layout: Llama-3-8B-shaped (32 layers, 8 KV heads, head size 128, bf16, 16-token blocks), one
request at 512, 2,048 and 8,192 tokens (64 MiB, 256 MiB, 1 GiB). The source process holds the
KV under a lease and serves it; this process pulls it into scattered-free local blocks with
`TransferAgent.pull` (connection setup included) and checks the bytes once per size.

Bounds, measured in this run on the same bytes:
- memcpy: one process copying the blocks layer by layer (`Tensor.copy_`);
- raw socket: two processes, a blocking `sendall` / `recv_into` loop over loopback TCP.
Each transport reports GB/s, its ratio to each bound (`*_ratio`) and its messages per transfer.
Every KV cache, the memcpy bound's included, is backed by transparent huge pages
(`madvise(MADV_HUGEPAGE)` before first touch) as the engine allocates its own
(`workers.engine.kv_cache.host_memory`); `--no-huge-pages` uses ordinary 4 KiB pages. CMA's
`process_vm_readv` pins the source's pages one by one, and moves about 1.3x the bytes per second
from huge pages on a 2-core host (memcpy about the same).
Targets at 8,192 tokens: ucx >= 0.5 of memcpy, tcp >= 0.8 of the raw socket.

Last line: one JSON object; also written to benchmarks/results/ with the command.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import time

import torch
from results_io import RESULTS, command_line, emit

from kvtransfer import Handoff, KVLayout, TransferAgent, TransportConfig
from workers.engine.kv_cache.host_memory import advise_huge_pages

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")




def make_caches(num_blocks: int, fill: bool, huge_pages: bool = False) -> list[torch.Tensor]:
    """Random (`fill`) or zero caches, first touched after the huge-page advice if asked."""
    shape = (2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    caches = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(LAYOUT.num_layers)]
    for cache in caches:
        if huge_pages:
            advise_huge_pages(cache)
        if fill:
            cache.normal_()
        else:
            cache.zero_()
    return caches


# ---- the source process ---------------------------------------------------------------------

def serve_source(conn, transport: str, num_blocks: int, huge_pages: bool) -> None:
    asyncio.run(_serve_source(conn, transport, num_blocks, huge_pages))


async def _serve_source(conn, transport: str, num_blocks: int, huge_pages: bool) -> None:
    loop = asyncio.get_running_loop()
    torch.manual_seed(0)
    agent = TransferAgent(LAYOUT, make_caches(num_blocks, fill=True, huge_pages=huge_pages),
                          TransportConfig(transport))
    await agent.start()
    conn.send("ready")
    while True:
        n = await loop.run_in_executor(None, conn.recv)
        if n is None:
            break
        conn.send(agent.offer("bench", list(range(n)), lease_s=120).to_json())
    await agent.close()


def raw_sender(port: int, nbytes: int, reps: int) -> None:
    payload = memoryview(bytearray(nbytes // LAYOUT.num_layers))
    with socket.create_connection(("127.0.0.1", port)) as s:
        for _ in range(reps):
            s.recv(1)  # go
            for _ in range(LAYOUT.num_layers):
                s.sendall(payload)


# ---- bounds ---------------------------------------------------------------------------------

def memcpy_seconds(src: list[torch.Tensor], dst: list[torch.Tensor], blocks: int,
                   reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for s, d in zip(src, dst):
            d[:, :blocks].copy_(s[:, :blocks])
        best = min(best, time.perf_counter() - start)
    return best


def raw_socket_seconds(nbytes: int, reps: int) -> float:
    ctx = mp.get_context("spawn")
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = ctx.Process(target=raw_sender, args=(server.getsockname()[1], nbytes, reps))
        sender.start()
        conn, _ = server.accept()
        buf = memoryview(bytearray(nbytes))
        best = float("inf")
        with conn:
            for _ in range(reps):
                start = time.perf_counter()
                conn.sendall(b"g")
                got = 0
                while got < nbytes:
                    got += conn.recv_into(buf[got:])
                best = min(best, time.perf_counter() - start)
        sender.join(30)
    return best


# ---- one transport --------------------------------------------------------------------------

def bench_transport(transport: str, sizes: list[int], reps: int,
                    huge_pages: bool) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    max_blocks = max(sizes) // LAYOUT.block_size
    source = ctx.Process(target=serve_source, args=(child, transport, max_blocks, huge_pages),
                         daemon=True)
    source.start()
    try:
        if not conn.poll(120) or conn.recv() != "ready":
            raise RuntimeError(f"{transport} source did not start")
        return asyncio.run(_pull_sizes(conn, transport, sizes, reps, max_blocks, huge_pages))
    finally:
        conn.send(None)
        source.join(30)
        if source.is_alive():
            source.kill()


async def _pull_sizes(conn, transport: str, sizes: list[int], reps: int, max_blocks: int,
                      huge_pages: bool) -> dict[int, dict]:
    caches = make_caches(max_blocks, fill=False, huge_pages=huge_pages)
    agent = TransferAgent(LAYOUT, caches, TransportConfig(transport))
    await agent.start()
    torch.manual_seed(0)
    expected = make_caches(max_blocks, fill=True)
    out = {}
    for tokens in sizes:
        blocks = tokens // LAYOUT.block_size
        best, messages = float("inf"), 0
        for rep in range(reps + 1):  # the first pull warms the connection path up
            conn.send(blocks)
            handoff = Handoff.from_json(conn.recv())
            result = await agent.pull(handoff, list(range(blocks)), timeout=120)
            if rep:
                best = min(best, result.seconds)
            messages = result.num_messages
        if not all(torch.equal(e[:, :blocks].view(torch.uint8), c[:, :blocks].view(torch.uint8))
                   for e, c in zip(expected, caches)):
            raise RuntimeError(f"{transport} at {tokens} tokens: bytes differ")
        out[tokens] = {"seconds": best, "messages": messages}
    await agent.close()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--transports", nargs="+", default=["tcp", "ucx", "nccl"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                        help="back the KV caches with 4 KiB pages instead of huge pages (the "
                             "engine's default)")
    parser.add_argument("--out", default=str(RESULTS / "kv_transfer.json"))
    args = parser.parse_args(argv)
    max_blocks = max(args.tokens) // LAYOUT.block_size
    src = make_caches(max_blocks, fill=True, huge_pages=args.huge_pages)
    dst = make_caches(max_blocks, fill=False, huge_pages=args.huge_pages)
    figures: dict[str, dict] = {}
    runs = {t: bench_transport(t, args.tokens, args.reps, args.huge_pages)
            for t in args.transports}
    for tokens in args.tokens:
        blocks = tokens // LAYOUT.block_size
        nbytes = LAYOUT.bytes_per_block * blocks * LAYOUT.num_layers
        memcpy = memcpy_seconds(src, dst, blocks, args.reps)
        raw = raw_socket_seconds(nbytes, args.reps)
        row = {"bytes": nbytes, "memcpy_gbps": nbytes / memcpy / 1e9,
               "raw_socket_gbps": nbytes / raw / 1e9}
        for t, run in runs.items():
            gbps = nbytes / run[tokens]["seconds"] / 1e9
            row[f"{t}_gbps"] = gbps
            row[f"{t}_messages"] = run[tokens]["messages"]
            row[f"{t}_vs_memcpy_ratio"] = gbps / row["memcpy_gbps"]
            row[f"{t}_vs_raw_socket_ratio"] = gbps / row["raw_socket_gbps"]
        figures[str(tokens)] = {k: round(v, 4) if isinstance(v, float) else v
                                for k, v in row.items()}
        print(f"{tokens:>6} tokens  " + "  ".join(f"{k}={v}" for k, v in
                                                  figures[str(tokens)].items()), flush=True)
    result = {
        "benchmark": "kv_transfer",
        "command": command_line(argv),
        "layout": LAYOUT.to_dict(),
        "cpu_threads": torch.get_num_threads(),
        "huge_pages": args.huge_pages,
        "figures": figures,
    }
    return emit(result, args.out)


if __name__ == "__main__":
    main()
