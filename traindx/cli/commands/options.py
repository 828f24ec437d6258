"""Options that several commands take, each declared once (its type, default and help), and
the one wiring from parsed arguments to an engine's options."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar

from traindx.cli import argtypes

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def from_args(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """cls made of the parsed arguments named as its fields (and of `given`)."""
    names = {f.name for f in dataclasses.fields(cls)} & set(vars(args))
    return cls(**{name: getattr(args, name) for name in names}, **given)


def add_out(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=argtypes.output_folder,
        default=argtypes.DEFAULT_RUNS,
        metavar="DIR",
        help="folder the run folder is created in (default: ./runs)",
    )


def add_sampling(parser: argparse.ArgumentParser) -> None:
    """How py-spy samples the job."""
    parser.add_argument(
        "--pyspy-rate",
        dest="pyspy_rate_hz",
        type=argtypes.pyspy_rate,
        default=20,
        metavar="HZ",
        help="samples per second of each py-spy recorder (default 20)",
    )
    parser.add_argument(
        "--dump-interval",
        dest="dump_interval_s",
        type=argtypes.non_negative,
        default=2.0,
        metavar="S",
        help="seconds between py-spy GIL snapshots (0: none; default 2)",
    )


def add_measured_steps(parser: argparse.ArgumentParser, what: str) -> None:
    """The steady window of steps measured, and the tokens of a step."""
    parser.add_argument(
        "--window",
        type=argtypes.step_window,
        metavar="FIRST:LAST",
        help=f"steps {what}, inclusive, 0-based (default: skip the first quarter of the steps, the warm-up)",
    )
    parser.add_argument(
        "--tokens-per-step",
        type=argtypes.positive,
        metavar="N",
        help="tokens of one optimizer step (all GPUs), when the job's log does not say",
    )
