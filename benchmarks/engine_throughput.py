"""Cleave's engine against transformers `generate` on the same checkpoint and requests, one run.

1. Throughput: the same requests (prompt lengths 32-512, outputs 16-256 tokens, ignore_eos)
   through Cleave (continuous batching over the paged cache) and through transformers (static
   batches in arrival order, left padding, each batch running to its longest output).
   Generated tokens/s of each and the ratio.
2. Prefix caching: requests sharing a long prefix (a system prompt seen before), all submitted at
   once; mean time to first token with and without prefix caching, and the ratio.

Last line: one JSON object; also written to benchmarks/results/ with the command.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from results_io import RESULTS, command_line, emit


def make_requests(n: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
            for _ in range(n)]


def model_and_requests(model: str | None, num_requests: int, tmp: Path,
                       arch: str = "llama") -> tuple[str, list[tuple[list[int], int]]]:
    """The checkpoint (the `small` preset of `arch` made under `tmp` when None) and the
    workload."""
    if model is None:
        from workers.models.make_model import make_model

        model = str(make_model(tmp / "small", arch=arch, preset="small"))
    from workers.models.model_config import ModelConfig

    vocab = min(ModelConfig.from_pretrained(model).vocab_size, 4096)
    return model, make_requests(num_requests, vocab, seed=0)


def run_cleave(model: str, requests, max_num_seqs: int, dtype: str,
               kv_bytes: int) -> tuple[float, int]:
    from workers import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
              kv_cache_memory_bytes=kv_bytes)
    llm.generate([requests[0][0][:32]], SamplingParams(max_tokens=2))  # warm-up
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in requests]
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    if tokens != sum(m for _, m in requests):
        raise RuntimeError(f"cleave generated {tokens} tokens, expected every max_tokens")
    return elapsed, tokens


@torch.inference_mode()
def run_transformers(model_path: str, requests, batch_size: int, dtype: str) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).eval()
    pad = 0
    model.generate(torch.tensor([requests[0][0][:32]]), max_new_tokens=2, do_sample=False,
                   eos_token_id=None, pad_token_id=pad)  # warm-up
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        longest = max(m for _, m in batch)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=longest,
                             min_new_tokens=longest, do_sample=False, eos_token_id=None,
                             pad_token_id=pad)
        if out.shape[1] - width != longest:
            raise RuntimeError("transformers stopped early")
        tokens += sum(m for _, m in batch)  # the tokens each request asked for
    return time.perf_counter() - start, tokens


def prefix_ttft(model: str, prefix_len: int, num_requests: int, caching: bool,
                dtype: str) -> float:
    """Mean time to first token of `num_requests` sharing a prefix, submitted together after one
    request has already seen the prefix."""
    from workers import AsyncEngine, Engine, EngineConfig, SamplingParams

    rng = random.Random(1)
    prefix = [rng.randrange(3, 500) for _ in range(prefix_len)]
    suffixes = [[rng.randrange(3, 500) for _ in range(rng.randint(16, 64))]
                for _ in range(num_requests)]
    engine = AsyncEngine(Engine(EngineConfig(model=model, dtype=dtype, max_num_seqs=num_requests,
                                             max_num_batched_tokens=2048,
                                             enable_prefix_caching=caching)))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    async def first_token(prompt: list[int]) -> float:
        start = time.perf_counter()
        async for _ in engine.generate_stream(prompt, params):
            break
        return time.perf_counter() - start

    async def run() -> list[float]:
        try:
            await first_token(prefix + [7])  # the prefix has been seen before
            return await asyncio.gather(*(first_token(prefix + s) for s in suffixes))
        finally:
            await engine.shutdown()

    ttfts = asyncio.run(run())
    return sum(ttfts) / len(ttfts)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint folder; default: make the `small` preset")
    parser.add_argument("--arch", default="llama",
                        help="the made checkpoint's family (make-model's --arch); results go to "
                             "engine_throughput_<arch>.json unless llama")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128,
                        help="Cleave's running batch (the engine's default)")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0,
                        help="Cleave's KV budget: enough for every request at once, no preemption")
    parser.add_argument("--hf-batch-size", type=int, default=32, help="transformers' batch")
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--prefix-requests", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.out is None:
        suffix = "" if args.arch == "llama" or args.model else f"_{args.arch}"
        args.out = str(RESULTS / f"engine_throughput{suffix}.json")
    if args.threads:
        torch.set_num_threads(args.threads)

    tmp = tempfile.TemporaryDirectory()
    model, requests = model_and_requests(args.model, args.num_requests, Path(tmp.name),
                                         args.arch)

    cleave_s, cleave_tokens = run_cleave(model, requests, args.max_num_seqs, args.dtype,
                                         int(args.kv_cache_gib * 1024**3))
    print(f"cleave: {cleave_tokens} tokens in {cleave_s:.1f} s", file=sys.stderr)
    hf_s, hf_tokens = run_transformers(model, requests, args.hf_batch_size, args.dtype)
    print(f"transformers: {hf_tokens} tokens in {hf_s:.1f} s", file=sys.stderr)
    cached = prefix_ttft(model, args.prefix_len, args.prefix_requests, True, args.dtype)
    uncached = prefix_ttft(model, args.prefix_len, args.prefix_requests, False, args.dtype)
    print(f"TTFT mean: {cached * 1e3:.0f} ms cached, {uncached * 1e3:.0f} ms uncached",
          file=sys.stderr)

    result = {
        "benchmark": "engine_throughput",
        "command": command_line(argv),
        "device": "cpu", "torch_threads": torch.get_num_threads(), "dtype": args.dtype,
        "arch": None if args.model else args.arch,
        "num_requests": len(requests), "cleave_max_num_seqs": args.max_num_seqs,
        "transformers_batch_size": args.hf_batch_size,
        "cleave_tokens_per_s": round(cleave_tokens / cleave_s, 1),
        "transformers_tokens_per_s": round(hf_tokens / hf_s, 1),
        "throughput_vs_transformers_ratio": round(hf_s / cleave_s, 2),
        "prefix_len": args.prefix_len, "prefix_requests": args.prefix_requests,
        "ttft_cached_ms": round(cached * 1e3, 1), "ttft_uncached_ms": round(uncached * 1e3, 1),
        "prefix_cache_ttft_ratio": round(uncached / cached, 2),
    }
    return emit(result, args.out)


if __name__ == "__main__":
    main()
