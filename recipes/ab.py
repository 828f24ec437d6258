"""The A/B comparison of two recorded runs: what changed, how fast each arm was over its steady
window, the speedup with a bootstrap interval, throughput, step-time CV, loss parity, a verdict.

Reads only the run records (traindx.load_run); the result is a plain dict (JSON-ready) that the
terminal, comparison.json and the HTML report render.
"""

from __future__ import annotations

import difflib
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers.core import parity as loss_parity_rules
from traindx.analyzers.core.ab_verdict import MIN_SPEEDUP, ABVerdict, ab_verdict
from traindx.analyzers.memory import memory as memory_rules
from traindx.derive import stats
from traindx.derive.gpu_efficiency import tokens_per_step
from traindx.derive.periods import series_period
from traindx.derive.steady import perturbed_causes, profiled_steps
from traindx.derive.steptables import SHIM_SOURCES, progress_step_seconds
from traindx.recipes.ab_unit import per_micro_batch

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

# variables traindx itself sets per run, not part of the change between two arms
_OWN_ENV = (
    "TRAINDX_RUN_DIR",
    "TRAINDX_MAX_STEPS",
    "PYTHONUNBUFFERED",
    "TRAINDX_FIX_MECHANISM",  # how --fix chose, not a setting of the job
    # the shell's bookkeeping, not a setting of the job
    "OLDPWD",
    "PWD",
    "SHLVL",
    "_",
)
# traindx options that change what the job pays for being measured
_MEASUREMENT_OPTIONS = ("pyspy", "shim", "nvml", "pyspy_rate_hz", "dump_interval_s", "torch_profile")


def step_times(run: RunRecord) -> tuple[pd.Series, str | None]:
    """Step durations in seconds, in step order, and where they came from: the shim's
    boundaries (on the GPU's clock for a job that runs CUDA work), else the job's own log
    (traindx.derive.steptables.progress_step_seconds)."""
    return progress_step_seconds(run)


BEFORE_PROFILER_WINDOW = (
    "the step before a torch.profiler window (on the GPU's clock the window's start-up lands in it)"
)


def left_out_steps(run: RunRecord, series: pd.Series, source: str | None = "shim") -> dict[int, str]:
    """{step: why} of the steps of `series` a steady measure leaves out (any rank's:
    traindx.derive.steady.perturbed_causes, the first cause named); on the GPU's clock the step
    before each torch.profiler window too: the window opens at that step's end boundary, whose
    event the GPU reaches only after the profiler's start-up (H200: 10 ms against 5.3 ms)."""
    why: dict[int, str] = {}
    for cause, by_rank in perturbed_causes(run).items():
        for step in sorted(set().union(*by_rank.values())):
            why.setdefault(int(step), cause)
    if source == "shim:gpu":
        windows = set().union(*profiled_steps(run).values())
        for step in sorted(s - 1 for s in windows if s - 1 not in windows):
            why.setdefault(int(step), BEFORE_PROFILER_WINDOW)
    steps = {int(s) for s in series.index}
    return {s: w for s, w in sorted(why.items()) if s in steps}


def profiled_positions(run: RunRecord, series: pd.Series, source: str | None = "shim") -> list[int]:
    """Positions in `series` of the steps a steady measure leaves out (left_out_steps)."""
    left_out = left_out_steps(run, series, source)
    return [i for i, step in enumerate(series.index) if step in left_out]


def losses(run: RunRecord) -> dict[int, float]:
    """{step: loss} from the job's log (the last value printed for a step)."""
    log = run.log_steps
    if not len(log):
        return {}
    log = log.dropna(subset=["loss", "step"])
    return {int(s): float(v) for s, v in log.groupby("step")["loss"].last().items()}


def compile_counts(run: RunRecord, window: tuple[int, int] | None = None) -> tuple[int, int | None]:
    """(all compile events, those inside the step window) of a run."""
    compiles = run.compiles
    total = int(len(compiles))
    if window is None or not total:
        return total, 0 if window is not None else None
    steps = compiles["step"].dropna()
    in_window = int(((steps >= window[0]) & (steps <= window[1])).sum())
    return total, in_window


def command_diff(before: Sequence[str], after: Sequence[str]) -> dict[str, Any]:
    """Token-level diff of two commands: removed and added tokens, with both command lines."""
    removed, added = [], []
    matcher = difflib.SequenceMatcher(a=list(before), b=list(after), autojunk=False)
    for op, a0, a1, b0, b1 in matcher.get_opcodes():
        if op in ("replace", "delete"):
            removed.extend(before[a0:a1])
        if op in ("replace", "insert"):
            added.extend(after[b0:b1])
    return {
        "before": shlex.join(before),
        "after": shlex.join(after),
        "removed": removed,
        "added": added,
        "same": list(before) == list(after),
    }


