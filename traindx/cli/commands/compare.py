"""Compare two recorded runs: what changed, step time over the steady window, the speedup with a
bootstrap 95 % interval, tokens/s, step-time CV, loss parity and a verdict.

usage: diagnose compare RUN_A RUN_B          (RUN_A is the baseline)
       diagnose compare FIX_RUN              (a `diagnose --fix` folder: its baseline/candidate)

rich, pandas and the recipes are imported where they are used: `diagnose compare --help` needs none.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from traindx.cli import argtypes
from traindx.cli.commands import options
from traindx.common.errors import UserError

if TYPE_CHECKING:  # annotations only (rich is imported when a comparison is printed)
    from rich.table import Table

    from traindx.common.console import Console


def prepare_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_a", metavar="RUN_A", help="baseline run folder (or a --fix folder)")
    parser.add_argument("run_b", metavar="RUN_B", nargs="?", help="candidate run folder")
    options.add_measured_steps(parser, "to compare")
    parser.add_argument(
        "--json", type=argtypes.output_file, metavar="PATH", help="also write the comparison as JSON to PATH"
    )


def resolve_arms(run_a: str, run_b: str | None) -> tuple[str, str]:
    """(baseline path, candidate path); a single --fix folder stands for its two arms."""
    if run_b is None:
        base, cand = os.path.join(run_a, "baseline"), os.path.join(run_a, "candidate")
        try:  # the arm --fix kept (fix.json), when it tried several
            with open(os.path.join(run_a, "fix.json"), encoding="utf-8") as f:
                cand = json.load(f).get("best") or cand
        except (OSError, ValueError, AttributeError):
            pass
        if not (os.path.isdir(base) and os.path.isdir(cand)):
            raise UserError(
                f"{run_a} is not a `diagnose --fix` folder (no baseline/ and "
                "candidate/): give two run folders, RUN_A RUN_B"
            )
        return base, cand
    return run_a, run_b


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from traindx.common.console import Console
    from traindx.derive.run import load_run
    from traindx.derive.stats import parse_window
    from traindx.recipes.ab import compare_runs
    from traindx.report.outputs import write_json_file

    window = parse_window(args.window) if args.window else None  # valid: argtypes.step_window
    path_a, path_b = resolve_arms(args.run_a, args.run_b)
    if os.path.realpath(path_a) == os.path.realpath(path_b):
        raise UserError(
            f"{args.run_a} and {args.run_b} are the same run: compare a baseline "
            "with another run (or give one `diagnose --fix` folder)"
        )
    baseline, candidate = load_run(path_a), load_run(path_b)
    if _same_recording(baseline.manifest, candidate.manifest):
        raise UserError(
            f"{path_b} is a copy of {path_a} (the same recording: same start time "
            "and command): compare a baseline with another run"
        )
    try:
        comparison = compare_runs(baseline, candidate, window=window, tokens_per_step=args.tokens_per_step)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    print_comparison(comparison, Console(file=sys.stdout))
    if args.json:
        write_json_file(args.json, comparison)
    return 0


def _same_recording(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return (
        a.get("start_ns") is not None
        and a.get("start_ns") == b.get("start_ns")
        and a.get("command") == b.get("command")
        and a.get("pid") == b.get("pid")
    )


# -- rendering ---------------------------------------------------------------------------------
def verdict_style(verdict: str) -> str:
    """The colour of a verdict line: by the judge's outcome its text starts with (the text
    before " (", as comparison.json holds it); bold red for any other."""
    from traindx.analyzers.core.ab_verdict import Outcome  # numpy: kept out of `diagnose --help`

    styles = {
        Outcome.FASTER.value: "bold green",
        Outcome.FASTER_START.value: "bold green",
        Outcome.FASTER_NUMERICS_DIFFER.value: "bold yellow",
        Outcome.NO_GAIN.value: "bold red",
    }
    return styles.get(verdict.split(" (")[0], "bold red")


def _seconds(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.3f} s"


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.2f} %"


def _number(x: float | None, fmt: str = "{:,.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def print_comparison(comparison: dict[str, Any], console: Console | None = None) -> None:
    """The comparison as a user reads it in the terminal (rich)."""
    from rich.text import Text

    from traindx.common.console import Console

    console = console or Console(file=sys.stderr)
    console.rule("traindx: A/B comparison")
    _print_change(comparison["change"], console)
    console.print(_arms_table(comparison["baseline"], comparison["candidate"]))
    _print_outcome(comparison, console)
    _print_parity(comparison["loss_parity"], console)
    for problem in comparison.get("problems", []):
        console.print(Text(f"note: {problem}", style="yellow"))
    for line in comparison["change"].get("instructions", []):
        console.print(Text(f"to do by hand: {line}", style="cyan"))
    console.print(Text(f"verdict: {comparison['verdict']}", style=verdict_style(comparison["verdict"])))


def _print_change(change: dict[str, Any], console: Console) -> None:
    """The command and environment change, what was applied and precompiled."""
    from rich.text import Text

    cmd = change["command"]
    if cmd["same"]:
        console.print("command: unchanged", markup=False)
    else:
        console.print(Text("command:", style="bold"))
        console.print(Text("  - " + cmd["before"], style="red"))
        console.print(Text("  + " + cmd["after"], style="green"))
    env = change["env"]
    if any(env.values()):
        console.print(Text("environment:", style="bold"))
        for k, v in env["added"].items():
            console.print(Text(f"  + {k}={v}", style="green"))
        for k, v in env["removed"].items():
            console.print(Text(f"  - {k}={v}", style="red"))
        for k, (a, b) in env["changed"].items():
            console.print(Text(f"  ~ {k}: {a} -> {b}", style="yellow"))
    else:
        console.print("environment: unchanged", markup=False)
    for line in change.get("applied", []):
        console.print(Text(f"applied: {line}"))
    for step in change.get("precompiled", []):
        console.print(Text(f"precompiled: {step}"))


def _arms_table(base: dict[str, Any], cand: dict[str, Any]) -> Table:
    """The two arms side by side."""
    from rich.table import Table

    from traindx.recipes.ab import step_source_text

    table = Table(show_header=True, header_style="bold")
    table.add_column("")
    table.add_column("baseline", justify="right")
    table.add_column("candidate", justify="right")

    def window(arm: dict[str, Any]) -> str:
        return "-" if not arm["window"] else f"{arm['window'][0]}-{arm['window'][1]} ({arm['window_steps']})"

    table.add_row("steps recorded", str(base["steps"]), str(cand["steps"]))
    table.add_row("steady window (steps)", window(base), window(cand))
    table.add_row("median step time", _seconds(base["median_step_s"]), _seconds(cand["median_step_s"]))
    if base.get("step_source") != "shim" or cand.get("step_source") != "shim":
        table.add_row("timed by", step_source_text(base), step_source_text(cand))
    table.add_row("step-time CV", _percent(base["step_time_cv"]), _percent(cand["step_time_cv"]))
    table.add_row("tokens/s", _number(base["tokens_per_s"]), _number(cand["tokens_per_s"]))
    table.add_row("step 0 (warm-up)", _seconds(base.get("first_step_s")), _seconds(cand.get("first_step_s")))
    table.add_row("wall time of the run", _seconds(base.get("wall_s")), _seconds(cand.get("wall_s")))
    table.add_row(
        "compile events (in window)",
        f"{base['compiles']} ({base['compiles_in_window']})",
        f"{cand['compiles']} ({cand['compiles_in_window']})",
    )
    return table


def _print_outcome(comparison: dict[str, Any], console: Console) -> None:
    """The speedup, failed steps, predicted vs measured, and how to keep the change."""
    from rich.text import Text

    from traindx.recipes.ab import change_text, speedup_text

    if comparison["speedup"] is not None:
        console.print(Text(f"speedup: {speedup_text(comparison)}", style="bold"))
    for step in comparison["change"].get("steps", []):
        if not step.get("ok"):
            console.print(
                Text(
                    f"failed: {step['step']}: {step.get('error')}"
                    + (f" — the candidate ran with {step['instead']}" if step.get("instead") else ""),
                    style="yellow",
                )
            )
    for c in comparison.get("changes") or []:
        console.print(Text(f"predicted vs measured: {change_text(c)}"))
    if comparison.get("fix_patch"):
        console.print(Text(f"fix.patch: {comparison['fix_patch']}", style="bold"))
    for line in comparison["change"].get("apply", []):
        console.print(Text(f"to keep it: {line}", style="cyan"))


def _print_parity(parity: dict[str, Any] | None, console: Console) -> None:
    from rich.text import Text

    if parity is None:
        console.print("loss parity: not checked (no losses in the job's log)", markup=False)
        return
    corr = "n/a" if parity["correlation"] is None else f"{parity['correlation']:.4f}"
    final = "-" if parity["final_loss_difference"] is None else f"{parity['final_loss_difference']:.2%}"
    status = Text("pass" if parity["passed"] else "FAIL", style="green" if parity["passed"] else "bold red")
    line = (
        Text("loss parity: ")
        .append(status)
        .append(
            f" (correlation {corr}, {parity['pointwise_failures']} of {parity['points']} points "
            f"outside tolerance, final-loss difference {final}; first {parity['skipped']} "
            "points skipped)"
        )
    )
    console.print(line)
    if parity.get("rule"):
        console.print(f"  decided by: {parity['rule']}", markup=False)
    for reason in parity["reasons"]:
        console.print(Text(f"  ✗ {reason}", style="red"))
