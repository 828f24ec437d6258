"""Run a training command unchanged, record why it is slow, and say what to change.

usage: diagnose [options] -- <command> [args...]
"""

import argparse
import dataclasses
import os
import sys

from traindx.cli import argtypes
from traindx.common.errors import UserError

# the job succeeded but traindx could not analyse or report it: a pipeline must notice
ANALYSIS_FAILED_EXIT = 3


def _one_line(text, limit=400):
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def prepare_parser(parser):
    parser.add_argument(
        "--steps",
        type=argtypes.non_negative_int,
        default=0,
        metavar="N",
        help="stop the job cleanly after N steps (iterations), after the last step's own log line",
    )
    parser.add_argument(
        "--step-marker",
        type=argtypes.step_marker,
        default=None,
        metavar="MODULE:FUNCTION",
        help="each return of this function of the job ends a step (instead of "
        "optimizer steps); __main__:FUNCTION for the script itself",
    )
    parser.add_argument(
        "--out",
        type=argtypes.output_folder,
        default=argtypes.DEFAULT_RUNS,
        metavar="DIR",
        help="folder the run folder is created in (default: ./runs)",
    )
    parser.add_argument(
        "--run-dir",
        type=argtypes.output_folder,
        default=None,
        metavar="DIR",
        help="write the run into exactly this folder",
    )
    parser.add_argument(
        "--node",
        type=argtypes.name,
        default=None,
        metavar="NAME",
        help="this is one node of a multi-node run: write RUN/nodes/NAME/ "
        "(found by itself under srun, torchrun --nnodes N, accelerate "
        "launch --num_machines N and ray start --block; then `diagnose "
        "merge RUN`)",
    )
    parser.add_argument("--no-pyspy", action="store_true", help="do not sample with py-spy")
    parser.add_argument("--no-shim", action="store_true", help="do not load the in-process shim")
    parser.add_argument("--no-nvml", action="store_true", help="do not sample GPUs through NVML")
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
    parser.add_argument(
        "--torch-profile",
        type=argtypes.torch_profile,
        default=None,
        metavar="STEPS",
        help="torch.profiler window stored as trace/<rank>.json.gz: N steps from "
        "step 3, or A-B, or off, or anomaly (default: steps 3-4 of a CUDA "
        "job, skipped when steps take over 5 s; and one step on each kind "
        "of anomaly, except with off)",
    )
    parser.add_argument(
        "--log-regex",
        type=argtypes.log_regex,
        default=None,
        metavar="REGEX",
        help="the job's own step line: a Python regex with named groups step, loss, time_ms or step_time_s",
    )
    parser.add_argument(
        "--disk-budget",
        type=argtypes.positive,
        default=2048,
        metavar="MB",
        help="long runs: evidence kept per training process stays under about "
        "this many MB, however long the job runs (default 2048; "
        "docs/long-runs.md)",
    )
    parser.add_argument(
        "--window",
        type=argtypes.non_negative,
        default=600,
        metavar="S",
        help="long runs: py-spy records in windows of S seconds; the first and "
        "the last --keep-windows stay whole, the others are folded into a "
        "summary (0: one recording; default 600)",
    )
    parser.add_argument(
        "--keep-windows",
        type=argtypes.positive_int,
        default=3,
        metavar="K",
        help="long runs: py-spy windows and file segments kept whole at the end (default 3)",
    )
    parser.add_argument(
        "--fix",
        action="store_true",
        help="measure the prescribed changes: one candidate arm per change (a flag, "
        "an env var, a code edit on a scratch copy, a runtime patch, an "
        "overlay, a kernel-cache warm-up), best predicted saving first, each "
        "compared with the baseline; the kept one's patch is fix.patch",
    )
    parser.add_argument(
        "--fix-tries",
        type=argtypes.positive_int,
        default=3,
        metavar="K",
        help="with --fix: measure at most K candidate changes, best predicted "
        "saving first, stopping at the first significant gain (default 3)",
    )
    parser.add_argument(
        "--no-warm-up",
        dest="warm_up_after_fix",
        action="store_false",
        help="with --fix: no extra arm that warms the kernels the kept change "
        "still compiles cold (kernel-cache warm --from-run <kept arm>)",
    )
    parser.add_argument(
        "--wheels",
        type=argtypes.existing_folder,
        default=None,
        metavar="DIR",
        help="with --fix: install fixed releases from the wheels in DIR into an "
        "overlay for the candidate (instead of the package index)",
    )
    parser.add_argument("--quiet", action="store_true", help="no live status line")
    parser.add_argument(
        "--until-diagnosed",
        action="store_true",
        help="end the job cleanly (as --steps does) once the top finding is "
        "stable and nothing above it is pending, then print the verdict; "
        "with --fix: the baseline arm stops so and every candidate arm "
        "runs as many steps",
    )
    parser.add_argument(
        "--always-on",
        action="store_true",
        help="for long runs, at the lowest cost: py-spy only takes a snapshot "
        "every --dump-interval s (no recorder), no default torch.profiler "
        "window, the live judgement on; findings still come while the job "
        "runs",
    )
    parser.add_argument(
        "--no-live", action="store_true", help="judge only after the job ends (no analysis while it runs)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training command, after --")


