"""Speculative decoding side by side with llama.cpp's server (issue 48), at one stream, on the
real model's full-precision weights, on `benchmarks/speculative.py`'s two workloads of real text
(`repeat`: the answer repeats code or prose from the prompt; `chat`: open questions).

Eight servers (`--methods` picks some), all up at once, measured in turn (the order rotates each round):

- Cleave: `cleave serve --in-process --model smollm2 --no-gguf-packed` (the shipped Q4_1 file
  dequantized to fp32 at load) without speculation, with n-gram prompt lookup, with the int4
  self-draft (`quantized_self`: the target's own int4 copy drafting), and with the shipped Q4_1
  file as its draft checkpoint (`draft_q4_1`: llama.cpp's `-md` pairing);
- llama.cpp: `llama-server` on the F32 GGUF of the same weights (`peer_llamacpp_gguf.f32_file`)
  without speculation, with its n-gram drafting (`--spec-type ngram-simple`, sized as Cleave's
  and at llama.cpp's defaults: a 12-token match drafting up to 48), and with the
  shipped Q4_1 file as its draft model (`-md`: the same weights quantized, llama.cpp's way of
  drafting with a quantized copy).

Every method but llama.cpp's default n-gram drafts at most 4 tokens a step
(`num_speculative_tokens` 4, `--spec-draft-n-max 4`, `--spec-ngram-simple-size-m 4`).
Greedy chat requests (`/v1/chat/completions`, each server applying the model's chat template),
one at a time. Reported per server and workload: output tokens/s (median of the rounds), the
speedup over the same system without speculation (`<system>_<method>_<workload>_ratio`), the
acceptance where the server reports it (Cleave's `usage.speculative_tokens`, llama-server's
`timings.draft_n` / `draft_n_accepted`), and whether the speculative texts equal the same
system's plain ones (greedy: they must). `cleave_over_llamacpp_<method>_<workload>_ratio`:
Cleave's tokens/s over llama.cpp's with the matching method (the int4 self-draft and the Q4_1
draft checkpoint against llama.cpp's Q4_1 draft model).

    python benchmarks/speculative_llamacpp.py [--rounds 3] [--workloads repeat chat]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from pathlib import Path
from typing import Any

from peer_llamacpp import LlamaServer, llama_cpp
from peer_llamacpp_gguf import f32_file, q4_1_file
from results_io import RESULTS, command_line, emit
from speculative import MAX_TOKENS, WORKLOADS, Server, chat_load, method_config

K = 4  # drafted tokens a step, every method
REQUESTS = 4  # per measurement, one at a time
LLAMA_METHODS = {
    "none": [],
    # an n-gram of 3 looked up, 4 tokens drafted: as Cleave's (a 2-4 token match, 4 drafted)
    "ngram": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
              "--spec-ngram-simple-size-m", str(K)],
    # llama.cpp's own defaults (a 12-token match, up to 48 drafted)
    "ngramdefault": ["--spec-type", "ngram-simple"],
    "draft_q4_1": ["--spec-type", "draft-simple", "--spec-draft-n-max", str(K),
                   "--spec-draft-n-min", "1"]}
# `speculative.py`'s methods (`method_config`), and none
CLEAVE_METHODS = ("none", "ngram", "quantized_self", "draft_q4_1")
# Cleave's -> llama.cpp's
MATCHING = {"ngram": "ngram", "quantized_self": "draft_q4_1", "draft_q4_1": "draft_q4_1"}


def servers(cache: Path, tree: Path, threads: int,
            methods: list[str] | None = None) -> dict[str, Any]:
    """The servers of `methods` (default: all; "none" always), not started, by
    `<system>_<method>`."""
    shipped = q4_1_file()
    f32 = f32_file(cache, tree, shipped)
    keep = {"none", *(methods or [*CLEAVE_METHODS, *LLAMA_METHODS])}
    found: dict[str, Any] = {
        f"cleave_{m}": Server(None if m == "none" else method_config(m), fp32=True)
        for m in CLEAVE_METHODS if m in keep}
    for method, extra in LLAMA_METHODS.items():
        if method not in keep:
            continue
        server = LlamaServer(tree, f32, 1, threads, 4096)
        server.command += extra + (["-md", str(shipped)] if method == "draft_q4_1" else [])
        found[f"llamacpp_{method}"] = server
    return found


async def _measure(url: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """`REQUESTS` greedy chat requests, one at a time: tokens/s, drafts, texts."""
    return await chat_load(url, prompts, max_tokens, 1, REQUESTS)


def run(rounds: int, workloads: list[str], threads: int, cache: Path,
        max_tokens: int | None = None, methods: list[str] | None = None) -> dict[str, Any]:
    tree = llama_cpp(cache)
    found = servers(cache, tree, threads, methods)
    runs: dict[str, dict[str, list[dict]]] = {w: {name: [] for name in found} for w in workloads}
    try:
        for server in found.values():
            server.start()
        names = list(found)
        for workload in workloads:
            prompts = WORKLOADS[workload]
            for name in names:  # warm: compiled kernels, caches
                asyncio.run(_measure(found[name].base_url, prompts, 8))
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    runs[workload][name].append(asyncio.run(_measure(
                        found[name].base_url, prompts, max_tokens or MAX_TOKENS[workload])))
                print(workload, r, {n: round(v[-1]["tokens_per_s"], 1)
                                    for n, v in runs[workload].items()}, flush=True)
    finally:
        for server in found.values():
            server.stop()
    return summary(runs)


def summary(runs: dict[str, dict[str, list[dict]]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for workload, by_server in runs.items():
        figures = {}
        for name, measured in by_server.items():
            drafted = sum(m["drafted"] for m in measured)
            accepted = sum(m["accepted"] for m in measured)
            plain = by_server[f"{name.split('_')[0]}_none"]
            figures[name] = {
                "tokens_per_s": round(statistics.median(m["tokens_per_s"] for m in measured), 2),
                "tokens_per_s_rounds": [round(m["tokens_per_s"], 2) for m in measured],
                "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                "same_texts_as_plain": all(a["texts"] == b["texts"]
                                           for a, b in zip(measured, plain))}
        result[workload] = figures
        for name, f in figures.items():
            system = name.split("_")[0]
            if not name.endswith("_none"):
                result[f"{name}_{workload}_ratio"] = round(
                    f["tokens_per_s"] / figures[f"{system}_none"]["tokens_per_s"], 3)
        for mine, theirs in MATCHING.items():
            if f"cleave_{mine}" not in figures or f"llamacpp_{theirs}" not in figures:
                continue
            result[f"cleave_over_llamacpp_{mine}_{workload}_ratio"] = round(
                figures[f"cleave_{mine}"]["tokens_per_s"]
                / figures[f"llamacpp_{theirs}"]["tokens_per_s"], 3)
        result[f"cleave_over_llamacpp_none_{workload}_ratio"] = round(
            figures["cleave_none"]["tokens_per_s"] / figures["llamacpp_none"]["tokens_per_s"], 3)
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", default=str(Path.home() / ".cache/cleave/peer_llamacpp"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["repeat", "chat"])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--max-tokens", type=int, help="per request (default: speculative.py's)")
    p.add_argument("--methods", nargs="+", choices=sorted({*CLEAVE_METHODS, *LLAMA_METHODS}),
                   help="the servers' methods (default: all; each system's plain server always)")
    p.add_argument("--out", default=str(RESULTS / "speculative_llamacpp.json"))
    args = p.parse_args(argv)
    result = run(args.rounds, args.workloads, args.threads, Path(args.cache), args.max_tokens,
                 args.methods)
    result.update(command=command_line(argv), draft_tokens=K, streams=1, threads=args.threads,
                  requests_per_measurement=REQUESTS)
    return emit(result, args.out)


if __name__ == "__main__":
    main()
