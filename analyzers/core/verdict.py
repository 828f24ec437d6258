"""The run's verdict: one finding, judged after every analyzer and the cause/symptom linking ran:
`verdict.cause` (the root to act on first), `verdict.healthy` or `verdict.no_steps`. The report
and the terminal render it; they never decide the headline themselves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import NOTE, VERDICT_PREFIX, Finding, is_problem, reading_order
from traindx.common.units import fmt_s
from traindx.derive import ledger as L
from traindx.derive.steptables import steady_median, step_table, steps_per_rank

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

_VERDICTS = ("verdict.cause", "verdict.no_steps", "verdict.healthy", "verdict.inefficient")
DECLARATION = Declaration(name="verdict", order=20, ids=_VERDICTS, judge=True, not_causes=_VERDICTS)


def _mean_steady_step(run: RunRecord) -> float | None:
    """The mean steady step of the slowest rank, from the ledger (the unit findings' savings are
    in); None without a ledger."""
    try:
        steady = L.steady_rows(run)
        return float(steady.groupby("rank")["wall_s"].mean().max()) if len(steady) else None
    except Exception:  # a run without spans still gets a verdict, priced on the median
        return None


def _gain(f: Finding) -> float:
    """What acting on a finding saves per step: its best prescription's expected gain, else the
    time it loses."""
    gains = [p.expected_gain_s_per_step for p in f.prescriptions if p.expected_gain_s_per_step is not None]
    return max(gains) if gains else (f.seconds_lost_per_step or 0.0)


def _pick(findings: list[Finding]) -> Finding | None:
    """The root finding to act on first: the one with a prescription whose fix saves the most
    (ties: reading order), else the first root problem. Critical ones come first: a run that
    will stop (memory that runs out within hours) is worse than any speed it could gain."""
    roots = [f for f in reading_order(findings) if is_problem(f) and f.cause is None]
    prescribed = [f for f in roots if f.prescriptions]
    prescribed = [f for f in prescribed if f.severity == "critical"] or prescribed
    if prescribed:
        return max(prescribed, key=_gain)  # max keeps the first of equals: reading order
    return roots[0] if roots else None


def _cause_verdict(run: RunRecord, top: Finding, median: float | None, counts: dict[str, Any]) -> Finding:
    """The verdict that names the root finding to act on first, with its first fix's speed-up."""
    p = top.prescriptions[0] if top.prescriptions else None
    gain = (
        p.expected_gain_s_per_step
        if p is not None and p.expected_gain_s_per_step is not None
        else top.seconds_lost_per_step
    )
    # savings are per mean step (the ledger's lines): the speed-up is against the mean steady
    # step when the ledger gives one and the saving fits in it, else the median
    mean = _mean_steady_step(run)
    step_s = mean if mean and gain and gain <= mean else median
    speedup = step_s / (step_s - gain) if gain and step_s and 0 < gain < step_s else None
    headline = p.summary if p is not None else top.title
    return Finding(
        id="verdict.cause",
        title=headline,
        severity=NOTE,
        analyzer="verdict",
        summary=(
            f"The change to make first: {headline} (why: {top.title})."
            if p is not None
            else f"The main problem, with no prescription: {top.title}."
        ),
        seconds_lost_per_step=top.seconds_lost_per_step,
        share_of_step=top.share_of_step,
        ranks=top.ranks,
        evidence={
            "top": top.id,
            "top_title": top.title,
            "top_severity": top.severity,
            "seconds_per_step": top.seconds_lost_per_step,
            "prescription": 0 if p else None,
            "gain_s": gain,
            "step_s": step_s,
            # a saving well under the time lost says why (the pricing's words)
            "saving_limit": top.evidence.get("saving_limit")
            if gain is not None and top.seconds_lost_per_step and gain < top.seconds_lost_per_step
            else None,
            "step_statistic": "mean" if step_s is not None and step_s == mean else "median",
            "after_step_s": (step_s - gain if speedup and step_s is not None and gain is not None else None),
            "speedup": speedup,
            **counts,
        },
    )


def _inefficient_verdict(slow_gpu: Finding, median: float | None, counts: dict[str, Any]) -> Finding:
    """No cause found, but the busy GPU is far from the device's peak: not healthy."""
    mfu = slow_gpu.evidence.get("mfu")
    back = slow_gpu.evidence.get("holds_back") or []
    held = "; ".join(f"{b['what']} {b['share']:.0%} of the step" for b in back[:3])
    reach = f"at {mfu:.1%} of its BF16 peak (MFU)" if mfu is not None else "far from its peak"
    return Finding(
        id="verdict.inefficient",
        title=f"No slowdown cause found, but the GPU runs {reach}" + (f": {held}" if held else ""),
        severity=NOTE,
        analyzer="verdict",
        summary=(
            f"Median step {fmt_s(median) if median is not None else '?'}; tensor-core math "
            f"{slow_gpu.evidence.get('tensor_math_share') or 0.0:.0%} of the step. No analyzer named "
            "a fix; what holds the GPU back is listed (largest first)."
        ),
        evidence={**counts, "top": slow_gpu.id, "mfu": mfu, "holds_back": back},
    )


