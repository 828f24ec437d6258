"""Record a job that is already running, with py-spy only (no shim, no restart).

usage: diagnose attach --pid PID [--duration S]
"""

from __future__ import annotations

import argparse

from traindx.cli import argtypes
from traindx.cli.attaching import AttachOptions, attach


def prepare_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pid", type=argtypes.pid, required=True, help="the training process to sample")
    parser.add_argument(
        "--duration",
        type=argtypes.positive,
        default=30.0,
        metavar="S",
        help="seconds to sample (default 30; stops early if the job ends)",
    )
    parser.add_argument(
        "--rank", type=argtypes.name, default=None, help="rank label (default: RANK of the process, or 0)"
    )
    parser.add_argument("--out", type=argtypes.output_folder, default=argtypes.DEFAULT_RUNS, metavar="DIR")
    parser.add_argument("--pyspy-rate", type=argtypes.pyspy_rate, default=20, metavar="HZ")
    parser.add_argument("--dump-interval", type=argtypes.non_negative, default=2.0, metavar="S")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    return attach(
        AttachOptions(
            pid=args.pid,
            duration_s=args.duration,
            rank=args.rank,
            out=args.out,
            pyspy_rate_hz=args.pyspy_rate,
            dump_interval_s=args.dump_interval,
        )
    )
