"""Merge the node parts of a multi-node run into one run over all ranks.

usage: diagnose merge RUN [--no-report] [--reference NODE]

RUN/nodes/<node>/ are the run folders each node's `diagnose` wrote. This aligns the nodes'
clocks from the job's own collectives (traindx.profiler.clocks: no clock is assumed to be right) and
writes, beside the untouched node folders:
  RUN/clock.json     per node: offset_ns (added to its timestamps), error_ns (the true offset
                     is within offset_ns ± error_ns), constraints, method; conflicts if any
  RUN/manifest.json  the merged manifest: nodes, ranks over every node, GPUs with their node
  RUN/nvml.csv, RUN/log.txt, RUN/pyspy/  the nodes' samples on the reference clock (py-spy
                     files named by rank); events and torch.profiler windows stay in the node
                     folders and are read with their node's offset
then analyses the merged run and writes its report, like `diagnose` does after a job.
Running it again re-estimates and rewrites these (e.g. after a late node's folder arrived).
"""

from __future__ import annotations

import argparse
from typing import Any

from traindx.cli import argtypes
from traindx.cli.run_folder import merge_nodes
from traindx.derive.multinode import merge_parts


def prepare_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN", help="a multi-node run folder (with nodes/)")
    parser.add_argument(
        "--reference",
        type=argtypes.name,
        metavar="NODE",
        help="the node whose clock is the run's (default: the node with the most matched collectives)",
    )
    parser.add_argument(
        "--no-report", action="store_true", help="only write the merged pieces; no analysis or report"
    )
    parser.add_argument("--quiet", action="store_true", help="print only the clock table")


def merge(run_dir: str, reference: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(clock document, merged manifest): the engine's pieces (traindx.derive.multinode.merge_parts)."""
    return merge_parts(run_dir, reference=reference)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    return merge_nodes(args.run_dir, reference=args.reference, report=not args.no_report, quiet=args.quiet)
