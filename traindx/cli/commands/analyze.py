"""Analyze evidence that already exists: a run folder, a py-spy recording, an op trace.

usage: diagnose analyze RUN_DIR       run the analyzers again, write RUN_DIR/findings.json and
                                      report.html, print the ranked summary
       diagnose analyze PYSPY_FILE    a py-spy speedscope (.json) or raw (collapsed) file that
                                      you already have: JIT compiles found from its stacks alone
       diagnose analyze TRACE.parquet an op-level trace of a multi-rank job (rank, dp, stage, step,
                                      optype, start, duration; meta-NAME.yaml beside it): what the
                                      stragglers cost (a dependency-aware replay), which worker,
                                      stage, op type or sequence-length imbalance, and the fix
       diagnose analyze TRAIN.log     the same from a Megatron log's per-rank timers
                                      (--timing-log-level 2 --timing-log-option all; --tp/--pp)
       diagnose analyze RUN_DIR --what-if   the same from a run folder of several ranks
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from traindx.cli import argtypes
from traindx.common.errors import UserError


def prepare_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path",
        metavar="RUN_DIR|PYSPY_FILE|TRACE",
        help="a run folder written by diagnose, a py-spy recording, or an op trace (.parquet)",
    )
    parser.add_argument(
        "--what-if",
        action="store_true",
        help="a run folder of several ranks: the what-if replay across ranks of its spans "
        "(what each straggler, stage and op type costs) instead of the analyzers",
    )
    parser.add_argument(
        "--tp",
        type=argtypes.positive_int,
        default=1,
        metavar="N",
        help="a Megatron log: the job's tensor-parallel size (ranks map tp, dp, pp; default 1)",
    )
    parser.add_argument(
        "--pp",
        type=argtypes.positive_int,
        default=1,
        metavar="N",
        help="a Megatron log: the job's pipeline-parallel size (default 1)",
    )
    parser.add_argument(
        "--timelines",
        metavar="DIR",
        help="an op trace: write the recorded, replayed and ideal timelines here (Perfetto JSON)",
    )
    parser.add_argument(
        "-o",
        "--output",
        type=argtypes.output_file,
        metavar="PATH",
        help="also write the findings as JSON here (a py-spy file's findings are "
        "written only where this says)",
    )
    parser.add_argument(
        "--rate",
        type=argtypes.positive,
        default=100.0,
        metavar="HZ",
        help="samples per second of a raw (collapsed) py-spy file, which counts "
        "samples instead of seconds (default: py-spy's own 100)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the findings as JSON on stdout instead of the summary"
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    path = os.path.abspath(args.path)
    if not os.path.exists(path):
        raise UserError(f"no such run folder or file: {args.path}")
    payload: list[Any] | None = None
    if os.path.isdir(path) and not args.what_if:
        from traindx.derive.run import load_run
        from traindx.report.outputs import analyze_and_write  # lazy: the analyzers (pandas)
        from traindx.report.terminal import print_summary  # lazy: rich, pandas

        record = load_run(path)
        judgement, report_path = analyze_and_write(record)
        findings = list(judgement.findings)
        payload = judgement.findings_json()  # as its findings.json holds them (with --fix plans)
        if not args.json:
            print_summary(record, judgement, report_path)
    elif os.path.isdir(path) or path.endswith(".parquet") or _is_megatron_log(path):
        from traindx.cli import trace_file  # lazy: pandas, the replay
        from traindx.report import whatif_view

        if os.path.isdir(path):
            result, findings = trace_file.analyze_run(path)
        elif path.endswith(".parquet"):
            result, findings = trace_file.analyze_trace(path)
        else:
            result, findings = trace_file.analyze_megatron_log(path, args.tp, args.pp)
        if args.timelines and (os.path.isdir(path) or path.endswith(".parquet")):
            for written in whatif_view.write_timelines(result, args.timelines):
                print(f"diagnose: timeline {written}", file=sys.stderr)
        if not args.json:
            whatif_view.print_summary(args.path, result, findings)
    else:
        from traindx.cli.trace_file import analyze_file  # lazy: the analyzers (pandas)
        from traindx.report.terminal import print_file_summary

        findings = analyze_file(path, args.rate)
        if not args.json:
            print_file_summary(path, findings)
    if payload is None:
        payload = [f.to_dict() for f in findings]
    if args.output:
        from traindx.report.outputs import write_json_file  # lazy: the analyzers (pandas)

        write_json_file(args.output, payload)
    if args.json:
        json.dump(payload, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    return 0


def _is_megatron_log(path: str) -> bool:
    from traindx.profiler.megatron_timers import looks_like  # lazy: pandas

    return looks_like(path)
