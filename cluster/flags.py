"""Command-line flags onto a `CleaveConfig`: vLLM's flag names where the meaning is the same.

A flag given on the command line overrides the `--config` file's value; a flag left out keeps
it (or the config's default). Pool-wide flags (`--tensor-parallel-size`, `--block-size`, ...)
apply to every pool.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from cluster.config import CleaveConfig, ConfigError

# flag dest -> (section, key) under every pool's settings
_POOL_FLAGS = {"tensor_parallel_size": ("", "tp"), "pipeline_parallel_size": ("", "pp"),
               "expert_parallel_size": ("", "ep"),
               "gpu_memory_utilization": ("engine", "gpu_memory_utilization"),
               "block_size": ("engine", "block_size"), "max_num_seqs": ("engine", "max_num_seqs"),
               "max_num_batched_tokens": ("engine", "max_num_batched_tokens"),
               "num_gpu_blocks_override": ("engine", "num_blocks"),
               "attention_backend": ("engine", "attention_backend"),
               "kv_cache_dtype": ("engine", "kv_cache_dtype"),
               "max_cuda_graph_batch_size": ("engine", "max_cuda_graph_batch_size")}
_MODEL_FLAGS = {"model": "path", "served_model_name": "served_model_name", "dtype": "dtype",
                "max_model_len": "max_model_len", "load_format": "load_format"}
_ROUTER_FLAGS = {"host": "host", "port": "http_port", "grpc_port": "grpc_port",
                 "ingress": "ingress", "policy": "policy", "max_in_flight": "max_in_flight",
                 "disagg_threshold_tokens": "disagg_threshold_tokens",
                 "allow_unauthenticated": "allow_unauthenticated",
                 "tool_call_parser": "tool_call_parser"}


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `cleave serve` and `cleave build-serve-config` (all default to unset)."""
    p.add_argument("--config", default=None, help="a Cleave config YAML file (flags override it)")
    p.add_argument("--model", default=None, help="model folder; default: the embedded tiny model")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default=None, help="auto, float32, bfloat16 or float16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--load-format", default=None, help="auto, safetensors or dummy")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None)
    p.add_argument("--expert-parallel-size", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--attention-backend", default=None, help="auto, torch, cpu or triton")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="auto, float32, bfloat16, float16, int8 or fp8 (8 bits, a scale per "
                        "token and head)")
    p.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="GiB of host memory per replica keeping evicted prefix-cache blocks, "
                        "copied back on a hit instead of recomputed (default 0: none)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU: no CUDA graphs for decode steps")
    p.add_argument("--max-cuda-graph-batch-size", type=int, default=None)
    p.add_argument("--async-scheduling", action="store_true",
                   help="schedule the next step while the current one runs (one rank)")
    p.add_argument("--fp32-int-kernels", action="store_true",
                   help="--dtype float32 with an int8/int4 checkpoint: keep the weights packed "
                        "for the CPU int kernels instead of dequantizing them")
    p.add_argument("--no-enable-prefix-caching", "--no-prefix-caching", action="store_true",
                   dest="no_prefix_caching")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: one GPU per rank when this machine has one")
    p.add_argument("--num-workers", type=int, default=None,
                   help="replicas of one aggregated pool (instead of prefill/decode pools)")
    p.add_argument("--prefill-workers", type=int, default=None, help="prefill replicas")
    p.add_argument("--decode-workers", type=int, default=None, help="decode replicas")
    p.add_argument("--kv-transport", default=None, help="tcp, ucx or nccl")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default 8000)")
    p.add_argument("--grpc-port", type=int, default=None, help="gRPC port (default 50051)")
    p.add_argument("--ingress", default=None, choices=("direct", "serve"),
                   help="direct (default): router replicas serve the ports; serve: Ray Serve's "
                        "proxies do")
    p.add_argument("--api-key", action="append", default=None,
                   help="accepted bearer key (repeatable; also CLEAVE_API_KEYS=a,b)")
    p.add_argument("--allow-unauthenticated", action="store_true", default=None,
                   help="serve on a non-loopback --host without API keys (refused otherwise)")
    p.add_argument("--policy", default=None, help="prefix_aware, least_loaded or round_robin")
    p.add_argument("--max-in-flight", type=int, default=None)
    p.add_argument("--disagg-threshold-tokens", type=int, default=None)
    p.add_argument("--tool-call-parser", default=None,
                   choices=("llama3_json", "hermes", "mistral"),
                   help="how the model writes tool calls; default: as its chat template shows")


