"""Re-render a run's HTML report (and export its timeline for Perfetto) from the run folder.

usage: diagnose report RUN [--open] [--perfetto OUT] [--reanalyze] [--comparison FILE] [-o PATH]

The findings come from RUN/findings.json when it exists (--reanalyze runs the analyzers again);
a before/after section is drawn from --comparison, or RUN/comparison.json when present.
"""

from __future__ import annotations

import argparse

from traindx.cli import argtypes
from traindx.cli.commands import options
from traindx.cli.run_folder import ReportOptions, rerender


def prepare_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN", help="a run folder written by diagnose")
    parser.add_argument(
        "-o",
        "--output",
        type=argtypes.output_file,
        metavar="PATH",
        help="write the HTML here (default: RUN/report.html)",
    )
    parser.add_argument("--open", action="store_true", help="open the report in a web browser")
    parser.add_argument(
        "--perfetto",
        type=argtypes.output_file,
        metavar="OUT",
        help="also write the merged timeline as Chrome/Perfetto trace JSON (.json or .json.gz)",
    )
    parser.add_argument(
        "--reanalyze", action="store_true", help="run the analyzers again instead of reading findings.json"
    )
    parser.add_argument(
        "--comparison",
        type=argtypes.existing_file,
        metavar="FILE",
        help="a JSON mapping to show as 'before and after' (default: RUN/comparison.json when present)",
    )
    parser.add_argument("--quiet", action="store_true", help="print only the report's path")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    return rerender(options.from_args(ReportOptions, args))
