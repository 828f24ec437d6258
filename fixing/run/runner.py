"""The --fix loop: the baseline arm, the candidates in order until the judge says one settles
the search, the kept arm (the judge's choice), a warm-up arm after it, fix.patch. It runs arms
and reports; every verdict is analyzers/core/ab_verdict.py's."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from traindx.analyzers.core import ab_verdict as judge
from traindx.analyzers.core.ab_verdict import Arm
from traindx.analyzers.core.findings import Finding
from traindx.derive.run import load_run
from traindx.fixing.plan.planner import (
    CACHE_DIR_VAR,
    CACHE_ENABLE_VAR,
    Candidate,
    candidate_plans,
    warm_up_after,
)
from traindx.fixing.run.arm import FixContext, analyze_arm, run_arm, search_row
from traindx.fixing.run.model import FixOptions, FixResult, Say, with_options, write_fix_json
from traindx.profiler.launcher import exit_status
from traindx.report import outputs


@dataclass
class _Search:
    """The candidate arms measured, with what each one's comparison, plan and run found."""

    arms: list[Arm] = field(default_factory=list)
    comparisons: dict[str, dict[str, Any]] = field(default_factory=dict)
    candidates: dict[str, Candidate] = field(default_factory=dict)
    findings: dict[str, list[Finding]] = field(default_factory=dict)


def run_loop(
    command: list[str],
    options: FixOptions,
    record_options: Any,
    cwd: str,
    run_job: Callable[..., int | None],
    say: Say,
    result: FixResult,
    reuse: int | None,
) -> None:
    """Baseline, candidates, the kept arm; `result` is filled in as it goes (fix.json)."""
    ctx = _baseline(command, options, record_options, run_job, say, result, reuse)
    if ctx is None:
        return
    candidates, alternatives = _candidates(ctx, cwd, result)
    if not candidates:
        return
    search = _search(ctx, candidates, alternatives, result)
    _baseline_measured(ctx, search.arms)
    kept = judge.keep(search.arms)
    result.best = kept.dir if kept else None
    # the job's exit code passes through: the kept arm's, else the last arm's that ran (else the
    # baseline's: no arm ran)
    ran = [a for a in search.arms if a.not_run is None]
    if kept or ran:
        result.exit_code = (kept or ran[-1]).exit_code
    result.comparison = search.comparisons.get(kept.dir) if kept else None
    if kept:
        _redraw_kept(ctx, search, kept)
        comparison = search.comparisons[kept.dir]
        result.apply = comparison.get("change", {}).get("apply") or (comparison.get("apply") or [])
        if options.warm_up_after_fix and kept.exit_code == 0:
            _warm_up(ctx, search, kept, result)
    _fix_patch(ctx.root, kept, result)
    for arm in search.arms:
        say("info", _outcome_line(arm, kept, result.warm_up))
    result.ladder = ladder_rows(result.ladder, search.arms, kept)
    for row in result.ladder:
        say("info", ladder_line(row))
    result.status = "done"


def _baseline(
    command: list[str],
    options: FixOptions,
    record_options: Any,
    run_job: Callable[..., int | None],
    say: Say,
    result: FixResult,
    reuse: int | None,
) -> FixContext | None:
    """The baseline arm recorded (or a finished one reused) and analyzed; None when it failed."""
    base_dir = result.baseline
    say("stage", "baseline arm")
    if reuse is not None:
        say("info", f"baseline: reusing the finished run in {base_dir}")
        code: int | None = reuse
    else:
        os.makedirs(base_dir)
        code = (
            run_job(command, base_dir, record_options, until_diagnosed=True)
            if options.until_diagnosed
            else run_job(command, base_dir, record_options)
        )
    baseline, judged, report = analyze_arm(base_dir, say)
    findings = list(judged.findings)
    if options.until_diagnosed and len(baseline.steps):
        # the candidates run the steps the baseline ran (its own stop, or the job's end)
        steps = int(baseline.steps.groupby("rank").size().max())
        record_options = with_options(record_options, steps=steps)
        stopped = len(baseline.of_type("stop_requested")) > 0
        say(
            "info",
            f"baseline: {'stopped once diagnosed, after' if stopped else 'ran'} "
            f"{record_options.steps} steps; each candidate runs as many",
        )
    say("summary", "baseline", record=baseline, judgement=judged, report=report)
    result.exit_code = exit_status(code)
    if result.exit_code != 0:
        result.status = "baseline failed"
        say(
            "info",
            f"the baseline arm exited with {result.exit_code}: no candidate run (a fix "
            "is measured against a baseline that ran)",
        )
        return None
    return FixContext(command, baseline, findings, result.root, options, record_options, run_job, say)


