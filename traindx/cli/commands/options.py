"""Options that several commands take, each declared once (its type, default and help)."""

from __future__ import annotations

import argparse

from traindx.cli import argtypes


def add_out(parser: argparse.ArgumentParser) -> None:
    """--out DIR: where the run folder is created."""
    parser.add_argument(
        "--out",
        type=argtypes.output_folder,
        default=argtypes.DEFAULT_RUNS,
        metavar="DIR",
        help="folder the run folder is created in (default: ./runs)",
    )


def add_sampling(parser: argparse.ArgumentParser) -> None:
    """--pyspy-rate and --dump-interval: how py-spy samples the job."""
    parser.add_argument(
        "--pyspy-rate",
        type=argtypes.pyspy_rate,
        default=20,
        metavar="HZ",
        help="samples per second of each py-spy recorder (default 20)",
    )
    parser.add_argument(
        "--dump-interval",
        type=argtypes.non_negative,
        default=2.0,
        metavar="S",
        help="seconds between py-spy GIL snapshots (0: none; default 2)",
    )
