"""Write a recipe card (the YAML format of recipes/cards/*.yaml) from a measured run:
tokens/s per GPU, $ per 1M tokens, MFU, step-time CV, GPU-hours, and the convergence check
when the run was the candidate arm of `diagnose --fix` (or of `diagnose compare --json
RUN/comparison.json`).

usage: diagnose card RUN [--active-params N | --model config.json] [--gpu H200]
                         [--price-per-gpu-hour P] [--window 5:19] [--tokens-per-step N] [-o card.yaml]
"""

from __future__ import annotations

import argparse
import sys

from traindx.cli import argtypes
from traindx.cli.commands import options
from traindx.cli.run_folder import kept_arm
from traindx.common.errors import UserError
from traindx.derive.device_peaks import PEAKS
from traindx.recipes.card import CardOptions, card


def prepare_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN", help="a run folder written by diagnose")
    params = parser.add_mutually_exclusive_group()
    params.add_argument(
        "--active-params", type=argtypes.positive, metavar="N", help="active parameters per token (for MFU)"
    )
    params.add_argument(
        "--model",
        type=argtypes.existing_file,
        metavar="CONFIG_JSON",
        help="the model's HuggingFace config.json: active parameters and, with --seq-len, the attention term of MFU",
    )
    parser.add_argument(
        "--seq-len",
        type=argtypes.positive_int,
        metavar="T",
        help="sequence length T of the attention term 12·L·H·Q·T (with --model)",
    )
    parser.add_argument("--model-name", help="the card's model name")
    parser.add_argument(
        "--gpu",
        type=argtypes.gpu_type,
        metavar="TYPE",
        help=f"GPU type for the peak FLOP/s (default: the run's GPUs); {', '.join(sorted(PEAKS))}",
    )
    parser.add_argument(
        "--price-per-gpu-hour",
        type=argtypes.positive,
        metavar="USD",
        help="price of one GPU-hour, for $ per 1M tokens",
    )
    options.add_measured_steps(parser, "measured")
    parser.add_argument("--author", default="traindx", help="the card's author name")
    parser.add_argument(
        "-o",
        "--output",
        type=argtypes.output_file,
        metavar="CARD_YAML",
        help="write the card here (default: print it)",
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from traindx.derive.run import load_run  # lazy: pandas, not for `diagnose card --help`

    result = card(load_run(kept_arm(args.run_dir)), options.from_args(CardOptions, args))
    if args.output:
        try:
            result.save(args.output)
        except OSError as exc:  # a full disk, a folder gone: the card is not written, one line
            raise UserError(f"cannot write {args.output}: {exc.strerror or exc}") from None
        print(f"card: {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(result.to_yaml())
    return 0