def env_diff(before: Mapping[str, str] | None, after: Mapping[str, str] | None) -> dict[str, Any]:
    """Environment variables added, removed or changed between two manifests' environments."""
    before = {k: v for k, v in (before or {}).items() if k not in _OWN_ENV}
    after = {k: v for k, v in (after or {}).items() if k not in _OWN_ENV}
    return {
        "added": {k: after[k] for k in sorted(after) if k not in before},
        "removed": {k: before[k] for k in sorted(before) if k not in after},
        "changed": {k: [before[k], after[k]] for k in sorted(before) if k in after and before[k] != after[k]},
    }


MIN_STEPS_FOR_INTERVAL = 5  # fewer steps per arm: no bootstrap interval, the values themselves


def _arm_series(run: RunRecord) -> tuple[pd.Series, str | None, list[int]]:
    series, source = step_times(run)
    profiled = profiled_positions(run, series, source) if source in SHIM_SOURCES else []
    return series, source, profiled


def step_period(
    arm: tuple[pd.Series, str | None, list[int]],
    window: tuple[int, int] | None = None,
    exclude: Iterable[int] = (),
) -> dict[str, Any] | None:
    """{period, residue, excess_s} of the arm's step times over the window (a cost on every
    k-th step, k = 2 included: traindx.derive.periods.series_period), else None."""
    series = arm[0]
    positions, bounds = stats.window_positions(len(series), window, exclude)
    if bounds is None:
        return None
    values = series.to_numpy(dtype=float)[positions]
    steps = np.asarray(series.index, dtype=np.int64)[positions]
    keep = np.isfinite(values)
    found = series_period(steps[keep], values[keep])
    if not found:
        return None
    return {
        "period": found["period"],
        "residue": found["residue"],
        "excess_s": round(float(found["excess_s"]), 6),
    }


def measure_arm(
    run: RunRecord,
    window: tuple[int, int] | None = None,
    tokens_override: float | None = None,
    exclude: Iterable[int] | None = None,
    arm: tuple[pd.Series, str | None, list[int]] | None = None,
) -> tuple[dict[str, Any], np.ndarray]:
    """One arm over a step window. `exclude`: positions left out (both arms get the same ones,
    see compare_runs); default: this arm's own profiled steps."""
    series, source, profiled = arm or _arm_series(run)
    times = series.to_numpy(dtype=float)
    tokens = tokens_override or tokens_per_step(run)
    if exclude is not None:
        profiled = list(exclude)
    summary, window_times = stats.summarize_arm(times, window, tokens, exclude=profiled)
    total, in_window = compile_counts(run, summary.window)
    out = summary.to_dict()
    out["profiled_steps_excluded"] = [
        int(series.index[i])
        for i in profiled
        if summary.window and summary.window[0] <= i <= summary.window[1]
    ]
    start, end = run.manifest.get("start_ns"), run.manifest.get("end_ns")
    out.update(
        {
            "first_step_s": float(times[0]) if len(times) else None,
            "wall_s": (end - start) / 1e9 if start and end else None,
            "run": run.path,
            "command": list(run.command),
            "exit_code": run.manifest.get("exit_code"),
            "step_source": source,
            "step_times_s": [round(float(x), 6) for x in times],
            "compiles": total,
            "compiles_in_window": in_window,
            "window": list(summary.window) if summary.window else None,
        }
    )
    return out, window_times


