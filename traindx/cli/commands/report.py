"""Re-render a run's HTML report (and export its timeline for Perfetto) from the run folder.

usage: diagnose report RUN [--open] [--perfetto OUT] [--reanalyze] [--comparison FILE] [-o PATH]

The findings come from RUN/findings.json when it exists (--reanalyze runs the analyzers again);
a before/after section is drawn from --comparison, or RUN/comparison.json when present.
"""

import json
import os
import sys

from traindx.cli import argtypes
from traindx.common.errors import UserError


def prepare_parser(parser):
    parser.add_argument("run_dir", metavar="RUN", help="a run folder written by diagnose")
    parser.add_argument(
        "-o",
        "--output",
        type=argtypes.output_file,
        metavar="PATH",
        default=None,
        help="write the HTML here (default: RUN/report.html)",
    )
    parser.add_argument("--open", action="store_true", help="open the report in a web browser")
    parser.add_argument(
        "--perfetto",
        type=argtypes.output_file,
        metavar="OUT",
        default=None,
        help="also write the merged timeline as Chrome/Perfetto trace JSON (.json or .json.gz)",
    )
    parser.add_argument(
        "--reanalyze", action="store_true", help="run the analyzers again instead of reading findings.json"
    )
    parser.add_argument(
        "--comparison",
        type=argtypes.existing_file,
        metavar="FILE",
        default=None,
        help="a JSON mapping to show as 'before and after' (default: RUN/comparison.json when present)",
    )
    parser.add_argument("--quiet", action="store_true", help="print only the report's path")


def _comparison(args, run_path):
    path = args.comparison or os.path.join(run_path, "comparison.json")
    if not os.path.exists(path):
        if args.comparison:
            raise UserError(f"no such comparison file: {path}")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} is not readable JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a JSON object")
    if isinstance(data.get("baseline"), dict) and "median_step_s" in data["baseline"]:
        # the raw comparison the --fix loop writes: shown as the fix loop's own report shows it
        try:
            from traindx.recipes.ab import report_view

            return report_view(data)
        except (ImportError, KeyError, TypeError, ValueError):
            return data
    return data


def run(args, parser):
    from traindx.cli.outputs import read_findings, write_outputs
    from traindx.derive.run import load_run

    if args.output and os.path.isdir(args.output):
        raise UserError(f"--output {args.output} is a folder; give a file path")
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise UserError(f"cannot write {args.output}: its folder does not exist")
    if args.reanalyze:  # a run whose recorder was killed is finished here, as `interrupted`
        from traindx.profiler.manifest import finish_interrupted

        note = finish_interrupted(args.run_dir)
        if note:
            print(f"diagnose: {note}", file=sys.stderr)
    record = load_run(args.run_dir)
    findings_path = os.path.join(record.path, "findings.json")
    findings = None
    if not args.reanalyze and os.path.exists(findings_path):
        try:
            findings = read_findings(record.path)
        except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            # derived, not evidence: rebuilt from the run below (the corrupt copy overwritten)
            import warnings

            warnings.warn(
                f"{findings_path} is unreadable ({type(exc).__name__}): the findings "
                "were analysed again from the run",
                stacklevel=2,
            )
            findings = None
    # a fresh analysis goes into RUN/findings.json, unless the report goes elsewhere (-o): the
    # run folder is then left as it is
    into_run = findings is None and not args.output
    findings, path, problems = write_outputs(
        record,
        findings,
        report_path=args.output,
        into_run=into_run,
        comparison=_comparison(args, record.path),
    )
    for line in problems:
        print(f"diagnose: not written: {line}", file=sys.stderr)
    if path is None:
        return 1
    if args.perfetto:
        from traindx.report.perfetto import export_trace

        trace_path = export_trace(record, args.perfetto)
        print(
            f"perfetto trace: {trace_path} (open it in ui.perfetto.dev or chrome://tracing)", file=sys.stderr
        )
    if args.quiet:
        print(path)
    else:
        from traindx.report.terminal import print_summary

        print_summary(record, findings, path)
    if args.open:
        import webbrowser

        if not webbrowser.open("file://" + os.path.abspath(path)):
            print(f"diagnose: no web browser found; open {path} yourself", file=sys.stderr)
    return 1 if problems else 0
