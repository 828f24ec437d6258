"""The judged document of a run: everything the judge decides that a reader is shown, made once.

`judge_run(run)` runs the analyzers (traindx.analyzers.analyze) and completes what they leave to
the reader: the verdict (when the findings hold none: a findings.json from before it was a
finding, a hand-made list), each step's cause (analyzers/step_causes.py), and what `diagnose
--fix` would do with each prescription (its own candidate order, analyzers/fixplan.py). The
terminal summary, the HTML report and findings.json render this one `Judgement`; they never
call the judge themselves (the import contract in pyproject.toml holds the report to it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from traindx.analyzers import analyze
from traindx.analyzers.core import verdict as run_verdict
from traindx.analyzers.core.findings import JSON, VERDICT_PREFIX, Finding, reading_order
from traindx.analyzers.core.step_causes import CAUSES, judge_steps
from traindx.analyzers.core.step_causes import StepCauses as StepCauses  # the document's type, re-exported
from traindx.derive.steptables import compile_spans, run_t0
from traindx.fixing.plan.planner import candidate_plans, ladder_wants

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

__all__ = ["FixMark", "FixPlan", "Judgement", "PlannedFix", "StepCauses", "fix_plans", "judge_run"]

# what --fix does with a prescription: the first candidate it measures, one it tries next (within
# --fix-tries), one it leaves as an alternative, or one only a person can make
# (a rung of --fix's ladder of global switches it weighed and did not try: "skipped", with why)
FixMark = Literal["applied", "next", "alternative", "by_hand", "skipped"]
FIX_TRIES_DEFAULT = 3  # diagnose --fix-tries' default: the candidates measured in turn


@dataclass(frozen=True)
class PlannedFix:
    """A candidate the --fix planner builds itself from a finding (the job's own flag for a
    literal, an edit it derives), which none of the finding's prescriptions names."""

    summary: str
    mechanism: str
    fix: FixMark


@dataclass(frozen=True)
class FixPlan:
    """What `diagnose --fix` would do with one finding: a mark per prescription (in order) and
    the candidates it builds itself."""

    marks: tuple[FixMark, ...]
    planned: tuple[PlannedFix, ...] = ()

    def to_dict(self) -> JSON:
        return {
            "prescriptions": list(self.marks),
            "planned": [{"summary": p.summary, "mechanism": p.mechanism, "fix": p.fix} for p in self.planned],
        }


@dataclass(frozen=True, eq=False)  # eq=False: its step table is a DataFrame (no truth value)
class Judgement:
    """A run judged: what every renderer shows, none of it decided again by the renderer.

    findings: every finding ranked as the judge ranks them (findings.json's order), the verdict
        among them; reading: the same findings in the order a person reads them (root causes,
        each symptom under its cause, critical first), the verdict left out; verdict: the
        run's verdict finding (analyzers/verdict.py); plans: finding id -> what --fix would do
        with it (empty where it cannot plan: no command recorded, a planner that failed);
        steps: each step's cause, the median and the slow threshold; causes: a step cause ->
        its name for a person."""

    findings: tuple[Finding, ...]
    reading: tuple[Finding, ...]
    verdict: Finding
    plans: Mapping[str, FixPlan]
    steps: StepCauses
    causes: Mapping[str, str] = field(default_factory=lambda: dict(CAUSES))

    def findings_json(self) -> list[JSON]:
        """findings.json: one entry per finding (Finding.to_dict, in `findings` order) with its
        --fix plan under "fix" where it has one (a prescription, a planned candidate), and the
        verdict's entry with the step causes' summary under "steps" (the per-step rows are the
        report's, not this file's)."""
        out = []
        for f in self.findings:
            entry = f.to_dict()
            plan = self.plans.get(f.id)
            if plan is not None and (plan.marks or plan.planned):
                entry["fix"] = plan.to_dict()
            if f.id == self.verdict.id:
                entry["steps"] = self.steps_summary()
            out.append(entry)
        return out

    def steps_summary(self) -> JSON:
        """Where step times come from, the median step, the slow threshold, and how many steps
        (of every rank) each cause names."""
        table = self.steps.table
        counts = table["cause"].value_counts(sort=False) if len(table) else None
        return {
            "source": self.steps.source,
            "median_s": self.steps.median_s,
            "slow_threshold_s": self.steps.slow_threshold_s,
            "causes": {str(c): int(n) for c, n in counts.items()} if counts is not None else {},
        }


