"""The engine against the hardware's own bounds, each measured in the same run.

Written for a GPU (a Llama-3-8B-shaped checkpoint in bf16 on an H100/H200); runs on CPU too
(the `small` preset, fp32, the `auto` attention backend: `cpu` where a C compiler builds it) so
the script itself is checked without one. Sections:

1. bounds: device-to-device copy bandwidth (bytes read + written per second of a large copy)
   and dense matmul throughput in the model's dtype;
2. decode: the engine's step time at several batch sizes, every sequence `--context` tokens
   long, against the bandwidth bound (weights read + live KV read, divided by the copy
   bandwidth). `decode_b1_bound_ratio` = bound / measured: 1.0 would be the roofline;
3. attention: the decode attention backend alone (batch x context grid): KV bytes read per
   second against the copy bandwidth;
4. prefill: one `--prefill-tokens` prompt's step time against the matmul bound (the model's
   FLOPs divided by the measured matmul FLOP/s);
5. transformers: generated tokens/s of the engine and of transformers `generate` on the same
   requests, all submitted at once (`--hf-requests` concurrent), and the ratio;
6. faithfulness (GPU only): greedy tokens on the GPU path, with and without CUDA graphs, equal
   the CPU reference path's on the tiny checkpoint in fp32;
7. tensor parallel (`roofline_tp.py`): TP decode step times against one device and the
   per-rank bound, and disaggregated TP=p -> TP=d handoffs (pull rate against the copy
   bandwidth, greedy tokens against one aggregated device). A case needing more GPUs than
   the host has is recorded as skipped.

Last line: one JSON object; also written to benchmarks/results/ with the command.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import roofline_tp
import torch
from results_io import RESULTS, command_line, emit, sig


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of `fn()` over `repeats` runs after `warmup`."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---- 1. bounds ---------------------------------------------------------------------------

def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeats=10)
    return 2 * nbytes / seconds


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an n x n x n matmul in `dtype`."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = timed(lambda: a @ b, device, repeats=10)
    return 2 * n**3 / seconds


# ---- the model's bytes and FLOPs ---------------------------------------------------------

def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter but the input embedding (only
    the batch's rows of it are read), unless it doubles as the output projection."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight.data_ptr() == embed.data_ptr()
    return total if tied else total - embed.numel() * embed.element_size()


def prefill_flops(mc, num_tokens: int) -> float:
    """Matmul FLOPs of a fresh prompt: 2 x weights x tokens for the projections and the LM
    head (last token only), plus causal attention (QK^T and PV over half the square)."""
    h, layers = mc.hidden_size, mc.num_hidden_layers
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * mc.intermediate_size
    projections = 2 * num_tokens * layers * per_layer + 2 * h * mc.vocab_size
    attention = layers * 2 * 2 * q * num_tokens * num_tokens / 2
    return projections + attention


# ---- 2. decode and 4. prefill through the engine -------------------------------------------

def _fill(engine, batch: int, context: int, vocab: int, rng: random.Random, params) -> list[str]:
    """Adds `batch` distinct prompts of `context` tokens and steps until every one has its
    first token (so the next steps are pure decode)."""
    from workers.contract.protocol import WorkerRequest

    ids = [f"r{rng.random()}" for _ in range(batch)]
    for rid in ids:
        engine.generate(WorkerRequest(
            rid, tuple(rng.randrange(3, vocab) for _ in range(context)), params))
    while any(engine.scheduler.requests[r].num_output_tokens == 0 for r in ids):
        engine.step()
    return ids


def decode_step_times(engine, batches: list[int], context: int, steps: int,
                      device: torch.device) -> dict[int, float]:
    from workers import SamplingParams

    vocab = min(engine.model_config.vocab_size, 32000)
    rng = random.Random(0)
    out = {}
    for batch in batches:
        # the first prompts decode while the last are still prefilling: none may finish first
        fill_steps = -(-batch * context // engine.config.max_num_batched_tokens)
        params = SamplingParams(temperature=0.0, max_tokens=steps + fill_steps + 8,
                                ignore_eos=True)
        ids = _fill(engine, batch, context, vocab, rng, params)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()  # returns after the sampled tokens reached the host
            times.append(time.perf_counter() - start)
        out[batch] = statistics.median(times[1:] or times)
        for rid in ids:
            engine.abort(rid)
        log(f"decode batch {batch}: {out[batch] * 1e3:.2f} ms/step")
    return out


def prefill_time(engine, num_tokens: int, repeats: int) -> float:
    from workers import SamplingParams
    from workers.contract.protocol import WorkerRequest

    vocab = min(engine.model_config.vocab_size, 32000)
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(repeats + 1):
        engine.generate(WorkerRequest(
            f"p{i}", tuple(rng.randrange(3, vocab) for _ in range(num_tokens)), params))
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first compiles/warms


# ---- 3. the attention backend alone ----------------------------------------------------------

def attention_inputs(mc, batch: int, context: int, block_size: int, dtype: torch.dtype,
                     device: torch.device, kv_dtype: torch.dtype | None = None):
    """(q, k, v, one layer's cache, metadata, KV bytes a decode reads): `batch` sequences of
    `context` tokens in shuffled blocks. `kv_dtype`: the cache's (default `dtype`); an 8-bit one
    holds random values and four scales per row (`workers.kernels.kv_quant`), its bytes counted."""
    from workers.attention import AttentionMetadata
    from workers.kernels.kv_quant import SCALE_ELEMS, is_quantized, storage_head_dim

    kv_dtype = kv_dtype or dtype
    hq, hkv, d = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq + 1
    shape = (2, num_blocks, block_size, hkv, storage_head_dim(d, kv_dtype))
    if is_quantized(kv_dtype):  # bytes 0-63 (no fp8 NaN among them), each row's scales 1/64
        cache = torch.randint(0, 64, shape, dtype=torch.int8, device=device)
        cache[..., d:] = 0
        cache[..., d:d + SCALE_ELEMS] = torch.full((SCALE_ELEMS // 4,), 1 / 64,
                                                   device=device).view(torch.int8)
        cache = cache.view(kv_dtype)
    else:
        cache = torch.randn(shape, dtype=kv_dtype, device=device)
    order = torch.randperm(num_blocks - 1, device=device).to(torch.int32)
    tables = order.view(batch, per_seq)
    lens = [context] * batch
    slots = (tables[:, (context - 1) // block_size].to(torch.int64) * block_size
             + (context - 1) % block_size)
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(batch + 1, dtype=torch.int32,
                                                         device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), block_tables=tables,
        num_decodes=batch, max_query_len=1, max_seq_len=context,
        query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=lens)
    q = torch.randn(batch, hq, d, dtype=dtype, device=device)
    k = torch.randn(batch, hkv, d, dtype=dtype, device=device)
    v = torch.randn_like(k)
    kv_bytes = 2 * batch * context * hkv * shape[-1] * cache.element_size()
    return q, k, v, cache, meta, kv_bytes


def attention_seconds(backend_name: str, mc, batch: int, context: int, block_size: int,
                      dtype: torch.dtype, device: torch.device,
                      kv_dtype: torch.dtype | None = None) -> tuple[float, int]:
    """(median seconds of the backend's decode attention, KV bytes it reads) on one layer's
    cache (`attention_inputs`)."""
    from workers.attention import get_backend

    backend = get_backend(backend_name)
    q, k, v, cache, meta, kv_bytes = attention_inputs(mc, batch, context, block_size, dtype,
                                                      device, kv_dtype)
    d = q.shape[-1]
    seconds = timed(lambda: backend.forward(q, k, v, cache, meta, d ** -0.5), device, repeats=10)
    return seconds, kv_bytes


def attention_bandwidth(backend_name: str, mc, batch: int, context: int, block_size: int,
                        dtype: torch.dtype, device: torch.device) -> float:
    """KV bytes per second the decode attention reads over a cache of `dtype`."""
    seconds, kv_bytes = attention_seconds(backend_name, mc, batch, context, block_size, dtype,
                                          device)
    return kv_bytes / seconds


# ---- 5. against transformers -------------------------------------------------------------------

def make_requests(n: int, vocab: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                  seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))],
             rng.randint(*output_len)) for _ in range(n)]


def engine_generate(engine, requests) -> tuple[float, int]:
    from workers import SamplingParams
    from workers.contract.protocol import WorkerRequest

    sync(engine.device)
    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.generate(WorkerRequest(f"g{i}", tuple(prompt), SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start, sum(m for _, m in requests)


@torch.inference_mode()
def transformers_generate(model_path: str, requests, dtype: torch.dtype, device: torch.device,
                          random_weights: bool) -> tuple[float, int]:
    """All requests in one `generate` batch (left padding, run to the longest output), the
    way a user of transformers serves concurrent requests. Weights: the checkpoint's, or
    (`random_weights`) transformers' own initialisation of the same config, on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if random_weights:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path),
                                                     dtype=dtype).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    pad = 0
    width = max(len(p) for p, _ in requests)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in requests], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in requests],
                        device=device)
    longest = max(m for _, m in requests)
    model.generate(ids[:1, -8:], max_new_tokens=2, do_sample=False, eos_token_id=None,
                   pad_token_id=pad)  # warm-up
    sync(device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=longest,
                         min_new_tokens=longest, do_sample=False, eos_token_id=None,
                         pad_token_id=pad)
    sync(device)
    elapsed = time.perf_counter() - start
    if out.shape[1] - width != longest:
        raise RuntimeError("transformers stopped early")
    del model
    return elapsed, sum(m for _, m in requests)


