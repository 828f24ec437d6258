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
from typing import TYPE_CHECKING

from traindx.cli import argtypes
from traindx.cli.run_folder import kept_arm
from traindx.common.errors import UserError
from traindx.recipes.card import CardOptions, card

if TYPE_CHECKING:
    pass


def prepare_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN", help="a run folder written by diagnose")
    params = parser.add_mutually_exclusive_group()
    params.add_argument(
        "--active-params",
        type=argtypes.positive,
        default=None,
        metavar="N",
        help="active parameters per token (for MFU)",
    )
    params.add_argument(
        "--model",
        type=argtypes.existing_file,
        default=None,
        metavar="CONFIG_JSON",
        help="the model's HuggingFace config.json: active parameters and, with "
        "--seq-len, the attention term of MFU",
    )
    parser.add_argument(
        "--seq-len",
        type=argtypes.positive_int,
        default=None,
        metavar="T",
        help="sequence length T of the attention term 12·L·H·Q·T (with --model)",
    )
    parser.add_argument("--model-name", default=None, help="the card's model name")
    parser.add_argument(
        "--gpu",
        type=argtypes.gpu_type,
        default=None,
        metavar="TYPE",
        help="GPU type for the peak FLOP/s (default: the run's GPUs); A100, H100, H200, B200, B300, GB200",
    )
    parser.add_argument(
        "--price-per-gpu-hour",
        type=argtypes.positive,
        default=None,
        metavar="USD",
        help="price of one GPU-hour, for $ per 1M tokens",
    )
    parser.add_argument(
        "--window",
        type=argtypes.step_window,
        default=None,
        metavar="FIRST:LAST",
        help="steps measured, inclusive, 0-based (default: skip the first quarter)",
    )
    parser.add_argument(
        "--tokens-per-step",
        type=argtypes.positive,
        default=None,
        metavar="N",
        help="tokens of one optimizer step (all GPUs), when the job does not say",
    )
    parser.add_argument("--author", default="traindx", help="the card's author name")
    parser.add_argument(
        "-o",
        "--output",
        type=argtypes.output_file,
        default=None,
        metavar="CARD_YAML",
        help="write the card here (default: print it)",
    )


def options_from(args: argparse.Namespace) -> CardOptions:
    return CardOptions(
        active_params=args.active_params,
        model=args.model,
        seq_len=args.seq_len,
        model_name=args.model_name,
        gpu=args.gpu,
        price_per_gpu_hour=args.price_per_gpu_hour,
        window=args.window,
        tokens_per_step=args.tokens_per_step,
        author=args.author,
    )


def fix_arm(path: str) -> str:
    """The run folder a card is made of: a `diagnose --fix` folder stands for its kept arm."""
    return kept_arm(path)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from traindx.derive.run import load_run  # lazy: pandas, not for `diagnose card --help`

    record = load_run(fix_arm(args.run_dir))
    result = card(record, options_from(args))
    if args.output:
        try:
            result.save(args.output)
        except OSError as exc:  # a full disk, a folder gone: the card is not written, one line
            raise UserError(f"cannot write {args.output}: {exc.strerror or exc}") from None
        print(f"card: {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(result.to_yaml())
    return 0
