"""A change measured as users see it: two `cleave serve --in-process` servers of the real model
(SmolLM2-135M-Instruct's Q4_1 file, served packed) side by side, one running an older checkout
of Cleave (`--before`: a worktree, e.g. `git worktree add /tmp/before HEAD~1`, put first on its
PYTHONPATH) and one this checkout, measured in alternation (the order flips each round), on the
open-chat prompts of `speculative.py`, greedy, 96 tokens out, at 1, 8 and 32 concurrent streams.

The bound is the older checkout in the same run: `after_<streams>_ratio` = output tokens/s of
this checkout / the older one's (the rounds' medians); the texts must match (reported).
`--before .` with `--after-args` measures a setting instead: this checkout with and without
those `cleave serve` arguments (texts then may differ, as a setting can change them).

    git worktree add /tmp/before <commit>
    python benchmarks/served_before_after.py --before /tmp/before --label <name> [--rounds 3]
    python benchmarks/served_before_after.py --before . --after-args=--fp32-int-kernels \
        --label int_kernels --streams 1 8
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

from results_io import RESULTS, command_line, emit
from speculative import CHAT, MAX_TOKENS, Server, chat_load


def checkout(pythonpath: str | None, extra: tuple[str, ...] = ()) -> Server:
    """`cleave serve --in-process` of SmolLM2 running the code at `pythonpath` (None or ".":
    this checkout), with `extra` arguments."""
    env = None if pythonpath in (None, ".") else {"PYTHONPATH": str(pythonpath)}
    return Server(None, env=env, extra=extra)


def paired_rounds(servers: dict[str, Any], rounds: int, stream_counts: list[int],
                  ) -> dict[int, dict[str, Any]]:
    """Starts the two `servers` (name -> a server with `start`, `stop`, `base_url`), warms
    both, then at each stream count runs `rounds` rounds of the chat prompts on each in turn
    (the order flips each round); stops them. Per stream count: each server's tokens/s by
    round and their median, and whether their texts matched round by round."""
    for server in servers.values():
        server.start()
    out: dict[int, dict[str, Any]] = {}
    first, second = servers
    try:
        for server in servers.values():  # warm both (compiled kernels, caches)
            asyncio.run(chat_load(server.base_url, CHAT, 8, 1, 1))
        for streams in stream_counts:
            runs: dict[str, list[dict]] = {first: [], second: []}
            for r in range(rounds):
                for name in ([first, second] if r % 2 == 0 else [second, first]):
                    runs[name].append(asyncio.run(chat_load(
                        servers[name].base_url, CHAT, MAX_TOKENS["chat"], streams,
                        max(6, streams))))
            rates = {n: [round(x["tokens_per_s"], 2) for x in v] for n, v in runs.items()}
            print(streams, rates, flush=True)
            out[streams] = {"rounds": rates,
                            "median": {n: statistics.median(v) for n, v in rates.items()},
                            "same_texts": all(a["texts"] == b["texts"]
                                              for a, b in zip(runs[first], runs[second]))}
    finally:
        for server in servers.values():
            server.stop()
    return out


def run(before: str, rounds: int, stream_counts: list[int],
        after_args: tuple[str, ...] = ()) -> dict[str, Any]:
    result: dict[str, Any] = {}
    pairs = paired_rounds({"before": checkout(before), "after": checkout(None, after_args)},
                          rounds, stream_counts)
    for streams, pair in pairs.items():
        medians = pair["median"]
        result[f"streams_{streams}"] = {
            "before_tokens_per_s": medians["before"], "after_tokens_per_s": medians["after"],
            "before_rounds": pair["rounds"]["before"], "after_rounds": pair["rounds"]["after"],
            "same_texts": pair["same_texts"]}
        result[f"after_{streams}_ratio"] = round(medians["after"] / medians["before"], 3)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="an older checkout's root (a worktree)")
    parser.add_argument("--label", required=True, help="names the result file")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--after-args", default="",
                        help="`cleave serve` arguments of the second server (space-separated)")
    args = parser.parse_args(argv)
    result = run(args.before, args.rounds, args.streams, tuple(args.after_args.split()))
    result["command"] = command_line(argv)
    return emit(result, RESULTS / f"served_before_after_{args.label}.json")


if __name__ == "__main__":
    main()