def compare_runs(
    baseline: RunRecord,
    candidate: RunRecord,
    window: tuple[int, int] | None = None,
    tokens_per_step: float | None = None,
    change: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The comparison dict of two loaded runs (baseline = the reference arm)."""
    return judged_comparison(baseline, candidate, window, tokens_per_step, change)[0]


def judged_comparison(
    baseline: RunRecord,
    candidate: RunRecord,
    window: tuple[int, int] | None = None,
    tokens_per_step: float | None = None,
    change: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], ABVerdict]:
    """(the comparison dict, its verdict as the judge decided it: what decisions match on)."""
    # the same window and the same exclusions on both sides: the steps both arms recorded, the
    # profiled steps of either arm left out of both
    base_arm, cand_arm = _arm_series(baseline), _arm_series(candidate)
    # the same unit of work in both arms: seconds per micro-batch where the step boundary moved
    base_arm, cand_arm, unit = per_micro_batch(baseline, candidate, base_arm, cand_arm)
    both = min(len(base_arm[0]), len(cand_arm[0]))
    if window is None and both and len(base_arm[0]) != len(cand_arm[0]):
        window = stats.steady_window(both)
    excluded = sorted(set(base_arm[2]) | set(cand_arm[2]))
    base, base_w = measure_arm(baseline, window, tokens_per_step, exclude=excluded, arm=base_arm)
    cand, cand_w = measure_arm(candidate, window, tokens_per_step, exclude=excluded, arm=cand_arm)
    # a cost on every k-th step (k = 2 too) leaves the median in one mode of the step times:
    # the means measure it, as the fix loop judges a periodic finding
    periods = {
        name: step_period(arm, window, excluded)
        for name, arm in (("baseline", base_arm), ("candidate", cand_arm))
    }
    periods = {name: found for name, found in periods.items() if found}
    speed = _speedup(base_w, cand_w, "mean" if periods else "median")
    problems = list(speed.problems) if speed.speedup is not None else _no_steps_problems(base, cand)
    problems += _run_problems(baseline, candidate, base, cand)
    parity = _loss_parity(baseline, candidate, problems, unit)
    startup = _startup(base, cand)
    verdict = ab_verdict(
        speed.speedup,
        speed.verdict_low,
        None if parity is None else parity["passed"],
        *((startup["first_step_speedup"], startup["first_step_saved_s"]) if startup else ()),
    )
    result: dict[str, Any] = {
        "baseline": base,
        "candidate": cand,
        "change": {
            "command": command_diff(list(baseline.command), list(candidate.command)),
            "env": env_diff(baseline.manifest.get("env"), candidate.manifest.get("env")),
        },
        "speedup": speed.speedup,
        "speedup_ci95": speed.ci,
        "speedup_statistic": speed.statistic,
        "unit": unit or {"name": "step"},
        "step_periods": periods,
        "window_values_s": {
            "baseline": [round(float(x), 6) for x in base_w],
            "candidate": [round(float(x), 6) for x in cand_w],
        },
        "excluded_steps_both_arms": [int(base_arm[0].index[i]) for i in excluded if i < len(base_arm[0])],
        "interval_note": speed.interval_note,
        "tokens_per_s_gain": (
            cand["tokens_per_s"] / base["tokens_per_s"]
            if base["tokens_per_s"] and cand["tokens_per_s"]
            else None
        ),
        "startup": startup,
        "loss_parity": parity,
        # the memory's slope of each arm (a fix that keeps less is judged by it: ab_verdict)
        "memory_slope": {
            "baseline": memory_rules.steady_rate(baseline),
            "candidate": memory_rules.steady_rate(candidate),
        },
        "verdict": verdict.text()
        + (f" (per micro-batch; loss parity: {parity['decided_by']})" if unit and parity else ""),
        "problems": problems,
        "thresholds": _thresholds(),
    }
    if change:
        result["change"].update(change)
    return result, verdict


@dataclass
class _Speedup:
    """The speedup of two arms' window values: the point, the interval (None under
    MIN_STEPS_FOR_INTERVAL steps an arm), the low end the verdict reads, and why no interval."""

    statistic: str
    speedup: float | None = None
    ci: list[float] | None = None
    verdict_low: float | None = None
    interval_note: str | None = None
    problems: list[str] = field(default_factory=list)


def _speedup(base_w: np.ndarray, cand_w: np.ndarray, statistic: str) -> _Speedup:
    out = _Speedup(statistic)
    if not (len(base_w) and len(cand_w)):
        return out
    point, low, high = stats.bootstrap_speedup(base_w, cand_w, statistic=statistic)
    out.speedup = point
    if min(len(base_w), len(cand_w)) >= MIN_STEPS_FOR_INTERVAL:
        out.ci, out.verdict_low = [low, high], low
        return out
    # too few points for a bootstrap: the per-step values, and "faster" only when every
    # candidate step beat every baseline step
    out.verdict_low = float(np.min(base_w) / np.max(cand_w))
    out.interval_note = (
        f"no confidence interval: {len(base_w)} and {len(cand_w)} steps in "
        f"the window (need {MIN_STEPS_FOR_INTERVAL} per arm); per-step "
        f"values: baseline {[round(float(x), 4) for x in base_w]}, "
        f"candidate {[round(float(x), 4) for x in cand_w]}"
    )
    out.problems.append(out.interval_note)
    return out


def _no_steps_problems(base: Mapping[str, Any], cand: Mapping[str, Any]) -> list[str]:
    """The arms with no step in the window (no speedup was measured)."""
    return [
        f"the {name} arm recorded no completed step"
        for name, arm in (("baseline", base), ("candidate", cand))
        if not arm["window_steps"]
    ]


def _run_problems(
    baseline: RunRecord, candidate: RunRecord, base: Mapping[str, Any], cand: Mapping[str, Any]
) -> list[str]:
    """What makes the two arms less comparable: an exit code, step counts, measurement options."""
    problems = [
        f"the {name} arm exited with {arm['exit_code']}"
        for name, arm in (("baseline", base), ("candidate", cand))
        if arm["exit_code"] not in (0, None)
    ]
    if base["steps"] and cand["steps"] and base["steps"] != cand["steps"]:
        problems.append(
            f"the arms ran a different number of steps ({base['steps']} and "
            f"{cand['steps']}): their steady windows differ"
        )
    base_opts = baseline.manifest.get("options") or {}
    cand_opts = candidate.manifest.get("options") or {}
    differing = [k for k in _MEASUREMENT_OPTIONS if base_opts.get(k) != cand_opts.get(k)]
    if differing:
        problems.append(
            "the arms were recorded with different traindx options ("
            + ", ".join(f"{k}: {base_opts.get(k)} vs {cand_opts.get(k)}" for k in differing)
            + "): part of the difference is the measurement's own overhead"
        )
    return problems


def _loss_parity(
    baseline: RunRecord, candidate: RunRecord, problems: list[str], unit: Mapping[str, Any] | None = None
) -> dict[str, Any] | None:
    """The loss-parity dict of the steps both arms logged a loss for, or None (and a note in
    `problems` where the losses could not be compared). `unit`: the arms update the weights at
    another rate (recipes/ab_unit.py): the `updates` rule decides."""
    base_losses, cand_losses = losses(baseline), losses(candidate)
    common = sorted(set(base_losses) & set(cand_losses))
    unfinite = [s for s in common if not np.isfinite(cand_losses[s])]
    if len(common) == 1 and not unfinite:
        # one point is no curve: the numerics are not compared (as with no losses), not failed
        problems.append(
            f"the two arms logged one loss at the same step ({common[0]}): no parity "
            "check (the job logs its loss too rarely for this window)"
        )
        return None
    if common:
        parity = loss_parity_rules.loss_parity(
            [base_losses[s] for s in common],
            [cand_losses[s] for s in common],
            update_ratio=float(unit["update_ratio"]) if unit else None,
        ).to_dict()
        parity["steps"] = [common[0], common[-1]]
        parity["baseline_losses"] = [base_losses[s] for s in common]
        parity["candidate_losses"] = [cand_losses[s] for s in common]
        return parity
    if base_losses or cand_losses:
        problems.append("the two arms logged losses for different steps: no parity check")
    return None


def _startup(base: Mapping[str, Any], cand: Mapping[str, Any]) -> dict[str, float] | None:
    """Step 0 of both arms: a precompile pays off at the start (step 0 and the job's wall
    time), not in the window."""
    if not (base["first_step_s"] and cand["first_step_s"]):
        return None
    return {
        "first_step_speedup": base["first_step_s"] / cand["first_step_s"],
        "first_step_saved_s": base["first_step_s"] - cand["first_step_s"],
    }


def _thresholds() -> dict[str, Any]:
    return {"min_speedup": MIN_SPEEDUP, **loss_parity_rules.thresholds()}


STEP_SOURCE_TEXT = {
    "shim:gpu": "the GPU's clock at the step boundaries",
    "shim": "the step boundaries (host clock)",
    "log": "the job's log",
}


def step_source_text(arm: Mapping[str, Any]) -> str:
    """How an arm's step times were measured, in words."""
    return STEP_SOURCE_TEXT.get(arm.get("step_source") or "", "unknown")