def judge_run(run: RunRecord, findings: Sequence[Finding] | None = None) -> Judgement:
    """The run judged once. findings: those already judged (a findings.json read back, the live
    judge's pass), completed here rather than judged again; None: the analyzers run."""
    found = list(analyze(run) if findings is None else findings)
    verdict = next((f for f in found if f.id.startswith(VERDICT_PREFIX)), None)
    if verdict is None:
        verdict = run_verdict.judge(run, found)
        found.append(verdict)
    t0 = run_t0(run)
    # in start order, as the report lists them: the per-step sums add up in the same order
    spans = sorted(compile_spans(run, t0), key=lambda e: float(e["start_s"]))
    return Judgement(
        findings=tuple(found),
        reading=tuple(f for f in reading_order(found) if not f.id.startswith(VERDICT_PREFIX)),
        verdict=verdict,
        plans=fix_plans(run, [f for f in found if not f.id.startswith(VERDICT_PREFIX)]),
        steps=judge_steps(run, t0, spans),
    )


class PlannedRun(Protocol):
    """What the --fix planner reads of a run: its manifest (the command, its folder) and path."""

    @property
    def manifest(self) -> Mapping[str, Any]: ...

    @property
    def path(self) -> str: ...


def fix_plans(
    run: PlannedRun, findings: Sequence[Finding], tries: int = FIX_TRIES_DEFAULT
) -> dict[str, FixPlan]:
    """What `diagnose --fix` would do with each finding's prescriptions, from the candidates its
    own loop measures (fixplan.candidate_plans: the first is applied, the next ones are tried in
    turn while none gains, up to --fix-tries); a prescription no candidate comes from is an
    alternative (automatic) or by hand. A candidate the planner builds itself is listed under
    `planned`. {} when the plan cannot be made here."""
    try:
        m = run.manifest or {}
        command = m.get("command") or []
        if not isinstance(command, list) or not command:
            return {}
        candidates, listing = candidate_plans(
            command,
            [f for f in findings if f.prescriptions or ladder_wants(f)],
            run.path,
            environ={},
            cwd=m.get("cwd") or None,
        )
    except Exception:  # a planner that cannot plan here: no plans, the report still renders
        return {}
    order: dict[tuple[str, str], int] = {}  # (finding id, summary) -> its first place among the measured
    for i, c in enumerate(candidates):
        order.setdefault((c.finding, c.summary), i)

    def mark(i: int) -> FixMark:
        return "applied" if i == 0 else ("next" if i < tries else "alternative")

    plans: dict[str, FixPlan] = {}
    for f in findings:
        marks: list[FixMark] = []
        own = set()
        for p in f.prescriptions:
            at = order.get((f.id, p.summary))
            if at is not None:
                own.add(p.summary)
                marks.append(mark(at))
            else:
                marks.append("alternative" if p.automatic else "by_hand")
        planned = tuple(
            PlannedFix(c.summary, c.mechanism, mark(i))
            for i, c in enumerate(candidates)
            if c.finding == f.id and c.summary not in own
        ) + tuple(
            PlannedFix(
                f"{row['summary'] or 'the ladder of global switches'}: {row['why']}", "ladder", "skipped"
            )
            for row in listing.ladder
            if row["finding"] == f.id and row["status"] == "skipped"
        )
        plans[f.id] = FixPlan(tuple(marks), planned)
    return plans
