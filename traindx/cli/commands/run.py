"""Run a training command unchanged, record why it is slow, and say what to change.

usage: diagnose [options] -- <command> [args...]
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Literal

from traindx.cli import argtypes
from traindx.cli.commands import options
from traindx.cli.commands.compare import print_comparison
from traindx.cli.recording import (  # noqa: F401  (record_job, _write_node_tables: re-exported)
    ANALYSIS_FAILED_EXIT,
    FixRequest,
    JobRequest,
    diagnose,
    diagnose_with_fix,
    record_job,
    runnable,
)
from traindx.cli.recording import write_node_tables as _write_node_tables  # noqa: F401
from traindx.common.errors import UserError

if TYPE_CHECKING:
    from traindx.analyzers.live.live import LiveOptions
    from traindx.profiler.launcher import Options


def prepare_parser(parser: argparse.ArgumentParser) -> None:
    _add_run_arguments(parser)
    _add_evidence_arguments(parser)
    _add_long_run_arguments(parser)
    _add_fix_arguments(parser)
    _add_live_arguments(parser)


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
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
        metavar="MODULE:FUNCTION",
        help="each return of this function of the job ends a step (instead of "
        "optimizer steps); __main__:FUNCTION for the script itself",
    )
    options.add_out(parser)
    parser.add_argument(
        "--run-dir",
        type=argtypes.output_folder,
        metavar="DIR",
        help="write the run into exactly this folder",
    )
    parser.add_argument(
        "--node",
        type=argtypes.name,
        metavar="NAME",
        help="this is one node of a multi-node run: write RUN/nodes/NAME/ "
        "(found by itself under srun, torchrun --nnodes N, accelerate "
        "launch --num_machines N and ray start --block; then `diagnose "
        "merge RUN`)",
    )
    parser.add_argument("--no-pyspy", action="store_true", help="do not sample with py-spy")
    parser.add_argument("--no-shim", action="store_true", help="do not load the in-process shim")
    parser.add_argument("--no-nvml", action="store_true", help="do not sample GPUs through NVML")


def _add_evidence_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_sampling(parser)
    parser.add_argument(
        "--torch-profile",
        type=argtypes.torch_profile,
        metavar="STEPS",
        help="torch.profiler window stored as trace/<rank>.json.gz: N steps from "
        "step 3, or A-B, or off, or anomaly (default: steps 3-4 of a CUDA "
        "job, skipped when steps take over 5 s; and one step on each kind "
        "of anomaly, except with off)",
    )
    parser.add_argument(
        "--log-regex",
        type=argtypes.log_regex,
        metavar="REGEX",
        help="the job's own step line: a Python regex with named groups step, loss, time_ms or step_time_s",
    )


def _add_long_run_arguments(parser: argparse.ArgumentParser) -> None:
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


def _add_fix_arguments(parser: argparse.ArgumentParser) -> None:
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
        dest="tries",
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
        "--keep-outputs",
        action="store_true",
        help="with --fix: every arm's file writes are confined to its own folder (your "
        "files are never touched); this copies the kept arm's writes (checkpoints, "
        "results) to where the job wrote them once --fix ends",
    )
    parser.add_argument(
        "--wheels",
        type=argtypes.existing_folder,
        metavar="DIR",
        help="with --fix: install fixed releases from the wheels in DIR into an "
        "overlay for the candidate (instead of the package index)",
    )


def _add_live_arguments(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument(
        "--cost-budget",
        type=float,
        metavar="PCT",
        help="the share of step time traindx may cost the job before it sheds work (lower "
        "sampling rates, fewer reads; it says so); default 1, 0.5 with --always-on, 0: never shed",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training command, after --")


def _command(args: argparse.Namespace) -> list[str]:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UserError("no command given: diagnose [options] -- <command>")
    return runnable(command)


def options_from(args: argparse.Namespace) -> Options:
    from traindx.profiler.launcher import Options  # lazy: the collectors, not for `diagnose --help`

    return Options(
        steps=args.steps,
        pyspy=not args.no_pyspy,
        shim=not args.no_shim,
        nvml=not args.no_nvml,
        pyspy_rate_hz=args.pyspy_rate_hz,
        dump_interval_s=args.dump_interval_s,
        torch_profile=args.torch_profile or ("anomaly" if args.always_on else None),
        step_marker=args.step_marker,
        log_regex=args.log_regex,
        disk_budget_mb=args.disk_budget,
        window_s=args.window,
        keep_windows=args.keep_windows,
        pyspy_record=not args.always_on,
        cost_budget_pct=_cost_budget(args),
    )


def _cost_budget(args: argparse.Namespace) -> float | None:
    budget: float | None = args.cost_budget
    if budget is not None and budget < 0:
        raise UserError(f"--cost-budget {budget:g}: a share of step time is 0 or more (0: never shed)")
    if budget is None and args.always_on:
        return 0.5  # always-on runs for days: half the default's cost
    return budget


def live_options_from(args: argparse.Namespace) -> LiveOptions | Literal[False]:
    """The live judgement the run's flags ask for (False: none)."""
    from traindx.analyzers.live.live import LiveOptions  # lazy: pandas, not for `diagnose --help`

    if args.no_live:
        if args.until_diagnosed or args.always_on:
            raise UserError("--until-diagnosed and --always-on need the live judgement: drop --no-live")
        return False
    return LiveOptions(until_diagnosed=args.until_diagnosed)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int | None:
    command = _command(args)
    request = options.from_args(JobRequest, args, record=options_from(args), live=live_options_from(args))
    if args.fix:
        fix_request = options.from_args(FixRequest, args)
        return diagnose_with_fix(command, request, fix_request, print_comparison)
    return diagnose(command, request)
