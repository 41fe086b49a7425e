"""`gpu_roofline.py` section 7: tensor-parallel groups, aggregated and disaggregated.

- TP decode: the engine's decode step time with `tensor_parallel_size=tp` (one GPU per rank,
  NCCL; gloo ranks on the CPU) at each batch, against the same batch on one device
  (`tp{tp}_decode_b{b}_vs_tp1_ratio` = one device's step time / the group's: the speed-up) and
  against the per-rank bandwidth bound (each rank reads 1/tp of the weights and of the live KV:
  `tp{tp}_decode_b{b}_bound_ratio` = bound / measured).
- Disaggregated TP: a prefill worker of TP=p hands a `--disagg-prompt` token prompt to a decode
  worker of TP=d (every rank pulls its heads from the ranks that hold them, resharded, over
  `--kv-transport`); the pull's rate (the bytes its reads moved per second, as the decode
  worker measured it) against the copy bandwidth (`disagg_tp{p}_tp{d}_pull_copy_bw_ratio`),
  and the decoded greedy tokens against the same request on one aggregated device
  (`disagg_tp{p}_tp{d}_greedy_equal`).

On a GPU host the two workers of a case share the node's GPUs (spawned ranks take GPU
`rank % device_count`), so each engine gets `--tp-kv-bytes` of KV cache instead of profiling.
"""

from __future__ import annotations

import asyncio
import statistics

import torch
from results_io import sig


def sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def pairs(text: str) -> list[tuple[int, int]]:
    """"2:1,1:2" -> [(2, 1), (1, 2)]."""
    out = []
    for item in filter(None, text.split(",")):
        p, _, d = item.partition(":")
        out.append((int(p), int(d)))
    return out


def fits(ranks: int, device: torch.device) -> bool:
    """Whether `ranks` one-device ranks run here (the CPU: any number of gloo processes)."""
    return device.type == "cpu" or torch.cuda.device_count() >= ranks


def tp_decode(config_kwargs: dict, tp: int, batches: list[int], context: int, steps: int,
              device: torch.device, decode_step_times) -> dict[int, float]:
    """Median decode step seconds per batch of a TP=`tp` engine."""
    from workers import Engine, EngineConfig

    engine = Engine(EngineConfig(**config_kwargs, tensor_parallel_size=tp))
    try:
        return decode_step_times(engine, batches, context, steps, device)
    finally:
        engine.close()


def disagg_case(config_kwargs: dict, p: int, d: int, prompt: list[int], max_tokens: int,
                transport: str) -> tuple[list[int], float, int]:
    """(greedy tokens, pull bytes per second, bytes offered) of one request prefilled at
    TP=`p` and decoded at TP=`d`."""
    from workers import SamplingParams
    from workers.engine.config import EngineConfig
    from workers.contract.messages import DecodeFromHandoff
    from workers.contract.protocol import WorkerRequest
    from workers.serving.worker import Worker

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def worker(name: str, role: str, tp: int) -> Worker:
        return Worker.from_config(name, EngineConfig(**config_kwargs, tensor_parallel_size=tp),
                                  role, transport=transport)

    async def run() -> tuple[list[int], float, int]:
        prefill, decode = worker("p", "prefill", p), worker("d", "decode", d)
        try:
            await prefill.agents()
            await decode.agents()
            req = WorkerRequest("bench", tuple(prompt), params)
            result = await prefill.prefill(req, decode_tp_size=d)
            tokens = list(result.first.token_ids)
            async for event in decode.stream(DecodeFromHandoff(req, tokens[0],
                                                               result.handoff)):
                tokens += event.token_ids
            # the first pull's rate is the average's first value
            return tokens, decode.engine.kv_pull_bytes_per_s, result.handoff.num_bytes
        finally:
            await prefill.shutdown()
            await decode.shutdown()

    return asyncio.run(run())


