"""Record a job that is already running, with py-spy only (no shim, no restart).

usage: diagnose attach --pid PID [--duration S]
"""

from __future__ import annotations

import argparse

from traindx.cli import argtypes
from traindx.cli.attaching import AttachOptions, attach
from traindx.cli.commands import options


def prepare_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pid", type=argtypes.pid, required=True, help="the training process to sample")
    parser.add_argument(
        "--duration",
        dest="duration_s",
        type=argtypes.positive,
        default=30.0,
        metavar="S",
        help="seconds to sample (default 30; stops early if the job ends)",
    )
    parser.add_argument("--rank", type=argtypes.name, help="rank label (default: RANK of the process, or 0)")
    options.add_out(parser)
    options.add_sampling(parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    return attach(options.from_args(AttachOptions, args))
