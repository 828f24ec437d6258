"""One candidate arm of `diagnose --fix`: prepare it, run it, compare it with the baseline,
measure it again where the judge says the first pair does not settle it, and write its
comparison.json and report. What the arm showed is the judge's (analyzers/core/ab_verdict.py): this
module runs and records, it decides nothing."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from traindx.analyzers.core import ab_verdict as judge
from traindx.analyzers.core.ab_verdict import ABVerdict, Arm, ArmEvidence
from traindx.analyzers.core.findings import Finding
from traindx.analyzers.core.savings import predicted_step_time
from traindx.common.errors import UserError
from traindx.derive.ledger import steady_rows
from traindx.derive.run import RunRecord, load_run
from traindx.fixing.plan.planner import PREFER_VAR, Candidate, Plan
from traindx.fixing.run.model import FixOptions, Say, with_options, write_fix_json
from traindx.fixing.run.prepare import apply_commands, last_lines, prepare_candidate, warm_cache
from traindx.judgement import Judgement, judge_run
from traindx.kernel_cache.store import cache as cache_store
from traindx.profiler.launcher import exit_status
from traindx.recipes.ab import judged_comparison, measure_arm, report_view
from traindx.report import outputs


@dataclass
class FixContext:
    """What every arm of one --fix run shares: the job, its measured baseline, where the arms
    go, how they are recorded and reported."""

    command: list[str]
    baseline: RunRecord
    findings: list[Finding]
    root: str
    options: FixOptions
    record_options: Any  # the launcher's Options of every arm
    run_job: Callable[..., int | None]
    say: Say


@dataclass
class ArmRun:
    """A measured arm: the judge's view of it, its comparison, the raw exit code of its job and
    the findings of its own run."""

    arm: Arm
    comparison: dict[str, Any]
    code: int | None
    findings: list[Finding]


@dataclass
class _Prepared:
    """One arm made ready and run: its folder, command, environment, what was done for it."""

    name: str
    dir: str
    candidate: Candidate
    command: list[str]
    extra_env: dict[str, str]
    cwd: str
    records: dict[str, Any]
    precompiled: list[dict[str, Any]]
    apply: list[str]
    code: int | None = 0
    change: dict[str, Any] = field(default_factory=dict)

    @property
    def plan(self) -> Plan:
        return self.candidate.plan

    @property
    def patch(self) -> str | None:
        return (self.records.get("source_patch") or {}).get("patch")


def run_arm(
    ctx: FixContext,
    name: str,
    cand: Candidate,
    alternatives: Sequence[str] = (),
    searched: Sequence[Arm] = (),
) -> ArmRun:
    """Prepare, record, compare and analyze one candidate arm (`searched`: the arms measured
    before it, listed in its comparison)."""
    prep = _prepare(ctx, name, cand)
    if not prep.plan.changes_left:  # its only change failed to apply (the planner's Plan says)
        return _not_run(ctx, prep, alternatives, searched)
    prep.code = ctx.run_job(prep.command, prep.dir, _arm_options(ctx, prep))
    candidate = load_run(prep.dir)
    prep.change = _change(prep, alternatives)
    finding = next((f for f in ctx.findings if f.id == cand.finding), None)
    comparison, arm = _judge(ctx, prep, finding, ctx.baseline, candidate)
    if ctx.options.repeat_inconclusive and judge.worth_repeating(arm) and not comparison.get("interrupted"):
        comparison, arm = _repeat(ctx, prep, finding, (comparison, arm), candidate)
    kept = arm.dir if judge.settles_search(arm) else None
    comparison["search"] = [search_row(a) for a in searched] + [search_row(arm, kept)]
    write_fix_json(os.path.join(prep.dir, "comparison.json"), comparison)
    record, judged, cand_report = analyze_arm(prep.dir, ctx.say, comparison=comparison)
    ctx.say("summary", name, record=record, judgement=judged, report=cand_report)
    ctx.say("comparison", name, comparison=comparison, arm=prep.dir)
    return ArmRun(arm, comparison, prep.code, list(judged.findings))


def _not_run(
    ctx: FixContext, prep: _Prepared, alternatives: Sequence[str], searched: Sequence[Arm]
) -> ArmRun:
    """An arm whose only change failed to apply, recorded as not run (its comparison.json, the
    search's rows, the terminal): run, it would measure the job unchanged as the change."""
    failed = [f"{s['step']} failed: {s.get('error')}" for s in prep.records["steps"] if not s.get("ok")]
    reason = "; ".join(failed) + "; nothing else is left in its plan to measure"
    cand = prep.candidate
    arm = Arm(
        name=prep.name,
        dir=prep.dir,
        finding=cand.finding,
        mechanism=cand.mechanism,
        summary=cand.summary,
        exit_code=None,
        judgement=judge.Judgement(judge.Measure.MEDIAN, None, False),
        predicted_saving_s_per_step=cand.predicted_saving_s_per_step,
        verdict=judge.not_run(reason).text(),
        not_run=reason,
    )
    comparison = {
        "verdict": arm.verdict,
        "not_run": reason,
        "change": _change(prep, alternatives),
        "search": [search_row(a) for a in searched] + [search_row(arm)],
    }
    write_fix_json(os.path.join(prep.dir, "comparison.json"), comparison)
    ctx.say("warning", f"{prep.name}: not run: {reason}")
    return ArmRun(arm, comparison, None, [])


def _prepare(ctx: FixContext, name: str, cand: Candidate) -> _Prepared:
    """Announce the arm's change, make what it needs, warm its kernel cache."""
    plan, say = cand.plan, ctx.say
    say("stage", f"{name}: [{cand.finding}] ({cand.mechanism}) {cand.summary}")
    for line in plan.applied:
        say("step", f"apply: {line}")
    if plan.command_changed:
        say("step", f"candidate command: {shlex.join(plan.command)}")
    for var, value in plan.env.items():
        say("step", f"candidate env: {var}={value}")
    for line in plan.warnings:
        say("warning", line)
    options = ctx.options
    command, env, cwd, records = prepare_candidate(
        plan,
        ctx.root,
        say,
        ctx.record_options.cwd,
        out=options.out,
        wheels=options.wheels,
        arm=name,
        link_big=options.confine == "namespace",
    )
    arm_dir = os.path.join(ctx.root, name)
    os.makedirs(arm_dir)
    precompiled = [_precompile(plan, source, env, say, _view(ctx, arm_dir)) for source in plan.precompile]
    apply = apply_commands(plan, records, ctx.command)
    extra = dict(ctx.record_options.extra_env or {})
    extra.update(env)
    return _Prepared(name, arm_dir, cand, command, extra, cwd, records, precompiled, apply)


def _view(ctx: FixContext, run_dir: str) -> list[str]:
    """The argv prefix of run_dir's private view (fix_confine.Confiner.view_for), [] if none."""
    view_for = getattr(ctx.run_job, "view_for", None)
    return list(view_for(run_dir)) if view_for is not None else []


def _precompile(
    plan: Plan, source: str, cand_env: dict[str, str], say: Say, wrap: list[str]
) -> dict[str, Any]:
    """The warm-up in the arm's view: the kernels it compiles are the arm's writes (the job's
    cache seen there), never the user's cache's unless the arm is kept with --keep-outputs.
    A cache folder someone else controls is not used: FA4 would load its .o files as native
    code into the candidate, which then runs without the persistent cache."""
    env = dict(os.environ)
    env.update(cand_env)
    folder = env.get(cache_store.DIR_VAR) or str(cache_store.default_cache_dir(env))
    problem = cache_store.cache_dir_problem(folder)
    if problem:
        cand_env[cache_store.ENABLE_VAR] = "0"
        plan.warnings.append(
            f"kernel cache {folder} not used: {problem}; the candidate runs without FA4's "
            "persistent cache (it compiles its kernels)"
        )
        say("warning", plan.warnings[-1])
        return {"from_run": source, "exit_code": None, "output_tail": problem}
    rc, output = warm_cache(source, env, say, wrap)
    if rc != 0:
        plan.warnings.append(
            f"kernel-cache warm --from-run {source} exited with {rc}: "
            f"{last_lines(output)}; the candidate runs with whatever "
            "the cache holds (FA4 compiles what is missing)"
        )
        say("warning", plan.warnings[-1])
    return {"from_run": source, "exit_code": rc, "output_tail": output}


def _arm_options(ctx: FixContext, prep: _Prepared) -> Any:
    return with_options(ctx.record_options, extra_env=prep.extra_env, cwd=prep.cwd)


def _change(prep: _Prepared, alternatives: Sequence[str]) -> dict[str, Any]:
    """The comparison's "change": what was applied, tried, left to do by hand, and kept how."""
    plan = prep.plan
    deferred = [line.replace("<the candidate run>", prep.dir) for line in plan.deferred]
    change: dict[str, Any] = {
        "applied": plan.applied,
        "alternatives": list(dict.fromkeys(plan.alternatives + list(alternatives))),
        "instructions": plan.instructions + deferred,
        "warnings": plan.warnings,
        "precompiled": [
            f"kernel-cache warm --from-run {p['from_run']} (exit {p['exit_code']})" for p in prep.precompiled
        ],
    }
    change["steps"] = prep.records["steps"] + [
        {
            "step": "kernel-cache warm",
            "ok": p["exit_code"] == 0,
            "from_run": p["from_run"],
            "error": None if p["exit_code"] == 0 else last_lines(p["output_tail"]),
        }
        for p in prep.precompiled
    ]
    change["apply"] = prep.apply
    return change


def _judge(
    ctx: FixContext, prep: _Prepared, finding: Finding | None, base_run: RunRecord, cand_run: RunRecord
) -> tuple[dict[str, Any], Arm]:
    """The comparison of the two runs and the arm as the judge sees it."""
    plan = prep.plan
    comparison, verdict = judged_comparison(base_run, cand_run, change=prep.change)
    comparison["precompile_runs"] = prep.precompiled
    comparison["changes"] = attribute_changes(plan.changes, comparison, base_run, ctx.findings, cand_run)
    comparison["apply"] = prep.apply
    if prep.patch:
        comparison["fix_patch"] = prep.patch
    if prep.records.get("overlay"):
        comparison["overlay"] = prep.records["overlay"]
    code = exit_status(prep.code)
    signals = interrupted_by(prep.dir)
    if signals:
        verdict = judge.interrupted(signals)
        comparison["verdict"] = verdict.text()
        comparison["interrupted"] = signals
        comparison["problems"].append(
            f"the arm was interrupted ({', '.join(signals)} forwarded to its job, exit {code}): "
            "what it measured is no judgement of the change"
        )
    elif code != 0:
        verdict = judge.crashed(code)
        comparison["verdict"] = verdict.text()
        tail = _stderr_tail(prep.dir)
        if tail:
            comparison["problems"].append(f"the candidate's last error lines: {tail}")
        if any(c["mechanism"] == "source" for c in plan.changes) and plan.fallbacks:
            comparison["problems"].append(
                f"the source patch changed what the job's code expects downstream; prove "
                f"the diagnosis without it: {PREFER_VAR}=runtime diagnose --fix --run-dir "
                f"{ctx.root} (the baseline is reused), then adapt fix.patch"
            )
    elif (comparison.get("loss_parity") or {}).get("passed") is False:
        comparison["problems"].append(
            "loss parity failed: this change alters the numerics; it is reported, not kept"
        )
    return comparison, arm_of(
        prep.name, prep.dir, prep.candidate, comparison, verdict, code, prep.patch, finding
    )


def interrupted_by(run_dir: str) -> list[str]:
    """The signals diagnose forwarded to the job of the run in run_dir (a Ctrl-C, a SIGTERM):
    the user's, not the change's."""
    try:
        with open(os.path.join(run_dir, "manifest.json"), encoding="utf-8") as f:
            signals = json.load(f).get("signals_forwarded")
    except (OSError, ValueError, AttributeError):
        return []
    return [str(s) for s in signals] if isinstance(signals, list) else []


def arm_of(
    name: str,
    arm_dir: str,
    cand: Candidate,
    comparison: dict[str, Any],
    verdict: ABVerdict,
    code: int | None,
    patch: str | None,
    finding: Finding | None = None,
) -> Arm:
    """The arm's numbers, read off its comparison, and the judge's judgement of them."""
    change = (comparison.get("changes") or [{}])[0]
    base = comparison.get("baseline") or {}
    cand_arm = comparison.get("candidate") or {}
    values = comparison.get("window_values_s") or {}
    parity = (comparison.get("loss_parity") or {}).get("passed")
    evidence = ArmEvidence(
        exit_code=code,
        verdict=verdict,
        statistic=judge.Measure.of(comparison.get("speedup_statistic")),
        speedup=comparison.get("speedup"),
        parity_passed=parity,
        window_values=(values.get("baseline") or [], values.get("candidate") or []),
        first_steps=((base.get("step_times_s") or [None])[0], (cand_arm.get("step_times_s") or [None])[0]),
        periodic=judge.periodic_cost(finding, comparison),
        precompile=bool(getattr(cand.plan, "precompile", None)),
        leak=judge.leak_finding(finding),
        memory_slopes=judge.memory_slopes(comparison),
        speedup_ci95=comparison.get("speedup_ci95"),
    )
    return Arm(
        name=name,
        dir=arm_dir,
        finding=cand.finding,
        mechanism=cand.mechanism,
        summary=cand.summary,
        exit_code=code,
        judgement=judge.judge_arm(evidence),
        predicted_saving_s_per_step=change.get(
            "predicted_saving_s_per_step", cand.predicted_saving_s_per_step
        ),
        predicted_step_time_s=change.get("predicted_step_time_s"),
        measured_mean_step_s=change.get("measured_mean_step_s"),
        baseline_median_step_s=base.get("median_step_s"),
        baseline_mean_step_s=base.get("mean_step_s"),
        measured_step_time_s=cand_arm.get("median_step_s"),
        speedup=comparison.get("speedup"),
        speedup_ci95=comparison.get("speedup_ci95"),
        verdict=comparison.get("verdict"),
        loss_parity=parity,
        patch=patch,
    )


def _repeat(
    ctx: FixContext,
    prep: _Prepared,
    finding: Finding | None,
    first_judged: tuple[dict[str, Any], Arm],
    candidate: RunRecord,
) -> tuple[dict[str, Any], Arm]:
    """The arm measured again, the candidate then the baseline (A B B A); each side judged by
    its quicker run (judge.quicker), or by the first pair when a repeated run failed."""
    comparison, arm = first_judged
    first = first_pair(arm)
    first_text = judge.judged_text(arm.judged_by, arm.judged_speedup, arm.interval(), arm.verdict)
    ctx.say(
        "info",
        f"{prep.name}: not proven ({first_text}): measured again, the candidate "
        "then the baseline (A B B A); each side is judged by its quicker run",
    )
    again_dir, base_again_dir = prep.dir + "-again", baseline_again_dir(ctx.root, prep.name)
    os.makedirs(again_dir)
    for source in prep.plan.precompile:  # the repeat starts in a view of its own: warmed again
        _precompile(prep.plan, source, dict(prep.extra_env), ctx.say, _view(ctx, again_dir))
    again_code = ctx.run_job(prep.command, again_dir, _arm_options(ctx, prep))
    os.makedirs(base_again_dir)
    stopped = interrupted_by(again_dir)
    base_again_code = None if stopped else ctx.run_job(ctx.command, base_again_dir, ctx.record_options)
    stopped = stopped or interrupted_by(base_again_dir)
    if stopped:  # the user stopped the repeat: the first pair stands, and the search ends
        comparison["interrupted"] = stopped
        comparison["problems"].append(
            f"measured again, but interrupted ({', '.join(stopped)}): judged by the first pair"
        )
    elif exit_status(again_code) == 0 and exit_status(base_again_code) == 0:
        base_pick = _quicker(ctx.baseline, load_run(base_again_dir), arm.judged_by)
        cand_pick = _quicker(candidate, load_run(again_dir), arm.judged_by)
        comparison, arm = _judge(ctx, prep, finding, base_pick, cand_pick)
        comparison["problems"].append(
            f"measured twice (the candidate then the baseline again: A B B A); the first "
            f"pair gave {first_text}; each side is judged by its quicker run "
            f"(another job's load only adds time): the baseline of {base_pick.path}, the "
            f"candidate of {cand_pick.path}"
        )
    else:
        comparison["problems"].append(
            f"measured again, but a repeated arm failed (candidate exit "
            f"{exit_status(again_code)}, baseline exit {exit_status(base_again_code)}): "
            "judged by the first pair"
        )
    arm.repeat = {
        "first": first,
        "candidate": again_dir,
        "baseline": base_again_dir,
        "judged_on": [comparison["baseline"]["run"], comparison["candidate"]["run"]],
    }
    return comparison, arm


def first_pair(arm: Arm) -> dict[str, Any]:
    """How the first pair judged a repeated arm (fix.json's repeat.first)."""
    row = arm.to_row()
    return {
        k: row.get(k) for k in ("judged_by", "judged_speedup", "speedup_ci95", "mean_speedup_ci95", "verdict")
    }


def baseline_again_dir(root: str, arm: str) -> str:
    suffix = arm[len("candidate") :] if arm.startswith("candidate") else "-" + arm
    return os.path.join(root, f"baseline-again{suffix}")


def _quicker(first: RunRecord, second: RunRecord, judged_by: judge.Measure) -> RunRecord:
    """Of two recordings of one arm, the quicker (the judge's rule) by their steady steps."""

    def typical(run: RunRecord) -> float:
        summary, values = measure_arm(run)
        return judge.typical_step_s(summary.get("median_step_s"), list(values), judged_by)

    return judge.quicker(first, second, typical(first), typical(second))


def search_row(arm: Arm, kept: str | None = None) -> dict[str, Any]:
    """The arm's line in a comparison's "search" (every arm measured)."""
    row = arm.to_row()
    out = {
        k: row.get(k)
        for k in ("arm", "finding", "mechanism", "verdict", "predicted_step_time_s", "measured_step_time_s")
    }
    out["speedup"] = arm.judged_speedup
    out["kept"] = kept is not None and arm.dir == kept
    if arm.not_run is not None:
        out["not_run"] = arm.not_run
    return out


def analyze_arm(
    run_dir: str, say: Say, comparison: dict[str, Any] | None = None
) -> tuple[RunRecord, Judgement, str | None]:
    """Load, judge, write findings.json and report.html (with the comparison, if any)."""
    record = load_run(run_dir)
    try:
        judged, report_path = outputs.analyze_and_write(record)
    except UserError:
        raise
    except Exception as exc:  # a broken report must not stop the loop: the findings decide
        say("warning", f"internal error writing the report of {run_dir}: {type(exc).__name__}: {exc}")
        judged, report_path = judge_run(record), None
        outputs.write_findings(record, judged)
        return record, judged, report_path
    if comparison is not None:
        report_path = _draw_comparison(record, judged, comparison, say) or report_path
    return record, judged, report_path


def _draw_comparison(
    record: RunRecord, judged: Judgement, comparison: dict[str, Any], say: Say
) -> str | None:
    """The report redrawn with the comparison; None where it could not be."""
    try:
        from traindx.report.html import write_report  # the report's own dependencies may be missing
    except ImportError:
        return None
    try:
        return write_report(record, judged, comparison=report_view(comparison))
    except Exception as exc:  # the comparison is already in comparison.json
        say("warning", f"internal error drawing the comparison into the report: {type(exc).__name__}: {exc}")
        return None


def _stderr_tail(run_dir: str, n: int = 3) -> str:
    """The last lines the job wrote to stderr (log.txt keeps both streams, tagged)."""
    try:
        with open(os.path.join(run_dir, "log.txt"), encoding="utf-8", errors="replace") as f:
            lines = [
                line.split(" ", 2)[2].rstrip()
                for line in f
                if line.split(" ", 2)[1:2] == ["e"] and len(line.split(" ", 2)) == 3
            ]
    except OSError:
        return ""
    return " | ".join(line.strip() for line in lines[-n:] if line.strip())[:600]


def _mean_steady_step(run: RunRecord) -> float | None:
    led = steady_rows(run)
    return float(led.groupby("rank")["wall_s"].mean().max()) if len(led) else None


def attribute_changes(
    changes: list[dict[str, Any]],
    comparison: dict[str, Any],
    baseline: RunRecord | None = None,
    findings: Sequence[Finding] = (),
    candidate: RunRecord | None = None,
) -> list[dict[str, Any]]:
    """Per applied change: the predicted step time (from the baseline's time ledger: the mean
    steady step minus the ledger lines the fix removes; the prescription's expected gain where
    the finding names no ledger line) and the measured one. With several changes in one
    candidate the measured figure is their joint effect: said so, not split by guess."""
    base = (comparison.get("baseline") or {}).get("median_step_s")
    cand = (comparison.get("candidate") or {}).get("median_step_s")
    by_id = {f.id: f for f in findings}
    live = [c for c in changes if not c.get("failed")]
    out = []
    for c in changes:
        gain = c.get("predicted_saving_s_per_step")
        row = dict(c)
        row["predicted_step_time_s"] = max(base - gain, 0.0) if base is not None and gain else None
        finding = by_id.get(c.get("finding"))  # type: ignore[arg-type]
        if baseline is not None and finding is not None:
            _ledger_prediction(row, c, gain, comparison, baseline, finding, candidate)
        failed = bool(c.get("failed"))
        row["measured_step_time_s"] = cand if not failed else None
        row["measured_saving_s_per_step"] = (
            base - cand if base is not None and cand is not None and not failed else None
        )
        row["measured_jointly_with"] = [o["finding"] for o in live if o is not c] if not failed else []
        out.append(row)
    return out


def _ledger_prediction(
    row: dict[str, Any],
    change: dict[str, Any],
    gain: float | None,
    comparison: dict[str, Any],
    baseline: RunRecord,
    finding: Finding,
    candidate: RunRecord | None,
) -> None:
    """The time ledger's prediction of a change's step time, into its row (and the measured
    mean it is read against)."""
    try:
        pred = predicted_step_time(baseline, finding, gain=gain)
    except Exception as exc:  # a prediction must never cost the comparison
        pred = {"method": f"no ledger prediction: {type(exc).__name__}: {exc}"}
    row["ledger_prediction"] = pred
    if pred.get("predicted_step_s") is None:
        return
    row["predicted_saving_s_per_step"] = removed = pred.get("removed_s")
    row["predicted_step_time_s"] = pred["predicted_step_s"]
    # a mean step less what the fix removes, measured the same way on the candidate: the time
    # ledger's steady steps (the lines it removes are priced over them); for a CUDA job both
    # arms' means over the comparison's window on the GPU's clock (recipes.ab.step_times: the
    # host's steps end before the GPU's), the same steps left out
    base_arm = comparison.get("baseline") or {}
    on_gpu = base_arm.get("step_source") == "shim:gpu"
    if on_gpu and base_arm.get("mean_step_s") is not None and removed is not None:
        row["predicted_step_time_s"] = max(
            base_arm["mean_step_s"] - removed, pred.get("gpu_busy_floor_s") or 0.0
        )
    if not change.get("failed"):
        if on_gpu:
            row["measured_mean_step_s"] = (comparison.get("candidate") or {}).get("mean_step_s")
        else:
            row["measured_mean_step_s"] = _mean_steady_step(candidate) if candidate is not None else None
