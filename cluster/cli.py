"""The `cleave` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model folder (config.json, safetensors, tokenizer); default: the "
                        "embedded tiny model, created on first use")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--load-format", default="auto", help="auto, safetensors or dummy")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-prefix-caching", action="store_true")


def _cmd_generate(args: argparse.Namespace) -> int:
    from workers import LLM, SamplingParams

    llm = LLM(args.model, **_engine_options(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    prompts = args.prompt or ["Hello, my name is", "The capital of France is"]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_tokens = 0
    for out in outputs:
        sample = out.outputs[0]
        num_tokens += len(sample.token_ids)
        print(json.dumps({"prompt": out.prompt, "text": sample.text,
                          "token_ids": sample.token_ids,
                          "finish_reason": sample.finish_reason.value}, ensure_ascii=False))
    print(f"{len(outputs)} requests, {num_tokens} tokens in {elapsed:.2f} s", file=sys.stderr)
    return 0


def _engine_options(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, load_format=args.load_format, block_size=args.block_size,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=not args.no_prefix_caching)


def _cmd_serve(args: argparse.Namespace) -> int:
    import os

    from router.serve import serve_local

    model = args.model
    if model is None:
        from workers.make_model import default_model_path

        model = str(default_model_path())
    keys = list(args.api_key or [])
    keys += [k for k in os.environ.get("CLEAVE_API_KEYS", "").split(",") if k]
    router_options = {"policy": args.policy, "max_in_flight": args.max_in_flight}
    if args.served_model_name:
        router_options["served_model_name"] = args.served_model_name
    num_workers = args.num_workers
    if num_workers is None:
        num_workers = 0 if args.prefill_workers or args.decode_workers else 1
    print(f"cleave: serving {model} on http://{args.host}:{args.port} (OpenAI API) and "
          f"{args.host}:{args.grpc_port} (gRPC): {num_workers} aggregated, "
          f"{args.prefill_workers} prefill, {args.decode_workers} decode worker(s)",
          file=sys.stderr)
    serve_local(model, num_workers, args.host, args.port, args.grpc_port, keys,
                router_options=router_options, engine_options=_engine_options(args),
                num_prefill_workers=args.prefill_workers,
                num_decode_workers=args.decode_workers, transport=args.kv_transport)
    return 0


def _cmd_make_model(args: argparse.Namespace) -> int:
    from workers.make_model import make_model

    out = make_model(args.out, arch=args.arch, preset=args.preset, seed=args.seed,
                     dtype=args.dtype, weights=not args.no_weights)
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cleave", description=(
        "Cleave: LLM serving with disaggregated prefill and decode."))
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline with the engine")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="serve the OpenAI HTTP and gRPC APIs locally "
                                          "(in-process workers, no Ray)")
    _add_engine_args(serve)
    serve.add_argument("--num-workers", type=int, default=None,
                       help="aggregated engines (prefill and decode); default 1, or 0 when "
                            "prefill/decode pools are given")
    serve.add_argument("--prefill-workers", type=int, default=0,
                       help="prefill-only engines (hand the KV off to decode workers)")
    serve.add_argument("--decode-workers", type=int, default=0,
                       help="decode engines (continue handoffs; run short prompts whole)")
    serve.add_argument("--kv-transport", default="tcp", help="tcp, ucx, nccl or local")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port")
    serve.add_argument("--grpc-port", type=int, default=50051)
    serve.add_argument("--api-key", action="append",
                       help="accepted bearer key (repeatable; also CLEAVE_API_KEYS=a,b)")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--policy", default="prefix_aware",
                       help="prefix_aware, least_loaded or round_robin")
    serve.add_argument("--max-in-flight", type=int, default=256)
    serve.set_defaults(func=_cmd_serve)

    make = sub.add_parser("make-model", help="write a random-weight checkpoint (HF format)")
    make.add_argument("--arch", default="llama", help="llama, mistral or qwen2")
    make.add_argument("--preset", default="tiny", help="tiny, small or llama-3-8b")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    make.add_argument("--out", required=True, help="output folder")
    make.add_argument("--no-weights", action="store_true",
                      help="write config and tokenizer only; serve with --load-format dummy")
    make.set_defaults(func=_cmd_make_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # bad input: one line naming what was wrong, exit 2
        print(f"cleave {args.command}: error: {exc}", file=sys.stderr)
        return 2
