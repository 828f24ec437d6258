"""Analyze evidence that already exists: a run folder, or a py-spy recording on its own.

usage: diagnose analyze RUN_DIR       run the analyzers again, write RUN_DIR/findings.json and
                                      report.html, print the ranked summary
       diagnose analyze PYSPY_FILE    a py-spy speedscope (.json) or raw (collapsed) file that
                                      you already have: JIT compiles found from its stacks alone
"""

import json
import os
import sys

from traindx.cli import argtypes
from traindx.common.errors import UserError


def prepare_parser(parser):
    parser.add_argument(
        "path", metavar="RUN_DIR|PYSPY_FILE", help="a run folder written by diagnose, or a py-spy recording"
    )
    parser.add_argument(
        "-o",
        "--output",
        type=argtypes.output_file,
        metavar="PATH",
        default=None,
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


def _analyze_run(path):
    from traindx.cli.outputs import analyze_and_write
    from traindx.derive.run import load_run

    record = load_run(path)
    findings, report_path = analyze_and_write(record)
    return record, findings, report_path


def _analyze_file(path, rate_hz):
    from traindx.analyzers.findings import rank_findings
    from traindx.analyzers.jit import analyze_recording
    from traindx.profiler import speedscope

    if os.path.getsize(path) == 0:
        raise UserError(f"{path} is empty: not a py-spy recording")
    recording = speedscope.load(path)
    if not recording or not any(s.stacks for s in recording.values()):
        raise UserError(f"{path} holds no py-spy samples")
    with open(path, encoding="utf-8", errors="replace") as f:
        is_raw = not f.read(4096).lstrip().startswith("{")
    if is_raw:  # collapsed stacks count samples: seconds = samples / rate
        for samples in recording.values():
            samples.weights = [w / rate_hz for w in samples.weights]
    return rank_findings(analyze_recording(recording, source=f"py-spy file {os.path.basename(path)}"))


def _print_file_summary(path, findings, console=None):
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from traindx.report.terminal import SEVERITY_STYLE

    console = console or Console(file=sys.stderr)
    console.rule("traindx")
    console.print(
        f"py-spy recording: {path} (stacks only: no steps, no compile keys)", markup=False, highlight=False
    )
    if not findings:
        console.print(Text("No JIT compiles after the first call were found in these stacks.", style="green"))
        return
    table = Table(show_header=True, header_style="bold")
    table.add_column("severity")
    table.add_column("finding")
    table.add_column("per recompile", justify="right")
    table.add_column("first prescription")
    for f in findings:
        lost = "-" if f.seconds_lost_per_step is None else f"{f.seconds_lost_per_step:.2f} s"
        table.add_row(
            Text(f.severity, style=SEVERITY_STYLE.get(f.severity, "")),
            Text(f.title),
            lost,
            Text(f.prescriptions[0].summary if f.prescriptions else ""),
        )
    console.print(table)
    for f in findings[:3]:
        console.print(Text(f.summary, style="cyan"))


def run(args, parser):
    path = os.path.abspath(args.path)
    if not os.path.exists(path):
        raise UserError(f"no such run folder or file: {args.path}")
    if os.path.isdir(path):
        record, findings, report_path = _analyze_run(path)
        if not args.json:
            from traindx.report.terminal import print_summary

            print_summary(record, findings, report_path)
    else:
        findings = _analyze_file(path, args.rate)
        if not args.json:
            _print_file_summary(path, findings)
    payload = [f.to_dict() for f in findings]
    if args.output:
        from traindx.cli.outputs import write_json_file

        write_json_file(args.output, payload)
    if args.json:
        json.dump(payload, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    return 0