def run_section(args, result: dict, model: str, load_format: str, device: torch.device,
                copy_bw: float, weights: int, kv_per_token: int, vocab_size: int,
                decode_step_times, log) -> None:
    """Adds section 7's figures to `result` (a case that cannot run here says why)."""
    from workers import LLM, SamplingParams

    batches = sizes(args.batches)
    base = dict(model=model, dtype=args.dtype, device=args.device, load_format=load_format,
                attention_backend=args.attention_backend, max_num_seqs=max(batches),
                max_model_len=max(args.context, args.disagg_prompt) + 512,
                kv_cache_memory_bytes=args.tp_kv_bytes)
    tp1 = {b: result[f"decode_b{b}_ms"] / 1e3 for b in batches if f"decode_b{b}_ms" in result}
    for tp in sizes(args.tp_sizes):
        if not fits(tp, device):
            result[f"tp{tp}_decode"] = f"skipped: needs {tp} devices"
            continue
        for batch, seconds in tp_decode(base, tp, batches, args.context, args.steps, device,
                                        decode_step_times).items():
            bound = (weights + batch * args.context * kv_per_token) / tp / copy_bw
            key = f"tp{tp}_decode_b{batch}"
            result[f"{key}_ms"] = sig(seconds * 1e3)
            result[f"{key}_bound_ratio"] = sig(bound / seconds)
            if batch in tp1:
                result[f"{key}_vs_tp1_ratio"] = sig(tp1[batch] / seconds)
            log(f"TP={tp} decode batch {batch}: {seconds * 1e3:.2f} ms/step")
    vocab = min(vocab_size, 32000)
    prompt = [3 + (i * 7919) % (vocab - 3) for i in range(args.disagg_prompt)]
    params = SamplingParams(temperature=0.0, max_tokens=args.disagg_tokens, ignore_eos=True)
    reference = None
    for p, d in pairs(args.disagg):
        key = f"disagg_tp{p}_tp{d}"
        if not fits(max(p, d), device):
            result[key] = f"skipped: needs {max(p, d)} devices"
            continue
        if reference is None:
            one = LLM(**base)
            reference = list(one.generate([prompt], params)[0].outputs[0].token_ids)
            one.engine.close()
        rates, moved, tokens = [], 0, []
        for _ in range(args.disagg_repeats):
            tokens, rate, moved = disagg_case(base, p, d, prompt, args.disagg_tokens,
                                              args.kv_transport)
            rates.append(rate)
        rate = statistics.median(rates)
        result[f"{key}_greedy_equal"] = tokens == reference
        result[f"{key}_kv_mb"] = sig(moved / 1e6)
        result[f"{key}_pull_gb_s"] = sig(rate / 1e9)
        result[f"{key}_pull_copy_bw_ratio"] = sig(rate / copy_bw)
        log(f"TP={p} -> TP={d}: {moved / 1e6:.1f} MB pulled at {rate / 1e9:.2f} GB/s, greedy "
            f"{'equal' if tokens == reference else 'DIFFERENT'}")


def add_arguments(parser, cuda: bool) -> None:
    parser.add_argument("--tp-sizes", default="2",
                        help="tensor-parallel sizes of the TP decode cases ('' for none)")
    parser.add_argument("--disagg", default="2:2,2:1,1:2" if cuda else "2:1,1:2",
                        help="prefill:decode TP sizes of the handoff cases ('' for none)")
    parser.add_argument("--disagg-prompt", type=int, default=2048 if cuda else 128,
                        help="prompt tokens of a handoff case")
    parser.add_argument("--disagg-tokens", type=int, default=16)
    parser.add_argument("--disagg-repeats", type=int, default=3)
    parser.add_argument("--kv-transport", default="tcp", help="tcp, ucx or nccl")
    parser.add_argument("--tp-kv-bytes", type=int, default=(32 << 30) if cuda else (256 << 20),
                        help="KV cache bytes of each of the section's engines (an explicit "
                             "budget: two workers of a case share the node's GPUs)")