# ---- 6. faithfulness of the GPU path ------------------------------------------------------------

def gpu_matches_cpu(tiny: str, device: torch.device) -> dict:
    from workers import LLM, SamplingParams

    prompts = ["The quick brown fox", "Paged attention keeps the cache in blocks", "A"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def tokens(**kw):
        llm = LLM(tiny, dtype="float32", num_blocks=256, **kw)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.engine.close()
        return out

    reference = tokens(device="cpu")
    graphs = tokens(device=str(device))
    eager = tokens(device=str(device), enforce_eager=True)
    return {"greedy_equal_cpu_graphs": graphs == reference,
            "greedy_equal_cpu_eager": eager == reference}


# ---- the run ---------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint folder; default: make --preset")
    parser.add_argument("--preset", default="llama-3-8b" if cuda else "small")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    parser.add_argument("--batches", default="1,32,128,256" if cuda else "1,8")
    parser.add_argument("--context", type=int, default=1024 if cuda else 256,
                        help="tokens per sequence in the decode section")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per batch")
    parser.add_argument("--kernel-batches", default="64,256" if cuda else "8")
    parser.add_argument("--kernel-contexts", default="1024,8192" if cuda else "512")
    parser.add_argument("--prefill-tokens", type=int, default=4096 if cuda else 512)
    parser.add_argument("--hf-requests", type=int, default=256 if cuda else 8)
    parser.add_argument("--hf-prompt-len", default="128,512" if cuda else "32,64")
    parser.add_argument("--hf-output-len", default="64,256" if cuda else "8,32")
    parser.add_argument("--copy-mb", type=int, default=1024 if cuda else 256,
                        help="bytes of the copy that measures the bandwidth, in MiB")
    parser.add_argument("--matmul-n", type=int, default=8192 if cuda else 1024,
                        help="n of the n x n x n matmul that measures FLOP/s")
    parser.add_argument("--kv-cache-mb", type=int, default=None if cuda else 2048,
                        help="the engine's KV cache in MiB (default: profiled on a GPU)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-faithfulness", action="store_true",
                        help="leave out section 6 (greedy on the GPU against the CPU)")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, int8 or fp8, ...")
    parser.add_argument("--out", default=str(RESULTS / "gpu_roofline.json"))
    roofline_tp.add_arguments(parser, cuda)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)

    from workers import Engine, EngineConfig
    from workers.models.make_model import make_model

    tmp = tempfile.TemporaryDirectory()
    # without --model: config and tokenizer only, weights drawn at load time (`dummy`): the
    # 8B shape's 16 GB are never written, and transformers initialises its own random weights
    # (throughput does not depend on the values: every request runs to its max_tokens)
    model = args.model or str(make_model(Path(tmp.name) / args.preset, arch="llama",
                                         preset=args.preset, dtype=args.dtype, weights=False))
    load_format = "auto" if args.model else "dummy"
    result: dict = {"benchmark": "gpu_roofline", "command": command_line(argv),
                    "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                    "dtype": args.dtype, "model": args.model or f"make-model {args.preset}"}

    copy_bw = copy_bandwidth(device, args.copy_mb << 20)
    flops = matmul_flops(device, dtype, args.matmul_n)
    result.update(copy_bandwidth_gb_s=sig(copy_bw / 1e9),
                  matmul_tflop_s=sig(flops / 1e12))
    log(f"copy {copy_bw / 1e9:.1f} GB/s, matmul {flops / 1e12:.2f} TFLOP/s")

    batches = ints(args.batches)
    engine = Engine(EngineConfig(
        model=model, dtype=args.dtype, device=args.device, load_format=load_format,
        attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=max(max(batches), args.hf_requests),
        max_num_batched_tokens=max(args.prefill_tokens, 2048),
        max_model_len=max(args.context, args.prefill_tokens, 1024) + 512,
        kv_cache_memory_bytes=None if args.kv_cache_mb is None else args.kv_cache_mb << 20))
    mc = engine.model_config
    backend = engine.config.resolved_attention_backend
    result.update(attention_backend=backend, kv_cache_dtype=args.kv_cache_dtype,
                  cuda_graphs=type(engine.runner.executor).__name__ == "CudaGraphExecutor")
    weights = weight_bytes_read(engine.runner.executor.model)
    spec = engine.runner.spec  # an 8-bit cache's rows carry their scale slot too
    kv_per_token = (2 * mc.num_hidden_layers * mc.num_key_value_heads * spec.cache_head_dim
                    * spec.dtype.itemsize)

    # 2. decode
    for batch, seconds in decode_step_times(engine, batches, args.context, args.steps,
                                            device).items():
        bound = (weights + batch * args.context * kv_per_token) / copy_bw
        result[f"decode_b{batch}_ms"] = sig(seconds * 1e3)
        result[f"decode_b{batch}_bound_ms"] = sig(bound * 1e3)
        result[f"decode_b{batch}_bound_ratio"] = sig(bound / seconds)
        result[f"decode_b{batch}_tokens_per_s"] = sig(batch / seconds)

    # 4. prefill
    seconds = prefill_time(engine, args.prefill_tokens, repeats=3)
    bound = prefill_flops(mc, args.prefill_tokens) / flops
    result.update(prefill_tokens=args.prefill_tokens, prefill_ms=sig(seconds * 1e3),
                  prefill_matmul_bound_ms=sig(bound * 1e3),
                  prefill_matmul_bound_ratio=sig(bound / seconds))
    log(f"prefill {args.prefill_tokens}: {seconds * 1e3:.1f} ms (matmul bound "
        f"{bound * 1e3:.1f} ms)")

    # 5. against transformers (the engine first, then its memory goes back for transformers)
    if not args.skip_hf:
        vocab = min(mc.vocab_size, 32000)
        requests = make_requests(args.hf_requests, vocab, tuple(ints(args.hf_prompt_len)),
                                 tuple(ints(args.hf_output_len)), seed=0)
        engine_s, tokens = engine_generate(engine, requests)
        log(f"engine: {tokens} tokens in {engine_s:.2f} s")
    engine.close()
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_hf:
        hf_s, _ = transformers_generate(model, requests, dtype, device,
                                        random_weights=load_format == "dummy")
        log(f"transformers: {tokens} tokens in {hf_s:.2f} s")
        result.update(hf_requests=len(requests), engine_tokens_per_s=sig(tokens / engine_s),
                      transformers_tokens_per_s=sig(tokens / hf_s),
                      throughput_vs_transformers_ratio=sig(hf_s / engine_s))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # 7. tensor parallel, aggregated and disaggregated (the engine's memory went back first)
    roofline_tp.run_section(args, result, model, load_format, device, copy_bw, weights,
                            kv_per_token, mc.vocab_size, decode_step_times, log)

    # 3. the attention backend alone
    for batch in ints(args.kernel_batches):
        for context in ints(args.kernel_contexts):
            achieved = attention_bandwidth(backend, mc, batch, context, 16, dtype, device)
            key = f"attention_b{batch}_c{context}"
            result[f"{key}_gb_s"] = sig(achieved / 1e9)
            result[f"{key}_copy_bw_ratio"] = sig(achieved / copy_bw)
            log(f"attention batch {batch} context {context}: {achieved / 1e9:.1f} GB/s")

    # 6. faithfulness
    if device.type == "cuda" and not args.skip_faithfulness:
        tiny = str(make_model(Path(tmp.name) / "tiny", arch="llama", preset="tiny"))
        result.update(gpu_matches_cpu(tiny, device))
    return emit(result, args.out)


if __name__ == "__main__":
    main()
