"""Watch a run folder that is still being written (from another terminal or node): the live
status and each stable finding as `diagnose` shows them; exits when the run ends.

usage: diagnose watch RUN
"""

from __future__ import annotations

import argparse

from traindx.cli.run_folder import watch


def prepare_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN", help="the run folder (or a multi-node run)")
    parser.add_argument(
        "--poll", type=float, default=1.0, metavar="S", help="seconds between looks at the folder (default 1)"
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    return watch(args.run_dir, args.poll)