def _candidates(ctx: FixContext, cwd: str, result: FixResult) -> tuple[list[Candidate], list[str]]:
    """The planned candidates, listed (result.plan too); the alternatives every arm names."""
    options, say = ctx.options, ctx.say
    prefer = "overlay" if options.wheels else None
    candidates, listing = candidate_plans(
        ctx.command, ctx.findings, ctx.baseline.path, prefer=prefer, cwd=cwd
    )
    result.plan = dict(listing.to_dict(), candidates=[c.to_dict() for c in candidates])
    result.ladder = [dict(row) for row in listing.ladder]
    for row in result.ladder:
        if row["status"] == "skipped":
            say("plan", ladder_line(row))
    say("stage", "prescriptions")
    for i, c in enumerate(candidates):
        tried = "" if i < options.tries else " (beyond --fix-tries: not measured)"
        gain = c.predicted_saving_s_per_step
        say(
            "plan",
            f"candidate {i + 1}: [{c.finding}] ({c.mechanism}) {c.summary}"
            + (f"; predicted saving {gain * 1000:.1f} ms/step" if gain else "")
            + tried,
        )
    for line in listing.instructions:
        say("plan", f"by hand: {line}")
    for line in listing.deferred:
        say("plan", f"later: {line}")
    for line in listing.warnings:
        say("warning", line)
    if not candidates:
        result.status = "nothing to apply"
        say("info", "nothing to apply automatically: no candidate run")
    return candidates, listing.alternatives


def _search(
    ctx: FixContext, candidates: list[Candidate], alternatives: list[str], result: FixResult
) -> _Search:
    """The candidates measured in order, at most --fix-tries, until one settles the search."""
    search = _Search()
    tries = min(len(candidates), ctx.options.tries)
    for i, cand in enumerate(candidates[:tries]):
        name = "candidate" if i == 0 else f"candidate-{i + 1}"
        result.status = name
        others = [f"[{c.finding}] ({c.mechanism}) {c.summary}" for c in candidates if c is not cand]
        measured = run_arm(ctx, name, cand, alternatives=alternatives + others, searched=list(search.arms))
        arm = measured.arm
        search.comparisons[arm.dir] = measured.comparison
        search.candidates[arm.dir], search.findings[arm.dir] = cand, measured.findings
        search.arms.append(arm)
        result.arms.append(arm.to_row())
        if measured.comparison.get("interrupted"):  # recorded as interrupted; the user stopped --fix
            raise KeyboardInterrupt
        if judge.settles_search(arm):
            break
        if i + 1 < tries:
            ctx.say("info", f"{name}: {judge.why_not_settled(arm)}; trying the next candidate")
    return search


def _baseline_measured(ctx: FixContext, arms: list[Arm]) -> None:
    """The baseline's findings.json again with what the arms measured (the judge demotes a
    finding whose fix measured slower: ab_verdict.demoted_by_arms)."""
    demoted = judge.demoted_by_arms(ctx.findings, arms)
    if any(a.severity != b.severity for a, b in zip(demoted, ctx.findings)):
        ctx.findings[:] = demoted
        outputs.write_findings(ctx.baseline, demoted)


def _redraw_kept(ctx: FixContext, search: _Search, kept: Arm) -> None:
    """Where the search went past the kept arm: its comparison and report redrawn with every
    arm measured, the kept one marked."""
    if kept.dir == search.arms[-1].dir:
        return
    comparison = search.comparisons[kept.dir]
    comparison["search"] = [search_row(a, kept.dir) for a in search.arms]
    write_fix_json(os.path.join(kept.dir, "comparison.json"), comparison)
    try:
        analyze_arm(kept.dir, ctx.say, comparison=comparison)
    except Exception as exc:  # the comparison.json above has it all
        ctx.say("warning", f"could not redraw {kept.dir}/report.html: {exc}")


def _warm_up(ctx: FixContext, search: _Search, kept: Arm, result: FixResult) -> None:
    """One more arm after the kept one: the same change with the kernels its own run still
    compiled cold warmed beforehand (fixplan.warm_up_after), when there are any."""
    warm = warm_up_after(search.candidates[kept.dir], search.findings[kept.dir], kept.dir)
    if warm is None:
        return
    result.status = "warm-up"
    after = FixContext(
        ctx.command,
        load_run(kept.dir),
        search.findings[kept.dir],
        ctx.root,
        ctx.options,
        ctx.record_options,
        ctx.run_job,
        ctx.say,
    )
    measured = run_arm(after, "warm-up", warm, searched=[])
    arm = measured.arm
    arm.after = kept.dir
    search.arms.append(arm)
    result.arms.append(arm.to_row())
    if not arm.significant:
        return
    result.warm_up = arm.dir
    # the kept change's own lines stay first; the warm-up adds its commands and env
    result.apply = result.apply + [
        line
        for line in measured.comparison.get("apply") or []
        if line not in result.apply
        and (
            "kernel-cache warm" in line
            or any(line.startswith(f"export {var}=") for var in (CACHE_ENABLE_VAR, CACHE_DIR_VAR))
        )
    ]