def _fixed(n: int) -> dict[str, int]:
    return {"min": n, "max": n, "initial": n}


def _pools(args: argparse.Namespace, pools: dict[str, Any]) -> dict[str, Any]:
    if args.num_workers is not None and (args.prefill_workers or args.decode_workers):
        raise ConfigError(f"--num-workers={args.num_workers} (an aggregated pool) cannot be "
                          f"combined with --prefill-workers/--decode-workers")
    if args.num_workers is not None:
        return {"aggregated": {**pools.get("aggregated", {}),
                               "replicas": _fixed(args.num_workers)}}
    out = dict(pools)
    for name, n in (("prefill", args.prefill_workers), ("decode", args.decode_workers)):
        if n is None:
            continue
        out.pop("aggregated", None)
        if n == 0:
            out.pop(name, None)
        else:
            out[name] = {**out.get(name, {}), "replicas": _fixed(n)}
    return out


def config_from_args(args: argparse.Namespace) -> CleaveConfig:
    """The config file (or the defaults) with the given flags applied; raises `ConfigError`."""
    base = CleaveConfig.from_yaml(args.config) if args.config else CleaveConfig()
    data = base.to_dict()
    for flag, key in _MODEL_FLAGS.items():
        if getattr(args, flag) is not None:
            data["model"][key] = getattr(args, flag)
    for flag, key in _ROUTER_FLAGS.items():
        if getattr(args, flag) is not None:
            data["router"][key] = getattr(args, flag)
    keys = list(args.api_key or [])
    keys += [k for k in os.environ.get("CLEAVE_API_KEYS", "").split(",") if k]
    if keys:
        data["router"]["api_keys"] = keys
    if args.kv_transport is not None:
        data["kv_transfer"]["transport"] = args.kv_transport
    pools = _pools(args, {k: v for k, v in data["pools"].items() if v is not None})
    gpus = None if args.device == "auto" and args.config else _gpus_per_rank(args.device)
    for settings in pools.values():
        for flag, (section, key) in _POOL_FLAGS.items():
            if getattr(args, flag) is not None:
                (settings.setdefault(section, {}) if section else settings)[key] = getattr(args,
                                                                                           flag)
        if args.no_prefix_caching:
            settings.setdefault("engine", {})["enable_prefix_caching"] = False
        if args.kv_offloading_size is not None:
            if not args.kv_offloading_size >= 0:
                raise ConfigError(f"--kv-offloading-size must be >= 0 GiB, got "
                                  f"{args.kv_offloading_size}")
            settings.setdefault("engine", {})["host_kv_cache_memory_bytes"] = int(
                args.kv_offloading_size * 2**30)
        if args.enforce_eager:
            settings.setdefault("engine", {})["enforce_eager"] = True
        if args.async_scheduling:
            settings.setdefault("engine", {})["async_scheduling"] = True
        if args.fp32_int_kernels:
            settings.setdefault("engine", {})["fp32_int_kernels"] = True
        if gpus is not None:
            settings["gpus_per_rank"] = gpus
    data["pools"] = pools
    return CleaveConfig.parse(data)


def _gpus_per_rank(device: str) -> float | None:
    """GPUs per rank for `--device` (None: keep the config's)."""
    if device == "cpu":
        return 0.0
    if device == "cuda":
        return 1.0
    import torch

    return 1.0 if torch.cuda.is_available() else None
