"""Run a training command unchanged, record why it is slow, and say what to change.

usage: diagnose [options] -- <command> [args...]
"""
import argparse
import os
import re
import sys
import time

from traindx.errors import UserError

# the job succeeded but traindx could not analyse or report it: a pipeline must notice
ANALYSIS_FAILED_EXIT = 3


def _one_line(text, limit=400):
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def prepare_parser(parser):
    parser.add_argument("--steps", type=int, default=0, metavar="N",
                        help="stop the job cleanly after N steps (iterations), after the last "
                             "step's own log line")
    parser.add_argument("--step-marker", default=None, metavar="MODULE:FUNCTION",
                        help="each return of this function of the job ends a step (instead of "
                             "optimizer steps); __main__:FUNCTION for the script itself")
    parser.add_argument("--out", default="runs", metavar="DIR",
                        help="folder the run folder is created in (default: ./runs)")
    parser.add_argument("--run-dir", default=None, metavar="DIR",
                        help="write the run into exactly this folder")
    parser.add_argument("--node", default=None, metavar="NAME",
                        help="this is one node of a multi-node run: write RUN/nodes/NAME/ "
                             "(found by itself under srun, torchrun --nnodes N, accelerate "
                             "launch --num_machines N and ray start --block; then `diagnose "
                             "merge RUN`)")
    parser.add_argument("--no-pyspy", action="store_true", help="do not sample with py-spy")
    parser.add_argument("--no-shim", action="store_true", help="do not load the in-process shim")
    parser.add_argument("--no-nvml", action="store_true", help="do not sample GPUs through NVML")
    parser.add_argument("--pyspy-rate", type=int, default=20, metavar="HZ",
                        help="samples per second of each py-spy recorder (default 20)")
    parser.add_argument("--dump-interval", type=float, default=2.0, metavar="S",
                        help="seconds between py-spy GIL snapshots (0: none; default 2)")
    parser.add_argument("--torch-profile", default=None, metavar="STEPS",
                        help="torch.profiler window stored as trace/<rank>.json.gz: N steps from "
                             "step 3, or A-B, or off (default: steps 3-4 of a CUDA job, skipped "
                             "when steps take over 5 s)")
    parser.add_argument("--log-regex", default=None, metavar="REGEX",
                        help="the job's own step line: a Python regex with named groups step, "
                             "loss, time_ms or step_time_s")
    parser.add_argument("--disk-budget", type=float, default=2048, metavar="MB",
                        help="long runs: evidence kept per training process stays under about "
                             "this many MB, however long the job runs (default 2048; "
                             "docs/long-runs.md)")
    parser.add_argument("--window", type=float, default=600, metavar="S",
                        help="long runs: py-spy records in windows of S seconds; the first and "
                             "the last --keep-windows stay whole, the others are folded into a "
                             "summary (0: one recording; default 600)")
    parser.add_argument("--keep-windows", type=int, default=3, metavar="K",
                        help="long runs: py-spy windows and file segments kept whole at the end "
                             "(default 3)")
    parser.add_argument("--fix", action="store_true",
                        help="apply the automatic prescriptions, re-run and compare")
    parser.add_argument("--wheels", default=None, metavar="DIR",
                        help="with --fix: install fixed releases from the wheels in DIR into an "
                             "overlay for the candidate (instead of the package index)")
    parser.add_argument("--quiet", action="store_true", help="no live status line")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training command, after --")


def _command(args, parser):
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UserError("no command given: diagnose [options] -- <command>")
    if args.steps < 0:
        raise UserError("--steps must be a positive number")
    marker = getattr(args, "step_marker", None)
    if marker is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", marker):
        raise UserError(f"--step-marker {marker}: give MODULE:FUNCTION, e.g. train:log_step")
    window = re.fullmatch(r"(\d+)(?:-(\d+))?|off|default", str(args.torch_profile or "default"))
    if not window or (window[2] and int(window[2]) < int(window[1])):
        raise UserError(f"--torch-profile {args.torch_profile}: give N (steps from step 3), "
                        "A-B (steps A to B) or off")
    if getattr(args, "disk_budget", 1) <= 0 or getattr(args, "window", 0) < 0 \
            or getattr(args, "keep_windows", 1) < 1:
        raise UserError("--disk-budget must be > 0 MB, --window >= 0 s and --keep-windows >= 1")
    if getattr(args, "log_regex", None):
        from traindx.profiler.logparse import compile_custom
        try:
            compile_custom(args.log_regex)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    return command