def _fix_patch(root: str, kept: Arm | None, result: FixResult) -> None:
    """fix.patch: the kept arm's source patch (its apply lines name it), or none."""
    patch = os.path.join(root, "fix.patch")
    if kept and kept.patch:
        shutil.copyfile(kept.patch, patch)
        result.apply = [line.replace(kept.patch, patch) for line in result.apply]
    elif os.path.exists(patch):
        os.unlink(patch)


def _outcome_line(arm: Arm, kept: Arm | None, warm_up: str | None) -> str:
    """'kept: candidate-2 [finding] (config) 1.42x, faster and numerically equivalent; predicted ...'"""
    if arm.not_run is not None:
        return f"not run: {arm.name} [{arm.finding}] ({arm.mechanism}): {arm.not_run}"
    mark = "kept" if kept and arm.dir == kept.dir else "then kept" if arm.dir == warm_up else "tried"
    by = arm.judged_by
    if by is judge.Measure.MEMORY:
        slopes = arm.judgement.memory_slopes
        text = judge.judged_text(by, arm.judged_speedup, arm.interval(), arm.verdict, slopes)
        won = "memory no longer grows" if arm.significant else "memory still grows, or the step is slower"
        return f"{mark}: {arm.name} [{arm.finding}] ({arm.mechanism}) {text}: {won} (decided by: {by.value})"
    speed = (f"{arm.judged_speedup:.2f}x" if arm.judged_speedup is not None else "n/a") + (
        ""
        if by is judge.Measure.MEDIAN
        else f" by {by.short}"
        if by is judge.Measure.FIRST_STEP
        else f" by the {by.short}"
    )
    pred, meas = arm.predicted_step_time_s, arm.measured_step_time_s
    pm = (
        f"; predicted {pred:.4f} s/step, measured {meas:.4f} s/step"
        if pred is not None and meas is not None
        else ""
    )
    return f"{mark}: {arm.name} [{arm.finding}] ({arm.mechanism}) {speed}, {arm.verdict}{pm}"


def ladder_rows(rows: list[dict[str, Any]], arms: list[Arm], kept: Arm | None) -> list[dict[str, Any]]:
    """The ladder's rows with what each offered rung's arm measured (its judged speedup, the
    interval, the verdict, loss parity) and whether it was kept; a rung the search did not
    reach says so."""
    out = []
    for row in rows:
        row = dict(row)
        arm = next(
            (a for a in arms if a.finding == row["finding"] and a.summary == row["summary"] and not a.after),
            None,
        )
        if row["status"] == "offered" and arm is not None and arm.not_run is not None:
            row.update(status="not run", why=arm.not_run)
        elif row["status"] == "offered" and arm is None:
            row.update(
                status="not measured", why="an arm before it settled the search, or beyond --fix-tries"
            )
        elif row["status"] == "offered" and arm is not None:
            row.update(
                status="measured",
                arm=arm.name,
                dir=arm.dir,
                judged_by=arm.judged_by.value,
                speedup=arm.judged_speedup,
                interval=arm.interval(),
                verdict=arm.verdict,
                loss_parity=arm.loss_parity,
                significant=arm.significant,
                kept=kept is not None and arm.dir == kept.dir,
            )
        out.append(row)
    return out


def ladder_line(row: dict[str, Any]) -> str:
    """'ladder: [gpu.place_slow] bf16_autocast (torch.autocast ...): measured 1.42x (95 % CI
    1.30-1.55x), faster and numerically equivalent, loss parity passed: kept'."""
    head = f"ladder: [{row['finding']}] {row.get('rung') or 'no rung'}"
    if row.get("switch"):
        head += f" ({row['switch']})"
    if row["status"] != "measured":
        return f"{head}: {row['status']}: {row['why']}"
    speed = f"{row['speedup']:.2f}x" if row.get("speedup") is not None else "n/a"
    ci = row.get("interval")
    if ci and len(ci) == 2:
        speed += f" (95 % CI {ci[0]:.2f}-{ci[1]:.2f}x)"
    parity = {True: "loss parity passed", False: "loss parity failed", None: "loss parity not checked"}
    return (
        f"{head}: measured {speed} by the {row['judged_by']}, {row.get('verdict')}, "
        f"{parity[row.get('loss_parity')]}: {'kept' if row.get('kept') else 'not kept'}"
    )