def report_view(comparison: Mapping[str, Any]) -> dict[str, Any]:
    """The comparison as the HTML report shows it: the two arms side by side (measures only,
    not the raw step lists) and the change, speedup, parity and verdict as short facts."""

    def arm(a: Mapping[str, Any]) -> dict[str, Any]:
        window = a.get("window")
        return {
            "median step (s)": a.get("median_step_s"),
            "timed by": step_source_text(a),
            "steady window": f"steps {window[0]}-{window[1]} ({a.get('window_steps')})" if window else None,
            "step-time CV": None if a.get("step_time_cv") is None else f"{a['step_time_cv']:.2%}",
            "tokens/s": None if a.get("tokens_per_s") is None else round(a["tokens_per_s"], 1),
            "compile events (in window)": f"{a.get('compiles')} ({a.get('compiles_in_window')})",
            "step 0 (s)": a.get("first_step_s"),
            "wall time (s)": None if a.get("wall_s") is None else round(a["wall_s"], 1),
            "steps recorded": a.get("steps"),
            "run": a.get("run"),
        }

    change = comparison.get("change", {})
    cmd = change.get("command", {})
    env = change.get("env", {})
    view: dict[str, Any] = {
        "baseline": arm(comparison["baseline"]),
        "candidate": arm(comparison["candidate"]),
    }
    view["command change"] = (
        "unchanged" if cmd.get("same") else {"before": cmd.get("before"), "after": cmd.get("after")}
    )
    env_lines = {
        **{f"+ {k}": v for k, v in env.get("added", {}).items()},
        **{f"- {k}": v for k, v in env.get("removed", {}).items()},
        **{f"~ {k}": f"{a} → {b}" for k, (a, b) in env.get("changed", {}).items()},
    }
    view["environment change"] = env_lines or "unchanged"
    if change.get("applied"):
        view["applied"] = "; ".join(change["applied"])
    if change.get("precompiled"):
        view["precompiled"] = "; ".join(change["precompiled"])
    if change.get("instructions"):
        view["to do by hand"] = "; ".join(change["instructions"])
    if comparison.get("speedup") is not None:
        view["speedup"] = speedup_text(comparison)
    if comparison.get("changes"):
        view["predicted vs measured"] = "; ".join(change_text(c) for c in comparison["changes"])
    parity = comparison.get("loss_parity")
    if parity:
        view["loss parity"] = {
            "result": "pass" if parity["passed"] else "fail",
            "decided by": parity.get("rule") or "correlation, pointwise tolerance and final loss",
            "correlation": parity["correlation"],
            "points outside tolerance": f"{parity['pointwise_failures']} of {parity['points']}",
            "final-loss difference": parity["final_loss_difference"],
            "why": "; ".join(parity["reasons"]) or "every threshold met",
        }
    else:
        view["loss parity"] = "not checked (no losses in the job's log)"
    if comparison.get("problems", []):
        view["notes"] = "; ".join(comparison["problems"])
    if comparison.get("search"):  # every candidate --fix measured, this one included
        view["candidates measured"] = "; ".join(
            f"{a['arm']}: [{a['finding']}] ({a['mechanism']}) "
            + (f"{a['speedup']:.2f}×" if a.get("speedup") is not None else "n/a")
            + f", {a['verdict']}"
            + (" (kept)" if a.get("kept") else "")
            for a in comparison["search"]
        )
    view["verdict"] = comparison["verdict"]
    return view