def options_from(args, extra_env=None):
    from traindx.profiler.launcher import Options

    return Options(steps=args.steps, pyspy=not args.no_pyspy, shim=not args.no_shim,
                   nvml=not args.no_nvml, pyspy_rate_hz=args.pyspy_rate,
                   dump_interval_s=args.dump_interval, extra_env=extra_env,
                   torch_profile=getattr(args, "torch_profile", None),
                   step_marker=getattr(args, "step_marker", None),
                   log_regex=getattr(args, "log_regex", None),
                   disk_budget_mb=getattr(args, "disk_budget", 2048),
                   window_s=getattr(args, "window", 600),
                   keep_windows=getattr(args, "keep_windows", 3))


def record_job(command, run_dir, options, quiet=False):
    """Run the job under the collectors; returns its raw return code."""
    from traindx.profiler.launcher import CommandNotFound, Job
    from traindx.report.terminal import LiveStatus

    status = LiveStatus(run_dir, enabled=not quiet and sys.stderr.isatty())
    job = Job(command, run_dir, options, on_line=status.print_line)
    with status:
        try:
            return job.run()
        except CommandNotFound as exc:
            raise UserError(str(exc)) from None


def run(args, parser):
    from traindx.profiler.launcher import exit_status, new_run_dir
    from traindx.record import load_run
    from traindx.outputs import analyze_and_write
    from traindx.report.terminal import print_summary

    command = _command(args, parser)
    if args.fix:
        from traindx import nodes

        if nodes.node_identity(command, os.environ, getattr(args, "node", None)):
            raise UserError("--fix runs the job twice on one machine; it does not drive a "
                            "multi-node run (diagnose each node, then diagnose merge)")
        from traindx.fixloop import run_fix_loop

        return run_fix_loop(command, args)
    from traindx.profiler.launcher import resolve_command, CommandNotFound
    try:
        resolve_command(command)
    except CommandNotFound as exc:
        raise UserError(str(exc)) from None
    node = _node_part(command, args)
    run_dir = node["dir"] if node else (args.run_dir or new_run_dir(args.out))
    os.makedirs(run_dir, exist_ok=True)
    returncode = record_job(command, run_dir, options_from(args), quiet=args.quiet)
    status = exit_status(returncode)
    if node:
        _record_node(run_dir, node)
        _write_node_tables(run_dir)
    try:
        record = load_run(run_dir)
        findings, report_path = analyze_and_write(record)
        print_summary(record, findings, report_path)
        if node:
            print(f"diagnose: node {node['name']} of the multi-node run {node['run_dir']}; once "
                  f"every node has finished: diagnose merge {node['run_dir']}", file=sys.stderr)
    except UserError as exc:
        print(f"diagnose: analysis failed: {_one_line(exc)} (the raw evidence is kept in "
              f"{run_dir})", file=sys.stderr)
        return status or ANALYSIS_FAILED_EXIT
    except Exception as exc:  # traindx's own bug: one line, and never hide the job's exit code
        print(f"diagnose: internal error during analysis: {type(exc).__name__}: {_one_line(exc)} "
              f"(the raw evidence is kept in {run_dir})", file=sys.stderr)
        return status or ANALYSIS_FAILED_EXIT
    return status


def _node_part(command, args):
    """{name, source, run_dir, dir} when this diagnose is one node of a multi-node run (its own
    folder RUN/nodes/<name>/ claimed), else None. See traindx.nodes."""
    from traindx import nodes

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
    from traindx.record import write_tables

    try:
        problem = write_tables(run_dir)
    except UserError as exc:
        problem = _one_line(exc)
    except Exception as exc:  # never fail the node's run over an optional copy of its events
        problem = f"{type(exc).__name__}: {_one_line(exc)}"
    if problem:
        print(f"diagnose: warning: the node's event tables were not written ({problem}); the "
              "merged run's analysis will parse this node's raw events", file=sys.stderr)


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