def _shim_never_loaded(run: RunRecord) -> bool:
    """The shim was asked for and no process of the job ran it (an isolated interpreter:
    python -I/-E/-S, env -i; or not a Python job): steps were never recorded in-process."""
    return bool((run.manifest.get("options") or {}).get("shim")) and "shim" in run.missing


def _no_shim_verdict(run: RunRecord, counts: dict[str, Any]) -> Finding:
    """No steps because nothing could record them, not because the job trained none."""
    status = run.manifest.get("exit_code")
    return Finding(
        id="verdict.no_shim",
        title="No steps measured: the shim could not be loaded in the job's interpreter",
        severity=NOTE,
        analyzer="verdict",
        summary=(
            "The job ran without traindx's in-process recorder (an isolated interpreter: "
            "python -I, -E or -S, or an emptied environment such as env -i, ignores the "
            "PYTHONPATH that loads it): step times come from py-spy and the log only, and neither "
            "showed steps here; whether the job trained is not known"
            + (f" (it exited with code {status})" if status not in (None, 0) else "")
            + ". Run it without the isolation flag to measure it."
        ),
        evidence={**counts, "exit_code": status, "shim": run.missing.get("shim")},
    )


def _unreadable_files(run: RunRecord) -> bool:
    """A process of the job has paths whose bytes are not UTF-8 (the shim's process_start says):
    py-spy could not read its file names, so no finding by source line was possible."""
    starts = run.of_type("process_start")
    return "undecodable_paths" in starts and bool(
        starts["undecodable_paths"].fillna(False).astype(bool).any()
    )


def _unreadable_verdict(n_steps: int, median: float | None, counts: dict[str, Any]) -> Finding:
    """No cause found where the stacks could not name the job's files: not 'Healthy'."""
    return Finding(
        id="verdict.unreadable_files",
        title=f"No slowdown cause found in {n_steps} steps, but the job's own source lines could not be read",
        severity=NOTE,
        analyzer="verdict",
        summary=(
            f"Median step {fmt_s(median) if median is not None else '?'}. The job's interpreter "
            "has file paths whose bytes are not UTF-8 (a folder named in another encoding), so "
            "py-spy's stacks lost the job's file names and the causes found by source line (host "
            "work in the loop, say) could not be looked for. Rename the folder in UTF-8 to have them."
        ),
        evidence={**counts, "undecodable_paths": True},
    )


def judge(run: RunRecord, findings: list[Finding]) -> Finding:
    """The verdict of a run from its (linked, priced) findings."""
    findings = [f for f in findings if not f.id.startswith(VERDICT_PREFIX)]
    table, source = step_table(run)
    n_steps, ranks = steps_per_rank(table), int(table["rank"].nunique()) if len(table) else 0
    median = steady_median(table)
    counts = {"steps": n_steps, "ranks": ranks, "median_step_s": median, "step_source": source}
    top = _pick(findings)
    if top is not None:
        return _cause_verdict(run, top, median, counts)
    if not n_steps and _shim_never_loaded(run):
        return _no_shim_verdict(run, counts)
    if not n_steps:
        status = (run.manifest or {}).get("exit_code")
        return Finding(
            id="verdict.no_steps",
            title="No training steps were recorded: nothing to measure",
            severity=NOTE,
            analyzer="verdict",
            summary=(
                "The job exited before any optimizer step finished"
                + (f" (exit code {status})" if status not in (None, 0) else "")
                + "."
            ),
            evidence={**counts, "exit_code": status},
        )
    slow_gpu = next(
        (f for f in findings if f.id == "gpu.efficiency" and f.evidence.get("efficient") is False), None
    )
    if slow_gpu is not None:
        return _inefficient_verdict(slow_gpu, median, counts)
    if _unreadable_files(run):
        return _unreadable_verdict(n_steps, median, counts)
    title = f"Healthy: no slowdown found in {n_steps} steps"
    if median is not None:
        title += f" (median step {fmt_s(median)})"
    return Finding(
        id="verdict.healthy",
        title=title,
        severity=NOTE,
        analyzer="verdict",
        summary=(
            f"{n_steps} steps on {ranks} rank{'s' if ranks != 1 else ''}, median step "
            f"{fmt_s(median) if median is not None else '?'}; no analyzer found a "
            "finding above info: nothing to change."
        ),
        evidence=counts,
    )


def analyze(run: RunRecord, findings: list[Finding] | None = None) -> list[Finding]:
    """Registry entry: [the verdict] (run last, over every other finding)."""
    return [judge(run, list(findings or []))]
