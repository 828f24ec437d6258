"""What the subcommands do with a run folder that exists already: re-render its report
(`diagnose report`), watch it while another process writes it (`diagnose watch`), find the arm
a `--fix` folder stands for (`diagnose card`).

The analyzers, pandas and the report are imported where they are used: a subcommand's `--help`
imports this module and needs none of them."""

from __future__ import annotations

import os
import sys
import time
import warnings
import webbrowser
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from traindx.common import untrusted
from traindx.common.errors import UserError

if TYPE_CHECKING:
    from traindx.analyzers.core.findings import Finding
    from traindx.derive.run import RunRecord


@dataclass(frozen=True)
class ReportOptions:
    run_dir: str
    output: str | None = None  # the HTML here (default: RUN/report.html)
    open: bool = False  # in a web browser
    perfetto: str | None = None  # also the merged timeline as Chrome/Perfetto trace JSON
    reanalyze: bool = False  # the analyzers again instead of findings.json
    comparison: str | None = None  # a JSON mapping shown as 'before and after'
    quiet: bool = False  # only the report's path


def read_comparison(comparison: str | None, run_path: str) -> dict[str, Any] | None:
    """The 'before and after' of a report: the file given, else RUN/comparison.json if there."""
    path = comparison or os.path.join(run_path, "comparison.json")
    if not os.path.exists(path):
        if comparison:
            raise UserError(f"no such comparison file: {path}")
        return None
    try:  # RUN/comparison.json is a run folder's file: no link, FIFO or device (untrusted)
        data = untrusted.load_json(os.path.realpath(path) if comparison else path, bounded=False)
    except (OSError, ValueError) as exc:
        if not comparison:  # the run folder's own copy: the report goes on without it
            why = getattr(exc, "strerror", None) or type(exc).__name__
            warnings.warn(f"{path} is not readable JSON ({why}): no 'before and after'", stacklevel=2)
            return None
        raise UserError(
            f"{path} is not readable JSON ({getattr(exc, 'strerror', None) or type(exc).__name__})"
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a JSON object")
    if isinstance(data.get("baseline"), dict) and "median_step_s" in data["baseline"]:
        # the raw comparison the --fix loop writes: shown as the fix loop's own report shows it
        try:
            from traindx.recipes.ab import report_view  # lazy: pandas

            view: dict[str, Any] = report_view(data)
            return view
        except (ImportError, KeyError, TypeError, ValueError):
            return data
    return data


def _stored_findings(record: RunRecord, reanalyze: bool) -> list[Finding] | None:
    """RUN/findings.json, unless asked to analyse again; None when it is not there or unreadable
    (derived, not evidence: rebuilt from the run, the corrupt copy overwritten)."""
    from traindx.report.outputs import read_findings  # lazy: the analyzers (pandas)

    findings_path = os.path.join(record.path, "findings.json")
    if reanalyze or not os.path.exists(findings_path):
        return None
    try:
        return read_findings(record.path)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        warnings.warn(
            f"{findings_path} is unreadable ({getattr(exc, 'strerror', None) or type(exc).__name__}): the findings "
            "were analysed again from the run",
            stacklevel=3,
        )
        return None


def rerender(options: ReportOptions) -> int:
    """Re-render a run's report (and export its timeline); 1 when an output was not written."""
    from traindx.derive.run import load_run
    from traindx.report.outputs import write_outputs  # lazy: the analyzers (pandas)
    from traindx.report.perfetto import export_trace
    from traindx.report.terminal import print_summary

    output = options.output
    if output and os.path.isdir(output):
        raise UserError(f"--output {output} is a folder; give a file path")
    if output and not os.path.isdir(os.path.dirname(os.path.abspath(output))):
        raise UserError(f"cannot write {output}: its folder does not exist")
    if options.reanalyze:  # a run whose recorder was killed is finished here, as `interrupted`
        from traindx.profiler.manifest import finish_interrupted

        note = finish_interrupted(options.run_dir)
        if note:
            print(f"diagnose: {note}", file=sys.stderr)
    from traindx.judgement import judge_run

    record = load_run(options.run_dir)
    findings = _stored_findings(record, options.reanalyze)
    # a fresh analysis goes into RUN/findings.json, unless the report goes elsewhere (-o): the
    # run folder is then left as it is
    into_run = findings is None and not output
    # judged again here, once: the stored findings completed (verdict, step causes, --fix plans)
    # or, without them, the analyzers run; the outputs and the summary render this judgement
    judgement, path, problems = write_outputs(
        record,
        judge_run(record, findings),
        report_path=output,
        into_run=into_run,
        comparison=read_comparison(options.comparison, record.path),
    )
    for line in problems:
        print(f"diagnose: not written: {line}", file=sys.stderr)
    if path is None:
        return 1
    if options.perfetto:
        try:
            trace_path = export_trace(record, options.perfetto)
        except OSError as exc:  # a full disk: one line, the report above is kept
            raise UserError(f"cannot write {options.perfetto}: {exc.strerror or exc}") from None
        print(
            f"perfetto trace: {trace_path} (open it in ui.perfetto.dev or chrome://tracing)", file=sys.stderr
        )
    if options.quiet:
        print(path)
    else:
        print_summary(record, judgement, path)
    if options.open and not webbrowser.open("file://" + os.path.abspath(path)):
        print(f"diagnose: no web browser found; open {path} yourself", file=sys.stderr)
    return 1 if problems else 0


def watch(run_dir: str, poll_s: float) -> int:
    """The live status and each stable finding of a run folder being written elsewhere, until
    the run ends."""
    from traindx.analyzers.live.live import LiveJudge, LiveOptions, run_is_live  # lazy: pandas
    from traindx.derive.run import refuse_links
    from traindx.report.live_view import LiveView

    shown = run_dir
    run_dir = os.path.abspath(run_dir)
    if not os.path.isdir(run_dir):
        raise UserError(
            f"{shown} is a file, not a run folder"
            if os.path.lexists(run_dir)
            else f"no such run folder: {shown}"
        )
    if not (
        os.path.isfile(os.path.join(run_dir, "manifest.json"))
        or os.path.isdir(os.path.join(run_dir, "nodes"))
    ):
        raise UserError(f"{shown} is not a traindx run (no manifest.json, no nodes/)")
    if not poll_s > 0:
        raise UserError("--poll must be > 0 seconds")
    refuse_links(run_dir)  # read as it is, never through a link (traindx.derive.run)
    view = LiveView()
    judge = LiveJudge(run_dir, LiveOptions(poll_s=poll_s), on_finding=view.on_finding, on_state=view.on_state)
    gone = None
    with view:
        while run_is_live(run_dir) and not (gone := _recorders_gone(run_dir)):
            judge.step_once()
            time.sleep(poll_s)
        judge.step_once(force=True)  # the finished record, once
    state = judge.state
    if gone:  # a recorder killed (SIGKILL, OOM, a lost machine) leaves `running` for ever
        print(
            f"diagnose: {gone}: watched as far as it was recorded ({state.step} steps); "
            f"`diagnose report {shown} --reanalyze` marks it interrupted and reports it",
            file=sys.stderr,
        )
        return 1
    print(
        f"diagnose watch: the run ended after {state.step} steps; "
        f"{len(state.stable)} finding(s) shown; report: {os.path.join(run_dir, 'report.html')}"
    )
    return 0


def _recorders_gone(run_dir: str) -> str | None:
    """Why nothing records into a run that says `running` any more (its own recorder, or every
    node part's that says so), else None (profiler/manifest.recorder_gone)."""
    from traindx.profiler.manifest import recorder_gone
    from traindx.profiler.nodes import NODES_DIR  # lazy, as the rest of this module

    nodes_dir = os.path.join(run_dir, NODES_DIR)
    parts = [run_dir] + sorted(
        os.path.join(nodes_dir, n) for n in (os.listdir(nodes_dir) if os.path.isdir(nodes_dir) else [])
    )
    running = [p for p in parts if _says_running(p)]
    gone = [why for why in map(recorder_gone, running) if why]
    return gone[0] if running and len(gone) == len(running) else None


def _says_running(folder: str) -> bool:
    try:
        manifest = untrusted.load_json(os.path.join(folder, "manifest.json"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("status") == "running"


def kept_arm(path: str) -> str:
    """The run folder a card is made of: a `diagnose --fix` folder stands for its kept arm."""
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    try:  # a --fix folder's file: no link, FIFO or device (untrusted)
        kept = untrusted.load_json(os.path.join(path, "fix.json"), bounded=False).get("best")
    except (OSError, ValueError, AttributeError):
        kept = None
    kept = kept if isinstance(kept, str) else None
    for folder in (kept, os.path.join(path, "candidate")):
        if folder and os.path.isfile(os.path.join(folder, "manifest.json")):
            return str(folder)
    return path


def merge_nodes(run_dir: str, reference: str | None = None, report: bool = True, quiet: bool = False) -> int:
    """`diagnose merge`: the node parts of a multi-node run merged into one run over all ranks
    (traindx.derive.multinode.merge_parts), the clock table printed, then analysed and reported."""
    from traindx.derive.multinode import merge_parts
    from traindx.derive.run import load_run
    from traindx.profiler import nodes
    from traindx.report.outputs import analyze_and_write  # lazy: the analyzers (pandas)
    from traindx.report.terminal import print_summary

    unfinished = nodes.unfinished_nodes(run_dir) if os.path.isdir(run_dir) else []
    if unfinished:  # merging is still right for what is there; say what may be missing
        print(
            f"diagnose: warning: node{'s' if len(unfinished) > 1 else ''} "
            f"{', '.join(unfinished)} still running (or killed): merged as far as recorded",
            file=sys.stderr,
        )
    clock, _ = merge_parts(run_dir, reference=reference)
    print(nodes.format_clock(clock), file=sys.stderr if quiet else sys.stdout)
    if not report:
        return 0
    record = load_run(run_dir)
    judgement, report_path = analyze_and_write(record)
    if quiet:
        print(report_path)
    else:
        print_summary(record, judgement, report_path)
    return 0
