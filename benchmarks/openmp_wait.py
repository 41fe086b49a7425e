"""OpenMP's wait between parallel regions, as `cleave` sets it (`cluster.openmp_wait`) against
libgomp's own default, on the real model (SmolLM2-135M-Instruct's Q4_1 file) served as users
serve it: `cleave serve --in-process` (its default layout: a prefill and a decode worker in
one process) or the Ray app (one decode replica; `--layer ray`).

The bound it is compared against is the same server started with `GOMP_SPINCOUNT=300000`, a
user's own setting, which Cleave leaves alone and which is libgomp's default (300,000 spins,
100 once the process has more pool threads than cores), in the same run: two servers side by
side, measured in alternation (the order flips each round), open-chat prompts, greedy, at 1, 8
and 32 concurrent streams. `<layer>_<streams>_ratio` = output tokens/s with Cleave's setting /
with libgomp's default (the rounds' medians); the texts must match (reported).

    python benchmarks/openmp_wait.py [--rounds 3] [--streams 1 8 32] [--layer inprocess]
"""

from __future__ import annotations

import argparse
from typing import Any

from results_io import RESULTS, command_line, emit
from served_before_after import paired_rounds
from serving_ray import RayApp
from speculative import Server

LIBGOMP_DEFAULT = {"GOMP_SPINCOUNT": "300000"}


def make(layer: str, env: dict[str, str] | None) -> Any:
    if layer == "inprocess":
        return Server(None, env=env)
    return RayApp("smollm2", "smollm2", prefill=0, decode=1, num_cpus=2,
                  extra_args=("--max-num-seqs", "64"), env=env)


def run(layer: str, rounds: int, stream_counts: list[int]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    pairs = paired_rounds({"libgomp": make(layer, LIBGOMP_DEFAULT), "cleave": make(layer, None)},
                          rounds, stream_counts)
    for streams, pair in pairs.items():
        medians, key = pair["median"], f"{layer}_{streams}"
        result[key] = {"libgomp_tokens_per_s": medians["libgomp"],
                       "cleave_tokens_per_s": medians["cleave"],
                       "libgomp_rounds": pair["rounds"]["libgomp"],
                       "cleave_rounds": pair["rounds"]["cleave"],
                       "same_texts": pair["same_texts"]}
        result[f"{key}_ratio"] = round(medians["cleave"] / medians["libgomp"], 3)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--layer", choices=("inprocess", "ray"), default="inprocess")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = run(args.layer, args.rounds, args.streams)
    result["compared"] = ("output tokens/s, Cleave's OpenMP wait (OMP_WAIT_POLICY=ACTIVE, "
                          "GOMP_SPINCOUNT=300000) / libgomp's default (GOMP_SPINCOUNT=300000 "
                          "alone), same run, alternating")
    result["command"] = command_line(argv)
    return emit(result, args.out or RESULTS / f"openmp_wait_{args.layer}.json")


if __name__ == "__main__":
    main()
