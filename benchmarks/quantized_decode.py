"""Decode speed of quantized weights on the CPU against fp32, and each against its bytes bound.

One Llama-shaped checkpoint (default ~0.7B parameters: hidden 1536, 24 layers, GQA 12/4 heads,
MLP 4096, vocabulary 32,000) is written once in fp32, then by `cleave quantize` as int8 (one
scale per output channel, compressed-tensors) and int4 (groups of 128, compressed-tensors). Each
variant is loaded by the engine and decodes at batch 1 and batch 16:

- fp32: fp32 weights and activations; bf16: the same weights cast to bf16;
- int8, int4: the decoder's weights packed for Cleave's CPU int8/int4 kernels (or torch's),
  bf16 activations; the output projection int8 with one scale per output channel
  (`cleave quantize --quantize-lm-head`, as llama.cpp's Q4_0 files keep `output.weight` at
  higher precision), or in bf16 with `--lm-head full`.

Decode tokens/s = batch x new tokens / (time of the whole generation - time of the prefill
alone, measured by a 1-token generation of the same prompts); every variant is loaded at once
and measured `--rounds` times in turn, the best kept (this machine's runs vary by up to 25%).
The bound is what the memory system allows: per step the weights read (every parameter and
packed buffer but the input embedding) plus each sequence's KV, divided by the read bandwidth
measured in the same run (a sum over a 1 GiB tensor with the same threads). Ratios: each
variant's tokens/s over fp32's at the same batch.

Last line: one JSON object; also written to benchmarks/results/quantized_decode.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from results_io import RESULTS, command_line, emit

SHAPE = dict(hidden_size=1536, num_hidden_layers=24, num_attention_heads=12,
             num_key_value_heads=4, intermediate_size=4096, vocab_size=32000)
VARIANTS = {  # name: (checkpoint, dtype, fp32_int_kernels)
    "fp32": ("fp32", "float32", False),
    "bf16": ("fp32", "bfloat16", False),
    "int8": ("int8", "bfloat16", False),
    "int4": ("int4", "bfloat16", False),
    # the int weights packed in an fp32 model: up to 8 rows, every layer in one C call
    "int8_f32": ("int8", "float32", True),
    "int4_f32": ("int4", "float32", True),
}


def checkpoints(cache: Path, shape: dict, group_size: int, lm_head: bool) -> dict[str, Path]:
    """The fp32 checkpoint and its int8/int4 copies under `cache` (written once); `lm_head`:
    whether the copies quantize the output projection (int8 per channel)."""
    from workers.models.make_model import make_model
    from workers.quant.writer import quantize_checkpoint

    tag = "-".join(str(v) for v in shape.values())
    fp32 = cache / f"llama-{tag}"
    if not (fp32 / "config.json").exists():
        make_model(fp32, arch="llama", preset="small", overrides=dict(shape))
    out = {"fp32": fp32}
    for name, bits, group in (("int8", 8, None), ("int4", 4, group_size)):
        path = cache / (f"llama-{tag}-{name}" + ("-lm-head-int8" if lm_head else ""))
        if not (path / "config.json").exists():
            quantize_checkpoint(fp32, path, "compressed-tensors", bits=bits, group_size=group,
                                lm_head=lm_head)
        out[name] = path
    return out


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of a streaming read: the best of sums and maxima over a tensor much larger than
    the caches (on this machine about 32-35 GB/s; the small-batch matmul kernel itself streams
    weights at up to 45, so a fraction of this bound may pass 1)."""
    x = torch.ones(int(gib * 2**30 / 4), dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        for op in (torch.sum, torch.amax):
            start = time.perf_counter()
            op(x)
            best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def bytes_per_step(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: parameters and packed buffers but the input
    embedding (unless it doubles as the output projection)."""
    packed = [b for m in model.modules() if getattr(m, "matmul", None) is not None
              for b in m.buffers(recurse=False)]
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *packed]}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    embed = model.model.embed_tokens.weight
    if not model.lm_head.tied:
        total -= embed.numel() * embed.element_size()
    return total


def load(path: Path, dtype: str, packed: bool, max_batch: int, prompt_len: int):  # -> LLM
    from workers import LLM

    return LLM(str(path), dtype=dtype, max_num_seqs=max_batch, num_blocks=max_batch * 8 + 8,
               block_size=16, max_num_batched_tokens=max(256, max_batch * prompt_len),
               fp32_int_kernels=packed)


def decode_seconds(llm, batch: int, prompt_len: int, new_tokens: int) -> float:  # noqa: ANN001
    """Seconds of `new_tokens` decode steps at `batch`: a generation's time less its prefill's
    (a 1-token generation of the same, already cached, prompts)."""
    from workers import SamplingParams

    prompts = [[3 + (i * 7 + j) % 500 for j in range(prompt_len)] for i in range(batch)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=new_tokens + 1, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    start = time.perf_counter()
    llm.generate(prompts, one)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    outputs = llm.generate(prompts, full)
    total_s = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new_tokens + 1 for o in outputs)
    return max(total_s - prefill_s, 1e-9)


def kv_bytes_per_step(path: Path, dtype_size: int, batch: int, prompt_len: int,
                      new_tokens: int) -> int:
    from workers.models.model_config import ModelConfig

    mc = ModelConfig.from_pretrained(str(path))
    per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * dtype_size
    return int(batch * per_token * (prompt_len + new_tokens / 2))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", default=str(Path.home() / ".cache/cleave/quantized_decode"))
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=3,
                        help="each variant measured this many times, in turn; the best kept")
    parser.add_argument("--shape", default=None,
                        help="override the shape: key=value,... (hidden_size=..., ...)")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--lm-head", choices=("int8", "full"), default="int8",
                        help="the int8/int4 variants' output projection: int8 per output "
                             "channel, or full precision (bf16 when loaded)")
    parser.add_argument("--out", default=str(RESULTS / "quantized_decode.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = dict(SHAPE)
    if args.shape:
        shape.update({k: int(v) for k, v in (kv.split("=") for kv in args.shape.split(","))})
    paths = checkpoints(Path(args.cache), shape, args.group_size, args.lm_head == "int8")
    bandwidth = read_bandwidth()
    batches = [int(b) for b in args.batches.split(",")]
    runs: dict[str, dict] = {}
    llms = {name: load(paths[ckpt], dtype, packed, max(batches), args.prompt_len)
            for name, (ckpt, dtype, packed) in VARIANTS.items()}
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):  # the variants in turn, each round: the best of the rounds
        for name, llm in llms.items():
            for batch in batches:
                seconds = decode_seconds(llm, batch, args.prompt_len, args.new_tokens)
                best[name, batch] = min(best.get((name, batch), seconds), seconds)
    for (name, batch), seconds in best.items():
        model = llms[name].engine.runner.executor.model
        size = 4 if VARIANTS[name][1] == "float32" else 2
        run = {"tokens_per_s": batch * args.new_tokens / seconds,
               "step_ms": seconds / args.new_tokens * 1e3, "weight_bytes": bytes_per_step(model),
               "kv_bytes_per_step": kv_bytes_per_step(paths["fp32"], size, batch,
                                                      args.prompt_len, args.new_tokens)}
        step_bound_s = (run["weight_bytes"] + run["kv_bytes_per_step"]) / bandwidth
        run["bound_tokens_per_s"] = batch / step_bound_s
        run["fraction_of_bound"] = run["tokens_per_s"] / run["bound_tokens_per_s"]
        runs[f"{name}_batch{batch}"] = run
        print(f"{name:8s} batch {batch:3d}: {run['tokens_per_s']:8.1f} tok/s, step "
              f"{run['step_ms']:7.1f} ms, {run['fraction_of_bound']:.2f} of the bytes bound "
              f"({run['weight_bytes'] / 1e6:.0f} MB weights)", file=sys.stderr)
    for llm in llms.values():
        llm.engine.close()
    result = {
        "command": command_line(argv), "threads": args.threads, "shape": shape,
        "read_bandwidth_gb_s": bandwidth / 1e9, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "rounds": args.rounds,
        "int_variants_lm_head": args.lm_head, "runs": runs,
    }
    for name in [v for v in VARIANTS if v != "fp32"]:
        for batch in batches:
            result[f"{name}_vs_fp32_batch{batch}_ratio"] = (
                runs[f"{name}_batch{batch}"]["tokens_per_s"]
                / runs[f"fp32_batch{batch}"]["tokens_per_s"])
    return emit(result, args.out)


if __name__ == "__main__":
    main()
