"""`diagnose -- <command>`: the job run under the collectors with the live judgement, then the
record analysed and reported; for one node of a multi-node run, its own folder and event tables;
for `--fix`, the fix runner (traindx.fixing.run.loop) wired to the terminal.

The collectors, the analyzers and pandas are imported where they are used: `diagnose --help`
imports this module (through traindx.cli.commands.run) and needs none of them."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from traindx.common.argtypes import one_line
from traindx.common.atomic import write_json
from traindx.common.errors import UserError

if TYPE_CHECKING:
    from traindx.analyzers.live.live import LiveOptions
    from traindx.common.console import Console
    from traindx.fixing.run.model import FixEvent
    from traindx.profiler.launcher import Options

# the job succeeded but traindx could not analyse or report it: a pipeline must notice
ANALYSIS_FAILED_EXIT = 3

PrintComparison = Callable[[dict[str, Any], "Console"], object]


@dataclass(frozen=True)
class JobRequest:
    """What `diagnose -- <command>` was asked to do, beyond the command."""

    record: Options  # the collectors' options
    live: LiveOptions | Literal[False]  # the live judgement (False: none)
    quiet: bool = False  # no live status line
    run_dir: str | None = None  # exactly this run folder
    out: str = "runs"  # else a new run folder under this one
    node: str | None = None  # this node's name in a multi-node run (--node)


@dataclass(frozen=True)
class FixRequest:
    """The `--fix` flags."""

    tries: int = 3
    wheels: str | None = None
    until_diagnosed: bool = False
    warm_up_after_fix: bool = True
    keep_outputs: bool = False


def runnable(command: list[str]) -> list[str]:
    """The command must be something the job can start as: not a folder, not a file without
    permission to run it (the launcher would fail on it after creating the run folder)."""
    from traindx.profiler.launcher import CommandNotFound, resolve_command

    exe = command[0]
    if os.sep in exe and os.path.isdir(exe):
        raise UserError(f"{exe} is a folder, not a command")
    try:
        resolve_command(command)
    except CommandNotFound as exc:
        raise UserError(str(exc)) from None
    return command


def record_job(
    command: list[str],
    run_dir: str,
    options: Options,
    quiet: bool = False,
    live: LiveOptions | Literal[False] | None = None,
) -> int | None:
    """Run the job under the collectors; returns its raw return code (None: it never started). While it runs, the
    analyzers judge the growing record (traindx.analyzers.live.live) and the stable findings are printed;
    live=None: the default live options, False: no live judgement. A run folder in use, or one
    that holds a run already, or cannot be written is refused (UserError) before the job
    starts; what could not be written while it ran is one line each on stderr."""
    from traindx.analyzers.live.live import LiveJudge, LiveOptions, request_capture
    from traindx.profiler.launcher import CommandNotFound, Job, RunDirRefused
    from traindx.report.live_view import LiveView
    from traindx.report.outputs import write_live_report

    live_options = LiveOptions() if live is None else live
    view = LiveView(live=False if quiet else None)
    job = Job(command, run_dir, options, on_output=view.write_output)

    def deep_capture(kind: str, why: str) -> None:  # py-spy snapshots now, a profiler window next step
        job.burst(kind)
        request_capture(run_dir, kind, why)

    judge = None
    if live_options is not False:
        judge = LiveJudge(
            run_dir,
            live_options,
            on_finding=(lambda f, s: None) if quiet else view.on_finding,
            on_state=(lambda s: None) if quiet else view.on_state,
            # LiveJudge hands its own RunRecord to on_analysis
            on_analysis=cast("Callable[[object, list[Any]], None]", write_live_report),
            on_anomaly=deep_capture,
        )
    try:
        with view:
            if judge is not None:
                judge.start()
            try:
                return job.run()
            finally:
                if judge is not None:
                    judge.stop()
    except (CommandNotFound, RunDirRefused) as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:  # the OS refused to start it (not a program: ENOEXEC, EACCES)
        if job.proc is not None:
            raise
        raise UserError(f"cannot start {command[0]}: {exc.strerror or exc}") from None
    finally:
        if job.folder_gone:
            print(f"diagnose: warning: {job.folder_gone}", file=sys.stderr)
        for line in job.not_written:
            print(f"diagnose: not written: {one_line(line, 400)}", file=sys.stderr)


def say_where(run_dir: str) -> None:
    """diagnose's first line: where the evidence goes (the default ./runs sits in the job's
    working folder, where a job that lists its folder sees it)."""
    where = os.path.abspath(run_dir)
    inside = os.path.commonpath([where, os.getcwd()]) == os.getcwd()
    print(
        f"diagnose: evidence goes to {where}"
        + (" (inside the job's working folder; --out or --run-dir puts it elsewhere)" if inside else ""),
        file=sys.stderr,
        flush=True,
    )


# the signal that killed the job this process recorded (a plain run, not --fix's arms)
JOB_SIGNAL: list[int] = []


def diagnose(command: list[str], request: JobRequest) -> int:
    """Record the job, analyse and report the record; the exit code: the job's, else
    ANALYSIS_FAILED_EXIT when the job succeeded and its analysis or report did not."""
    from traindx.profiler.launcher import exit_status, new_run_dir

    node = node_part(command, request)
    if request.run_dir and not node:
        _refuse_a_foreign_folder(request.run_dir)
    try:
        run_dir = node["dir"] if node else (request.run_dir or new_run_dir(request.out))
    except OSError as exc:
        raise UserError(f"cannot create a run folder under {request.out}: {exc.strerror or exc}") from None
    # to a person at a terminal only: into a pipe or a file the job's bytes come first, ours
    # after (a reader that leaves at the first byte must meet the job's), and the last line
    # names the run anyway
    if not request.quiet and sys.stderr.isatty():
        say_where(run_dir)
    try:
        returncode = record_job(command, run_dir, request.record, quiet=request.quiet, live=request.live)
    except UserError:
        if not node and not request.run_dir:  # the folder made for a job that never started
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    status: int = exit_status(returncode)
    if returncode is not None and returncode < 0:
        JOB_SIGNAL[:] = [-returncode]  # traindx.cli.main ends by it after the report
    if not os.path.isfile(os.path.join(run_dir, "manifest.json")):  # deleted while the job ran
        return status  # (record_job said so in one line)
    if node:
        record_node(run_dir, node)
        write_node_tables(run_dir)
    try:
        if not _analyse_and_report(run_dir, node):
            return status or ANALYSIS_FAILED_EXIT
    except Exception as exc:  # a UserError, or traindx's own bug: one line, never hiding the job's exit code
        what = "analysis failed" if isinstance(exc, UserError) else "internal error during analysis"
        bug = "" if isinstance(exc, UserError) else f"{type(exc).__name__}: "
        print(
            f"diagnose: {what}: {bug}{one_line(exc, 400)} (the raw evidence is kept in {run_dir})",
            file=sys.stderr,
        )
        return status or ANALYSIS_FAILED_EXIT
    return status


def _refuse_a_foreign_folder(run_dir: str) -> None:
    from traindx.profiler.manifest import RunDirRefused, refuse_a_foreign_folder

    try:
        refuse_a_foreign_folder(run_dir)
    except RunDirRefused as exc:
        raise UserError(str(exc)) from None


def _analyse_and_report(run_dir: str, node: dict[str, str] | None) -> bool:
    """findings.json, ledger.csv and report.html written, the summary printed; False when an
    output could not be written (one line each on stderr)."""
    from traindx.derive.run import load_run
    from traindx.report.outputs import write_outputs
    from traindx.report.terminal import print_summary

    record = load_run(run_dir)
    judgement, report_path, problems = write_outputs(record)
    print_summary(record, judgement, report_path)
    for line in problems:
        print(f"diagnose: not written: {line}", file=sys.stderr)
    if problems:
        return False
    if node:
        print(
            f"diagnose: node {node['name']} of the multi-node run {node['run_dir']}; once "
            f"every node has finished: diagnose merge {node['run_dir']}",
            file=sys.stderr,
        )
    return True


def diagnose_with_fix(
    command: list[str], request: JobRequest, fix_request: FixRequest, print_comparison: PrintComparison
) -> int | None:
    """`diagnose --fix`: the engine (traindx.fixing.run.loop.fix) wired to the terminal; the A/B
    comparison printed by `print_comparison` (`diagnose compare`'s own)."""
    from traindx.fixing.run.loop import fix
    from traindx.fixing.run.model import FixOptions
    from traindx.profiler import nodes

    if nodes.node_identity(command, os.environ, request.node):
        raise UserError(
            "--fix runs the job twice on one machine; it does not drive a "
            "multi-node run (diagnose each node, then diagnose merge)"
        )
    if fix_request.tries is None or fix_request.tries < 1:
        raise UserError("--fix-tries must be at least 1")
    live = request.live

    def run_arm(cmd: list[str], run_dir: str, opts: Options, until_diagnosed: bool = False) -> int | None:
        # the baseline arm of --fix --until-diagnosed stops so; a candidate runs N steps
        arm_live = live if live is False else dataclasses.replace(live, until_diagnosed=until_diagnosed)
        return record_job(cmd, run_dir, opts, quiet=request.quiet, live=arm_live)

    options = FixOptions(
        record=request.record,
        run_dir=request.run_dir,
        out=request.out,
        wheels=fix_request.wheels,
        tries=fix_request.tries,
        reporter=_FixReporter(print_comparison),
        run_job=run_arm,
        until_diagnosed=fix_request.until_diagnosed,
        warm_up_after_fix=fix_request.warm_up_after_fix,
        keep_outputs=fix_request.keep_outputs,
    )
    return fix(command, options).exit_code


class _FixReporter:
    """The --fix runner's events on stderr: stage rules, the arms' summaries, the comparison."""

    def __init__(self, print_comparison: PrintComparison) -> None:
        from traindx.common.console import Console

        self.console = Console(file=sys.stderr)
        self.print_comparison = print_comparison

    def __call__(self, event: FixEvent) -> None:
        from rich.markup import escape

        from traindx.report.terminal import print_summary

        console = self.console
        if event.kind == "stage":
            console.rule(escape(f"traindx --fix: {event.text}"))  # "[finding.id]" is text
        elif event.kind == "summary":
            data: dict[str, Any] = event.data
            print_summary(data["record"], data["judgement"], data["report"], console=console)
        elif event.kind == "comparison":
            self.print_comparison(event.data["comparison"], console)
        elif event.kind == "warning":
            console.print(f"warning: {event.text}", style="yellow", markup=False)
        else:
            console.print(event.text, markup=False, highlight=False)


def node_part(command: list[str], request: JobRequest) -> dict[str, str] | None:
    """{name, source, run_dir, dir} when this diagnose is one node of a multi-node run (its own
    folder RUN/nodes/<name>/ claimed), else None. See traindx.profiler.nodes."""
    from traindx.profiler import nodes

    identity = nodes.node_identity(command, os.environ, request.node)
    if identity is None:
        return None
    shared = os.path.abspath(nodes.shared_run_dir(command, os.environ, request.run_dir))
    name, source = identity
    folder = nodes.claim_node_dir(shared, name)
    return {"name": os.path.basename(folder), "source": source, "run_dir": shared, "dir": folder}


def write_node_tables(run_dir: str) -> None:
    """A node of a multi-node run turns its own ranks' events into the Parquet tables
    (tables/events/) as its job ends, whatever their size: a few ranks parse in about a second
    here, and the central analysis of the merged run then reads every node's tables instead of
    parsing all ranks' JSONL on one machine. The raw files stay; failing is only a warning
    (the central analysis parses that node's raw files instead)."""
    from traindx.derive.run import write_tables

    try:
        problem = write_tables(run_dir)
    except UserError as exc:
        problem = one_line(exc, 400)
    except Exception as exc:  # never fail the node's run over an optional copy of its events
        problem = f"{type(exc).__name__}: {one_line(exc, 400)}"
    if problem:
        print(
            f"diagnose: warning: the node's event tables were not written ({problem}); the "
            "merged run's analysis will parse this node's raw events",
            file=sys.stderr,
        )


def record_node(run_dir: str, node: dict[str, str]) -> None:
    """The node's own manifest says which node of which run it is (only this process writes it)."""
    path = os.path.join(run_dir, "manifest.json")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        manifest["node"] = {k: node[k] for k in ("name", "source", "run_dir")}
        write_json(path, manifest, indent=2, default=str)
    except (OSError, ValueError):
        pass  # the analysis below says what is wrong with the manifest