def speedup_text(comparison: Mapping[str, Any]) -> str:
    """'12.3× (95 % bootstrap interval 10.1–14.0×)', or the per-step values when an arm has too
    few steps for an interval."""
    speedup = comparison.get("speedup")
    if speedup is None:
        return "-"
    ci = comparison.get("speedup_ci95")
    statistic = comparison.get("speedup_statistic") or "median"
    periods = comparison.get("step_periods") or {}
    why = (
        ""
        if statistic == "median"
        else " of the means: "
        + ", ".join(f"the {name} costs more every {p['period']} steps" for name, p in periods.items())
    )
    if ci:
        return f"{speedup:.2f}× (95 % bootstrap interval {ci[0]:.2f}–{ci[1]:.2f}×{why})"
    values = comparison.get("window_values_s") or {}
    return (
        f"{speedup:.2f}× ({statistic} ratio{why}; too few steps for an interval — per-step "
        f"s: baseline {values.get('baseline')}, candidate {values.get('candidate')})"
    )


def change_text(c: Mapping[str, Any]) -> str:
    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f} s"

    text = (
        f"[{c.get('finding')}] {c.get('mechanism')}: predicted step {s(c.get('predicted_step_time_s'))}, "
        f"measured {s(c.get('measured_step_time_s'))}"
    )
    if c.get("failed"):
        text += " (not applied: the step failed)"
    elif c.get("measured_jointly_with"):
        text += f" (jointly with {', '.join(c['measured_jointly_with'])})"
    return text