def _command(args, parser):
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UserError("no command given: diagnose [options] -- <command>")
    return _runnable(command)


def _runnable(command):
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


def options_from(args, extra_env=None):
    from traindx.profiler.launcher import Options

    return Options(
        steps=args.steps,
        pyspy=not args.no_pyspy,
        shim=not args.no_shim,
        nvml=not args.no_nvml,
        pyspy_rate_hz=args.pyspy_rate,
        dump_interval_s=args.dump_interval,
        extra_env=extra_env,
        torch_profile=getattr(args, "torch_profile", None)
        or ("anomaly" if getattr(args, "always_on", False) else None),
        step_marker=getattr(args, "step_marker", None),
        log_regex=getattr(args, "log_regex", None),
        disk_budget_mb=getattr(args, "disk_budget", 2048),
        window_s=getattr(args, "window", 600),
        keep_windows=getattr(args, "keep_windows", 3),
        pyspy_record=not getattr(args, "always_on", False),
    )


def live_options_from(args):
    """The live judgement the run's flags ask for (False: none)."""
    from traindx.analyzers.live import LiveOptions

    if getattr(args, "no_live", False):
        if getattr(args, "until_diagnosed", False) or getattr(args, "always_on", False):
            raise UserError("--until-diagnosed and --always-on need the live judgement: drop --no-live")
        return False
    return LiveOptions(until_diagnosed=getattr(args, "until_diagnosed", False))


