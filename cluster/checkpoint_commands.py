"""`cleave make-model` and `cleave quantize`: the commands that write checkpoints."""

from __future__ import annotations

import argparse

from workers.models.kit_archs import KIT_ARCHS


def _cmd_make_model(args: argparse.Namespace) -> int:
    from workers.models.make_model import make_model

    if args.mtp_layers and args.arch != "deepseek_v3":
        raise ValueError(f"--mtp-layers is DeepSeek-V3's (--arch deepseek_v3), got --arch "
                         f"{args.arch}")
    overrides = ({"num_nextn_predict_layers": args.mtp_layers} if args.mtp_layers else None)
    out = make_model(args.out, arch=args.arch, preset=args.preset, seed=args.seed,
                     dtype=args.dtype, weights=not args.no_weights, overrides=overrides)
    print(out)
    return 0


def _cmd_quantize(args: argparse.Namespace) -> int:
    from pathlib import Path

    from workers.quant.gptq import builtin_calibration
    from workers.quant.writer import quantize_checkpoint

    calibration = ([Path(args.calibration_file).read_text()] if args.calibration_file
                   else builtin_calibration() if args.calibrate else None)
    out = quantize_checkpoint(
        args.model, args.out, args.format, calibration=calibration, bits=args.bits,
        group_size=None if args.group_size <= 0 else args.group_size,
        symmetric=not args.asymmetric, act_order=args.act_order,
        block=None if args.block <= 0 else args.block, lm_head=args.quantize_lm_head)
    print(out)
    return 0


def add_make_model_parser(sub: argparse._SubParsersAction) -> None:
    make = sub.add_parser("make-model", help="write a random-weight checkpoint (HF format)")
    make.add_argument("--arch", default="llama", choices=KIT_ARCHS, metavar="ARCH",
                      help=f"one of {', '.join(KIT_ARCHS)}")
    make.add_argument("--preset", default="tiny", help="tiny, small or llama-3-8b")
    make.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    make.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    make.add_argument("--out", required=True, help="output folder")
    make.add_argument("--mtp-layers", type=int, default=0,
                      help="deepseek_v3: multi-token-prediction layers to write "
                           "(num_nextn_predict_layers; they draft with --speculative-config "
                           "'{\"method\": \"mtp\", ...}')")
    make.add_argument("--no-weights", action="store_true",
                      help="write config and tokenizer only; serve with --load-format dummy")
    make.set_defaults(func=_cmd_make_model)


def add_quantize_parser(sub: argparse._SubParsersAction) -> None:
    quantize = sub.add_parser("quantize", help=(
        "write a full-precision checkpoint in a quantized format (round-to-nearest, or GPTQ "
        "with --calibrate): GPTQ, "
        "AWQ, compressed-tensors or FP8"))
    quantize.add_argument("--model", required=True, help="the full-precision checkpoint folder")
    quantize.add_argument("--out", required=True, help="output folder")
    quantize.add_argument("--format", required=True, help="the checkpoint format to write",
                          choices=["gptq", "awq", "compressed-tensors",
                                   "compressed-tensors-fp8", "fp8"])
    quantize.add_argument("--bits", type=int, default=4, help="4 or 8 (integer formats)")
    quantize.add_argument("--group-size", type=int, default=128,
                          help="input columns per scale; -1 for one per output channel")
    quantize.add_argument("--asymmetric", action="store_true", help="store zero points")
    quantize.add_argument("--act-order", action="store_true", help="gptq: act-order groups")
    quantize.add_argument("--block", type=int, default=128,
                          help="fp8: scale block (rows and columns); -1 for one per tensor")
    quantize.add_argument("--quantize-lm-head", action="store_true", help=(
        "quantize the output projection too (gptq: as the layers, lm_head=true; "
        "compressed-tensors: int8 per output channel); refused for tied embeddings"))
    quantize.add_argument("--calibrate", action="store_true", help=(
        "GPTQ instead of round-to-nearest: run the model on built-in calibration text (Python's "
        "reference manual) and fold each column's rounding error into the columns not yet "
        "quantized; any --group-size (act-order only with -1) and --asymmetric"))
    quantize.add_argument("--calibration-file", default=None, help=(
        "as --calibrate, on this text file instead of the built-in text"))
    quantize.set_defaults(func=_cmd_quantize)


__all__ = ["add_make_model_parser", "add_quantize_parser"]
