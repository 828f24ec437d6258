"""The A/B verdict: whether a candidate arm beat its baseline, and which arm `--fix` keeps.

The one place these are decided (recipes/ab.py and the --fix runner ask it). Decisions match on
`Outcome`, never on its prose (`ABVerdict.text` renders it). The statistics are derive/stats.py's;
the thresholds are here, and loss parity's in analyzers/core/parity.py."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np

from traindx.analyzers.core.findings import Finding, severity_index
from traindx.derive.stats import mean_speedup

# an arm is "faster" when the speedup is at least this and its 95 % interval excludes 1
MIN_SPEEDUP = 1.05
# a precompile pays off at the start: step 0 at least this many times faster, by this many seconds
FASTER_START_FACTOR = 2.0
FASTER_START_MIN_SAVED_S = 1.0
# a fix for memory that grows every step (a tensor kept with its graph) is judged by the slope:
# kept when the candidate's is at most this share of the baseline's, its step not slower
LEAK_GONE_SHARE = 0.2
REPEAT_SPAN = 1.2  # an interval reaching a 20 % gain does not rule a real one out
UNSURE_SHARE = 0.5  # a win under half its predicted saving: the next candidate is tried too
SAME_GAIN_TOLERANCE = 0.10  # two wins within 10 % of each other: noise on these machines
# lasting fixes first; a runtime shim patch proves the diagnosis, its lasting form is the source
# patch or the upgrade
MECHANISM_ORDER = {"config": 0, "source": 1, "overlay": 2, "runtime": 3, "precompile": 4}


class Outcome(enum.Enum):
    """What an A/B comparison showed (the value: the verdict's text, or its start)."""

    FASTER = "faster and numerically equivalent"
    FASTER_UNCHECKED = "faster, numerics not checked (no losses in the log)"  # no losses logged
    FASTER_NUMERICS_DIFFER = "faster but numerics differ"  # loss parity failed
    FASTER_START = "faster start"  # step 0 only (a precompile), no steady-state gain
    FASTER_START_NUMERICS_DIFFER = "faster start, numerics differ"
    NO_GAIN = "no gain"
    CRASHED = "candidate failed"  # the candidate's job exited non-zero
    INTERRUPTED = "interrupted"  # a signal to diagnose (Ctrl-C, SIGTERM) ended the arm: not judged
    NOT_RUN = "not run"  # its only change failed to apply: the job as it is, no test of the change


class Measure(enum.Enum):
    """What an arm's speedup is judged by (the value: fix.json's "judged_by")."""

    MEDIAN = "median"
    MEAN = "mean"  # the comparison's own statistic: the step times have a period
    PERIODIC_MEAN = "mean (a periodic or occasional cost: the median step is one without it)"
    FIRST_STEP = "the first step (a cold start removed by a warm-up)"
    MEMORY = "the memory's slope (a leak removed; the step time must not be slower)"

    @property
    def by_mean(self) -> bool:
        return self in (Measure.MEAN, Measure.PERIODIC_MEAN)

    @property
    def short(self) -> str:
        """'median', 'mean', 'the first step': the measure's name in a sentence."""
        return str(self.value).split(" (")[0]

    @classmethod
    def of(cls, text: str | None) -> Measure:
        """The measure a fix.json or comparison names (the median where it names none)."""
        try:
            return cls(text or "median")
        except ValueError:
            return cls.MEDIAN


# the outcomes that count as a win: faster, and the numerics not shown to differ
WINS = frozenset({Outcome.FASTER, Outcome.FASTER_UNCHECKED, Outcome.FASTER_START})


@dataclass(frozen=True)
class ABVerdict:
    """An outcome and the numbers its text names."""

    outcome: Outcome
    first_step_speedup: float | None = None  # FASTER_START*: step 0's speedup
    exit_code: int | None = None  # CRASHED: the candidate's exit status
    signals: tuple[str, ...] = ()  # INTERRUPTED: the signals diagnose forwarded to the arm's job
    reason: str = ""  # NOT_RUN: why

    @property
    def is_win(self) -> bool:
        return self.outcome in WINS

    def text(self) -> str:
        """The one-line verdict a user reads (comparison.json's "verdict")."""
        if self.outcome in (Outcome.FASTER_START, Outcome.FASTER_START_NUMERICS_DIFFER):
            text = f"faster start (step 0 {self.first_step_speedup:.1f}× faster), no steady-state gain"
            return text + (
                ", numerics differ" if self.outcome is Outcome.FASTER_START_NUMERICS_DIFFER else ""
            )
        if self.outcome is Outcome.INTERRUPTED:
            return f"interrupted ({', '.join(self.signals)} to the arm's job): not judged"
        if self.outcome is Outcome.NOT_RUN:
            return f"not run: {self.reason}"
        if self.outcome is Outcome.CRASHED:
            return f"candidate failed (exit {self.exit_code}): the change does not work as applied"
        return str(self.outcome.value)


def ab_verdict(
    speedup: float | None,
    ci_low: float | None,
    parity_passed: bool | None,
    first_step_speedup: float | None = None,
    first_step_saved_s: float | None = None,
) -> ABVerdict:
    """The verdict of an A/B comparison: faster when the speedup reaches MIN_SPEEDUP and the
    low end of its interval (ci_low) is above 1; then the loss parity qualifies it (None: neither
    arm logged losses). Not faster in the steady state, a step 0 much quicker is a faster start
    (a precompile's gain)."""
    faster = speedup is not None and speedup >= MIN_SPEEDUP and ci_low is not None and ci_low > 1.0
    if faster:
        if parity_passed is None:  # neither arm logged losses: say so rather than guess
            return ABVerdict(Outcome.FASTER_UNCHECKED)
        return ABVerdict(Outcome.FASTER if parity_passed else Outcome.FASTER_NUMERICS_DIFFER)
    if (
        first_step_speedup is not None
        and first_step_saved_s is not None
        and first_step_speedup >= FASTER_START_FACTOR
        and first_step_saved_s >= FASTER_START_MIN_SAVED_S
    ):
        differ = parity_passed is False
        outcome = Outcome.FASTER_START_NUMERICS_DIFFER if differ else Outcome.FASTER_START
        return ABVerdict(outcome, first_step_speedup=first_step_speedup)
    return ABVerdict(Outcome.NO_GAIN)


def crashed(exit_code: int | None) -> ABVerdict:
    """A candidate that crashed (an unknown flag, a broken env) proves nothing but that."""
    return ABVerdict(Outcome.CRASHED, exit_code=exit_code)


def interrupted(signals: Sequence[str]) -> ABVerdict:
    """An arm the user stopped (the signals diagnose forwarded to its job) says nothing of the
    change: its exit status is the signal's, not the change's."""
    return ABVerdict(Outcome.INTERRUPTED, signals=tuple(signals))


def not_run(reason: str) -> ABVerdict:
    """An arm whose only change could not be applied (fixing/plan: Plan.changes_left): run, it
    would measure the job unchanged against itself and credit the change with the noise."""
    return ABVerdict(Outcome.NOT_RUN, reason=reason)


def verdict(speedup: float | None, ci_low: float | None, parity_passed: bool | None) -> str:
    """The one-line verdict of an A/B comparison of steady steps (ab_verdict's text)."""
    return ab_verdict(speedup, ci_low, parity_passed).text()


# -- one candidate arm of --fix ------------------------------------------------------------------
def periodic_cost(finding: Finding | None, comparison: Mapping[str, Any] | None = None) -> bool:
    """A cost the median cannot see: periodic (a checkpoint every k steps), or in fewer than
    half of the window's steps (a full GC every 7 steps: the median step is a step without
    it; a finding whose evidence says `occasional`: an evaluation now and then). Judged by the
    mean and its bootstrap interval instead."""
    if finding is None:
        return False
    evidence = finding.evidence or {}
    if evidence.get("period") or evidence.get("occasional") or (finding.removes or {}).get("steps"):
        return True
    window = len(((comparison or {}).get("window_values_s") or {}).get("baseline") or ())
    affected = len(finding.steps_affected or ())
    return bool(window and 0 < affected < window / 2)


@dataclass(frozen=True)
class ArmEvidence:
    """What one candidate arm measured against its baseline, as the judge reads it."""

    exit_code: int | None
    verdict: ABVerdict
    statistic: Measure  # the comparison's own speedup statistic: median, or mean for a period
    speedup: float | None
    parity_passed: bool | None
    window_values: tuple[Sequence[float], Sequence[float]]  # (baseline, candidate) seconds
    first_steps: tuple[float | None, float | None]  # (baseline, candidate) step 0 seconds
    periodic: bool = False  # periodic_cost of the arm's finding
    precompile: bool = False  # the arm warms a kernel cache before it runs
    leak: bool = False  # the arm's finding is memory that grows every step
    memory_slopes: tuple[float | None, float | None] = (None, None)  # bytes a step (baseline, candidate)
    speedup_ci95: Sequence[float] | None = None  # the step time's interval


@dataclass(frozen=True)
class Judgement:
    """How an arm was judged: by which measure, its speedup, and whether it is a significant win."""

    judged_by: Measure
    judged_speedup: float | None
    significant: bool
    mean_speedup_ci95: list[float] | None = None  # judged by the mean only
    memory_slopes: list[float] | None = None  # judged by the memory: bytes a step (baseline, candidate)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"judged_by": self.judged_by.value, "judged_speedup": self.judged_speedup}
        if self.judged_by is Measure.PERIODIC_MEAN:
            out["mean_speedup_ci95"] = self.mean_speedup_ci95
        if self.judged_by is Measure.MEMORY:
            out["memory_slopes_bytes_per_step"] = self.memory_slopes
        return out


def judge_arm(evidence: ArmEvidence) -> Judgement:
    """A significant win: the comparison's verdict a win for an arm that ran; for a periodic
    cost the means (MIN_SPEEDUP, interval above 1, parity kept); for a warm-up the first step
    (its gain is the cold start: the steady steps run the same kernels either way)."""
    ran = evidence.exit_code == 0 and evidence.verdict.outcome is not Outcome.INTERRUPTED
    parity_failed = evidence.parity_passed is False
    judgement = Judgement(evidence.statistic, evidence.speedup, ran and evidence.verdict.is_win)
    if evidence.periodic and ran:
        mean, interval = mean_speedup(*evidence.window_values)
        if mean is not None and interval is not None:
            significant = mean >= MIN_SPEEDUP and interval[0] > 1.0 and not parity_failed
            judgement = Judgement(Measure.PERIODIC_MEAN, mean, significant, interval)
    base_first, cand_first = evidence.first_steps
    if evidence.precompile and ran and base_first and cand_first and cand_first > 0:
        first = base_first / cand_first
        judgement = Judgement(Measure.FIRST_STEP, first, first >= MIN_SPEEDUP and not parity_failed)
    if evidence.leak and ran:
        judgement = judge_leak_arm(evidence) or judgement
    return judgement


def leak_finding(finding: Finding | None) -> bool:
    """The finding is memory that keeps growing (its fix is judged by the memory's slope)."""
    return finding is not None and finding.id == "memory.growth"


def memory_slopes(comparison: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """(baseline, candidate) bytes a step from a comparison's "memory_slope"."""
    slope = comparison.get("memory_slope") or {}
    rates = [((slope.get(side) or {}).get("rate_bytes_per_step")) for side in ("baseline", "candidate")]
    return (rates[0], rates[1])


def judge_leak_arm(evidence: ArmEvidence) -> Judgement | None:
    """A fix for memory that grows every step saves memory, not time: significant when the
    candidate's slope is at most LEAK_GONE_SHARE of the baseline's, the numerics kept and its
    step time not slower by 5 % beyond its interval (None without both slopes)."""
    base, cand = evidence.memory_slopes
    if base is None or cand is None or base <= 0:
        return None
    interval = list(evidence.speedup_ci95 or ())
    # slower: by more than a gain must reach (MIN_SPEEDUP), its whole interval too (load moves it)
    slower = evidence.speedup is not None and len(interval) == 2 and interval[1] < 1 / MIN_SPEEDUP
    significant = cand <= LEAK_GONE_SHARE * base and not slower and evidence.parity_passed is not False
    return Judgement(Measure.MEMORY, evidence.speedup, significant, memory_slopes=[base, cand])


@dataclass
class Arm:
    """One measured candidate arm of --fix: its change (finding, mechanism, summary, patch), where
    it ran, and its results. `to_row` is its entry in fix.json's "arms"."""

    name: str
    dir: str
    finding: str | None
    mechanism: str | None
    summary: str | None
    exit_code: int | None
    judgement: Judgement
    predicted_saving_s_per_step: float | None = None
    predicted_step_time_s: float | None = None
    measured_mean_step_s: float | None = None
    baseline_median_step_s: float | None = None
    baseline_mean_step_s: float | None = None
    measured_step_time_s: float | None = None  # the candidate's median
    speedup: float | None = None
    speedup_ci95: list[float] | None = None
    verdict: str | None = None  # the comparison's verdict text
    loss_parity: bool | None = None
    patch: str | None = None
    repeat: dict[str, Any] | None = None  # measured again (A B B A): the first pair, the runs
    after: str | None = None  # a warm-up arm: the kept arm it follows
    not_run: str | None = None  # why the arm was not run (not_run: its only change failed)

    @property
    def significant(self) -> bool:
        return self.judgement.significant

    @property
    def judged_by(self) -> Measure:
        return self.judgement.judged_by

    @property
    def judged_speedup(self) -> float | None:
        return self.judgement.judged_speedup

    def interval(self) -> list[float] | None:
        """The interval of the judged speedup (the mean's where judged by it)."""
        if self.judged_by is Measure.MEMORY:
            return self.speedup_ci95
        if self.judged_by is not Measure.MEDIAN:
            return self.judgement.mean_speedup_ci95
        return self.speedup_ci95

    def to_row(self) -> dict[str, Any]:
        row = self.judgement.to_dict()
        row.update(
            {
                "arm": self.name,
                "dir": self.dir,
                "finding": self.finding,
                "mechanism": self.mechanism,
                "summary": self.summary,
                "exit_code": self.exit_code,
                "predicted_saving_s_per_step": self.predicted_saving_s_per_step,
                "predicted_step_time_s": self.predicted_step_time_s,
                "measured_mean_step_s": self.measured_mean_step_s,
                "baseline_median_step_s": self.baseline_median_step_s,
                "baseline_mean_step_s": self.baseline_mean_step_s,
                "measured_step_time_s": self.measured_step_time_s,
                "speedup": self.speedup,
                "speedup_ci95": self.speedup_ci95,
                "verdict": self.verdict,
                "loss_parity": self.loss_parity,
                "significant": self.significant,
                "patch": self.patch,
            }
        )
        if self.repeat is not None:
            row["repeat"] = self.repeat
        if self.after is not None:
            row["after"] = self.after
        if self.not_run is not None:
            row["not_run"] = self.not_run
        return row

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Arm:
        """An arm from its fix.json row (keys it lacks: unknown)."""
        judgement = Judgement(
            Measure.of(row.get("judged_by")),
            row.get("judged_speedup"),
            bool(row.get("significant")),
            row.get("mean_speedup_ci95"),
            row.get("memory_slopes_bytes_per_step"),
        )
        return cls(
            name=row.get("arm") or "",
            dir=row.get("dir") or "",
            finding=row.get("finding"),
            mechanism=row.get("mechanism"),
            summary=row.get("summary"),
            exit_code=None if row.get("not_run") else int(row.get("exit_code") or 0),
            judgement=judgement,
            **{k: row.get(k) for k in _ROW_NUMBERS},
            repeat=row.get("repeat"),
            after=row.get("after"),
            not_run=row.get("not_run"),
        )


_ROW_NUMBERS = (
    "predicted_saving_s_per_step",
    "predicted_step_time_s",
    "measured_mean_step_s",
    "baseline_median_step_s",
    "baseline_mean_step_s",
    "measured_step_time_s",
    "speedup",
    "speedup_ci95",
    "verdict",
    "loss_parity",
    "patch",
)


def worth_repeating(arm: Arm) -> bool:
    """An arm that ran, kept parity and was not proven faster where the measurement does not
    settle it: its interval reaches REPEAT_SPAN (a real gain not ruled out), or its baseline's
    ledger predicted a significant gain (a result that contradicts its prediction is measured
    again before it is believed). A cold start judged by its first step and a failed or
    diverging arm are not measured again."""
    if arm.significant or arm.exit_code != 0 or arm.loss_parity is False:
        return False
    if arm.judged_by is Measure.FIRST_STEP:
        return False
    slopes = arm.judgement.memory_slopes
    if arm.judged_by is Measure.MEMORY and slopes and slopes[1] <= LEAK_GONE_SHARE * slopes[0]:
        return True  # the memory no longer grows but the step measured slower: load, or the edit?
    interval = arm.interval()
    base = arm.baseline_mean_step_s if arm.judged_by.by_mean else arm.baseline_median_step_s
    saving = arm.predicted_saving_s_per_step
    promised = bool(base and saving and saving >= (1 - 1 / MIN_SPEEDUP) * base)
    return bool((interval and interval[1] >= REPEAT_SPAN) or promised)


def as_predicted(arm: Arm) -> bool:
    """A significant win that reaches at least half the saving predicted for it settles the
    search; a smaller one (a 1.3x where the finding predicted 20x: noise, or a partial fix) lets
    the next candidate be measured, and the faster one is kept. Without a positive prediction,
    significance alone settles it."""
    predicted = arm.predicted_saving_s_per_step
    base, cand = arm.baseline_median_step_s, arm.measured_step_time_s
    if arm.judged_by is not Measure.MEDIAN and arm.judged_speedup:
        return True  # a periodic cost: the medians do not measure it
    if not predicted or predicted <= 0 or base is None or cand is None:
        return True
    return base - cand >= UNSURE_SHARE * predicted


def settles_search(arm: Arm) -> bool:
    """A significant arm that reaches its prediction ends the search and is kept."""
    return arm.significant and as_predicted(arm)


def keep(arms: Sequence[Arm]) -> Arm | None:
    """The arm to keep: the fastest significant win with parity; else the fastest arm that ran,
    kept parity and was not slower than the baseline (marked not significant); None when none
    did."""
    # never an arm slower than the baseline: "the fastest with parity" of arms that all lost
    # would hand the user a patch that costs time (a thread started per appended item: 0.01x)
    ok = [
        a
        for a in arms
        if a.exit_code == 0
        and a.loss_parity is not False
        and a.judged_speedup is not None
        and (a.judged_speedup >= 1.0 or (a.judged_by is Measure.MEMORY and a.significant))
    ]
    wins = [a for a in ok if a.significant]
    pool = wins or ok
    if not pool:
        return None
    # wins within run-to-run noise of the fastest are the same gain: keep the least invasive
    # (the job's own flag before an edit of its source: `--workers 2` over a patched literal)
    best = max(_speedup(a) for a in pool)
    close = [a for a in pool if _speedup(a) >= best * (1 - SAME_GAIN_TOLERANCE)]
    return min(
        close, key=lambda a: (MECHANISM_ORDER.get(a.mechanism or "", len(MECHANISM_ORDER)), -_speedup(a))
    )


def _speedup(arm: Arm) -> float:
    return arm.judged_speedup if arm.judged_speedup is not None else float("nan")


def why_not_settled(arm: Arm) -> str:
    """Why an arm did not end the search, in words (the runner's note before the next arm)."""
    if arm.not_run:
        return "it was not run"
    if arm.loss_parity is False:
        return "its numerics differ from the baseline's"
    if arm.exit_code != 0:
        return f"it failed (exit {arm.exit_code})"
    if arm.significant:
        return "under half its predicted saving"
    return f"no significant gain ({arm.verdict})"


def judged_text(
    judged_by: Measure,
    speedup: float | None,
    interval: Sequence[float] | None,
    verdict: str | None,
    memory_slopes: Sequence[float] | None = None,
) -> str:
    """'1.31x by the median, interval 0.98-1.70x' (the verdict where nothing was judged)."""
    if judged_by is Measure.MEMORY and memory_slopes:
        base, cand = memory_slopes
        return (
            f"memory {base / 1024:.1f} kB a step → {cand / 1024:.1f} kB a step"
            + (f"; step time {speedup:.2f}x by the median" if speedup is not None else "")
            + (f", interval {interval[0]:.2f}-{interval[1]:.2f}x" if interval else "")
        )
    if speedup is None:
        return str(verdict)
    by = judged_by.short
    return f"{speedup:.2f}x by the {by}" + (
        f", interval {interval[0]:.2f}-{interval[1]:.2f}x" if interval else ""
    )


def typical_step_s(median_step_s: float | None, window_values: Sequence[float], judged_by: Measure) -> float:
    """The step time a repeated arm's two recordings are compared by: the mean of its window
    where the arm is judged by the mean, else its median; infinite without a step."""
    if not len(window_values):
        return float("inf")
    if judged_by.by_mean:
        return float(np.mean(np.asarray(window_values, dtype=float)))
    return float(median_step_s or float("inf"))


_T = TypeVar("_T")


def quicker(first: _T, second: _T, first_s: float, second_s: float) -> _T:
    """Of two recordings of one arm, the one whose typical steady step took less (first_s,
    second_s): load from outside the job only adds time."""
    return second if second_s < first_s else first


def demoted_by_arms(findings: Sequence[Finding], arms: Sequence[Arm]) -> list[Finding]:
    """The baseline's findings with what --fix measured: a finding whose every measured arm (one naming
    its id and a prescription's summary) was slower than the baseline is at most low, the measure in
    evidence["fix_measured"]: a fix measured to slow the job is never a problem to act on. With
    another concrete fix not measured yet, it keeps its severity and the slower fix goes last."""
    slower: dict[tuple[str, str], float] = {}
    faster: set[tuple[str, str]] = set()
    for arm in arms:
        speedup = arm.judged_speedup
        if not arm.finding or arm.after or arm.exit_code not in (0, None) or speedup is None:
            continue
        key = (arm.finding, arm.summary or "")
        interval = arm.interval()
        if speedup < 1.0 and (not interval or interval[1] < 1.0):  # slower beyond its noise
            slower[key] = round(float(speedup), 3)
        else:
            faster.add(key)
    out = []
    for f in findings:
        keys = [(f.id, p.summary) for p in f.prescriptions]
        measured = [slower[k] for k in keys if k in slower]
        if not measured or any(k in faster for k in keys):
            out.append(f)
            continue
        evidence = {**f.evidence, "fix_measured": measured}
        untried = [
            p for p, k in zip(f.prescriptions, keys) if k not in slower and p.automatic and len(p.change)
        ]
        if untried:
            # another concrete fix is still to be measured: the slower one goes last
            order = sorted(range(len(keys)), key=lambda i: keys[i] in slower)
            out.append(replace(f, prescriptions=tuple(f.prescriptions[i] for i in order), evidence=evidence))
            continue
        severity = f.severity if severity_index(f.severity) <= severity_index("low") else "low"
        out.append(replace(f, severity=severity, evidence=evidence))
    return out