def record_job(command, run_dir, options, quiet=False, live=None):
    """Run the job under the collectors; returns its raw return code. While it runs, the
    analyzers judge the growing record (traindx.analyzers.live) and the stable findings are printed;
    live=None: the default live options, False: no live judgement. A run folder in use, or one
    that holds a run already, or cannot be written is refused (UserError) before the job
    starts; what could not be written while it ran is one line each on stderr."""
    from traindx.analyzers.live import LiveJudge, LiveOptions, request_capture
    from traindx.cli.outputs import write_live_report
    from traindx.profiler.launcher import CommandNotFound, Job, RunDirRefused
    from traindx.report.live_view import LiveView

    live_options = LiveOptions() if live is None else live
    view = LiveView(live=False if quiet else None)
    job = Job(command, run_dir, options, on_line=view.print_line)

    def deep_capture(kind, why):  # py-spy snapshots now, a profiler window on the next step
        job.burst(kind)
        request_capture(run_dir, kind, why)

    judge = None
    if live_options is not False:
        judge = LiveJudge(
            run_dir,
            live_options,
            on_finding=(lambda f, s: None) if quiet else view.on_finding,
            on_state=(lambda s: None) if quiet else view.on_state,
            on_analysis=write_live_report,
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
        for line in job.not_written:
            print(f"diagnose: not written: {_one_line(line)}", file=sys.stderr)


def run(args, parser):
    from traindx.cli.outputs import write_outputs
    from traindx.derive.run import load_run
    from traindx.profiler.launcher import exit_status, new_run_dir
    from traindx.report.terminal import print_summary

    command = _command(args, parser)
    if args.fix:
        from traindx.profiler import nodes

        if nodes.node_identity(command, os.environ, getattr(args, "node", None)):
            raise UserError(
                "--fix runs the job twice on one machine; it does not drive a "
                "multi-node run (diagnose each node, then diagnose merge)"
            )
        return run_fix(command, args)
    node = _node_part(command, args)
    try:
        run_dir = node["dir"] if node else (args.run_dir or new_run_dir(args.out))
    except OSError as exc:
        raise UserError(f"cannot create a run folder under {args.out}: {exc.strerror or exc}") from None
    try:
        returncode = record_job(
            command, run_dir, options_from(args), quiet=args.quiet, live=live_options_from(args)
        )
    except UserError:
        if not node and not args.run_dir:  # the folder made for a job that never started
            import shutil

            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    status = exit_status(returncode)
    if node:
        _record_node(run_dir, node)
        _write_node_tables(run_dir)
    try:
        record = load_run(run_dir)
        findings, report_path, problems = write_outputs(record)
        print_summary(record, findings, report_path)
        for line in problems:
            print(f"diagnose: not written: {line}", file=sys.stderr)
        if problems:
            return status or ANALYSIS_FAILED_EXIT
        if node:
            print(
                f"diagnose: node {node['name']} of the multi-node run {node['run_dir']}; once "
                f"every node has finished: diagnose merge {node['run_dir']}",
                file=sys.stderr,
            )
    except UserError as exc:
        print(
            f"diagnose: analysis failed: {_one_line(exc)} (the raw evidence is kept in {run_dir})",
            file=sys.stderr,
        )
        return status or ANALYSIS_FAILED_EXIT
    except Exception as exc:  # traindx's own bug: one line, and never hide the job's exit code
        print(
            f"diagnose: internal error during analysis: {type(exc).__name__}: {_one_line(exc)} "
            f"(the raw evidence is kept in {run_dir})",
            file=sys.stderr,
        )
        return status or ANALYSIS_FAILED_EXIT
    return status


def run_fix(command, args):
    """`diagnose --fix`: the engine (traindx.cli.fixloop.fix) wired to the terminal."""
    from rich.console import Console
    from rich.markup import escape

    from traindx.cli.commands.compare import print_comparison
    from traindx.cli.fixloop import FixOptions, fix
    from traindx.report.terminal import print_summary

    console = Console(file=sys.stderr)

    def report(event):
        if event.kind == "stage":
            console.rule(escape(f"traindx --fix: {event.text}"))  # "[finding.id]" is text
        elif event.kind == "summary":
            print_summary(event.data["record"], event.data["findings"], event.data["report"], console=console)
        elif event.kind == "comparison":
            print_comparison(event.data["comparison"], console)
        elif event.kind == "warning":
            console.print(f"warning: {event.text}", style="yellow", markup=False)
        else:
            console.print(event.text, markup=False, highlight=False)

    tries = getattr(args, "fix_tries", 3)
    if tries is None or tries < 1:
        raise UserError("--fix-tries must be at least 1")
    live = live_options_from(args)

    def run_arm(cmd, run_dir, opts, until_diagnosed=False):
        arm_live = live
        if until_diagnosed and live is not False:  # the baseline arm of --fix --until-diagnosed
            arm_live = dataclasses.replace(live, until_diagnosed=True)
        elif live is not False:
            arm_live = dataclasses.replace(live, until_diagnosed=False)  # a candidate: N steps
        return record_job(cmd, run_dir, opts, quiet=args.quiet, live=arm_live)

    options = FixOptions(
        record=options_from(args),
        run_dir=args.run_dir,
        out=args.out,
        wheels=getattr(args, "wheels", None),
        tries=tries,
        reporter=report,
        run_job=run_arm,
        until_diagnosed=getattr(args, "until_diagnosed", False),
        warm_up_after_fix=getattr(args, "warm_up_after_fix", True),
    )
    return fix(command, options).exit_code


def _node_part(command, args):
    """{name, source, run_dir, dir} when this diagnose is one node of a multi-node run (its own
    folder RUN/nodes/<name>/ claimed), else None. See traindx.profiler.nodes."""
    from traindx.profiler import nodes

    identity = nodes.node_identity(command, os.environ, getattr(args, "node", None))
    if identity is None:
        return None
    shared = os.path.abspath(nodes.shared_run_dir(command, os.environ, args.run_dir))
    name, source = identity
    folder = nodes.claim_node_dir(shared, name)
    return {"name": os.path.basename(folder), "source": source, "run_dir": shared, "dir": folder}


def _write_node_tables(run_dir):
    """A node of a multi-node run turns its own ranks' events into the Parquet tables
    (tables/events/) as its job ends, whatever their size: a few ranks parse in about a second
    here, and the central analysis of the merged run then reads every node's tables instead of
    parsing all ranks' JSONL on one machine. The raw files stay; failing is only a warning
    (the central analysis parses that node's raw files instead)."""
    from traindx.derive.run import write_tables

    try:
        problem = write_tables(run_dir)
    except UserError as exc:
        problem = _one_line(exc)
    except Exception as exc:  # never fail the node's run over an optional copy of its events
        problem = f"{type(exc).__name__}: {_one_line(exc)}"
    if problem:
        print(
            f"diagnose: warning: the node's event tables were not written ({problem}); the "
            "merged run's analysis will parse this node's raw events",
            file=sys.stderr,
        )


def _record_node(run_dir, node):
    """The node's own manifest says which node of which run it is (only this process writes it)."""
    import json

    from traindx.profiler.launcher import write_json_atomic

    path = os.path.join(run_dir, "manifest.json")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        manifest["node"] = {k: node[k] for k in ("name", "source", "run_dir")}
        write_json_atomic(path, manifest)
    except (OSError, ValueError):
        pass  # the analysis below says what is wrong with the manifest
