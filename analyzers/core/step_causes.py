"""What each step spent its time in, and the run-level finding when no analyzer named it.

Per step (the report colours its step chart from this; no renderer re-judges it): a step is slow
above SLOW_FACTOR x the median (the one threshold, read by analyzers/model/stability.py), caused
by the recorded event covering CAUSE_SHARE of it or most of its excess. Judged after the other
analyzers: events covering EVIDENCE_SHARE of the steady time with no root above info are a
finding of their own (`steps.time_in_events`), so the verdict, --fix and compare all see it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding, is_problem

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

from traindx.derive.steady import stopped_steps
from traindx.derive.steptables import EVENT_KINDS, compile_spans, event_seconds, gc_frame, run_t0, step_table

SLOW_FACTOR = 2.0  # a step this much slower than the median is a slow step (1.5-1.9x
# recurs by chance on a busy machine, and then looks periodic)

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(name="step_causes", order=10, ids=("steps.time_in_events",), judge=True)


CAUSE_SHARE = 0.3  # an event covering this share of a step names the step's cause
EXCESS_SHARE = 0.25  # ...or this share of a slow step's time above the median
EVIDENCE_SHARE = 0.1  # events of one kind covering this share of all step time: a finding
# a step's cause -> its name for a person (the report's legend); EVENT_KINDS first, in tie order
CAUSES = {
    "compile": "JIT compile",
    "autotune": "autotuning",
    "dynamo": "torch.compile recompile",
    "gc": "garbage collection",
    "warmup": "first step",
    "stopped": "the job was stopped (SIGSTOP)",
    "unexplained": "slow, cause not recorded",
    "normal": "normal",
}


def classify_steps(
    table: pd.DataFrame, secs: np.ndarray, judged: tuple[Any, Any] | None = None
) -> tuple[float | None, float | None]:
    """Adds compile_s, gc_s (wall clock), slow and cause columns to the step table (in place);
    returns (median, slow threshold). secs: steptables.event_seconds of the same table.
    judged: without_core_wait's (events' own seconds, steps' own seconds), which the cause is
    then judged by; a step is slow by its wall time either way."""
    n = len(table)
    d = table["duration_s"].to_numpy(np.float64)
    wall_secs = secs
    secs, share_of = judged if judged is not None else (secs, d)
    median = float(np.median(d)) if n else None
    threshold = median * SLOW_FACTOR if median else None
    slow = (d > threshold) if threshold else np.zeros(n, bool)
    best = secs.argmax(axis=1) if n else np.zeros(0, np.int64)
    best_s = secs[np.arange(n), best] if n else np.zeros(0)
    excess = d - (median or 0.0)
    # a cause when an event covers a good part of the step (every step compiling is as much a
    # finding as one slow step), or when a slow step's excess is mostly that event
    named = (best_s > 0) & ((best_s >= CAUSE_SHARE * share_of) | (slow & (best_s >= EXCESS_SHARE * excess)))
    first_step = table.groupby("rank", sort=False)["step"].transform("min").to_numpy() if n else []
    cause = np.where(
        named,
        np.array(EVENT_KINDS, dtype=object)[best],
        np.where(slow, np.where(table["step"].to_numpy() == first_step, "warmup", "unexplained"), "normal"),
    )
    table["compile_s"] = wall_secs[:, :-1].sum(axis=1)
    table["gc_s"] = wall_secs[:, -1]
    table["slow"] = slow
    table["cause"] = pd.Series(cause, index=table.index, dtype=object)
    return median, threshold


@dataclass(frozen=True)
class StepCauses:
    """Every step of a run with its cause judged: the step table (derive/steptables.step_table)
    with compile_s, gc_s (wall clock), slow and cause columns; where its times come from; the
    median step and the slow threshold."""

    table: pd.DataFrame
    source: str | None
    median_s: float | None
    slow_threshold_s: float | None


def judge_steps(run: RunRecord, t0: int, compiles: list[dict[str, Any]] | None = None) -> StepCauses:
    """The steps' causes, judged as the finding judges them (a pause's wait for a core is not
    its cost): what the report and the terminal draw, judged once here. compiles: the compile
    spans ({rank, kind, start_s, end_s}; default steptables.compile_spans)."""
    table, source = step_table(run, t0)
    spans = compile_spans(run, t0) if compiles is None else compiles
    secs = event_seconds(table, spans, gc_frame(run))
    judged = without_core_wait(run, table, secs, t0) if len(table) else None
    median, threshold = classify_steps(table, secs, judged)
    _mark_stopped(run, table)
    return StepCauses(table, source, median, threshold)


def _mark_stopped(run: RunRecord, table: pd.DataFrame) -> None:
    """A step a stop of the job (SIGSTOP) overlaps has that cause, whatever else it held."""
    stopped = stopped_steps(run)
    if not stopped or not len(table):
        return
    hit = [int(s) in stopped.get(str(r), ()) for r, s in zip(table["rank"], table["step"])]
    table.loc[hit, "cause"] = "stopped"


def analyze(run: RunRecord, findings: list[Finding] | None = None) -> list[Finding]:
    """[steps.time_in_events] when no root finding above info exists and one kind of event
    holds a real share of the steady steps' time (not a cold start); else []."""
    if any(is_problem(f) and f.cause is None for f in findings or ()):
        return []
    t0 = run_t0(run)
    table, _ = step_table(run, t0)
    if not len(table):
        return []
    secs = event_seconds(table, compile_spans(run, t0), gc_frame(run))
    judged = without_core_wait(run, table, secs, t0)
    classify_steps(table, secs, judged)
    wall_secs = secs
    if judged is not None:  # priced and shared by the events' and the steps' own time
        own_secs, own = judged
        table = table.assign(
            wall_s=table["duration_s"],
            duration_s=own,
            compile_s=own_secs[:, :-1].sum(axis=1),
            gc_s=own_secs[:, -1],
        )
    # the steady window only (analyzers/core/evidence.py): a cold start's first compiles are paid
    # once, and a short run's warm-up is no finding
    steady = ev.steady_steps(run)
    if not len(steady):
        return []
    keys = pd.MultiIndex.from_arrays([table["rank"], table["step"]])
    kept = pd.Series(
        keys.isin(pd.MultiIndex.from_arrays([steady["rank"].astype(str), steady["step"].astype(np.int64)]))
    )
    table = table[kept.to_numpy()]
    if not len(table):
        return []
    total_s = float(table["duration_s"].sum())
    seconds = np.where(table["cause"].to_numpy() == "gc", table["gc_s"], table["compile_s"])
    waited = None
    if judged is not None:
        wall = wall_secs[kept.to_numpy()]
        wall_seconds = np.where(table["cause"].to_numpy() == "gc", wall[:, -1], wall[:, :-1].sum(axis=1))
        waited = {
            "wall_seconds_in_events": float(wall_seconds.sum()),
            "step_wall_s": float(table["wall_s"].sum()),
            "step_own_s": total_s,
        }
    by_cause = pd.Series(seconds).groupby(table["cause"].to_numpy()).sum()
    counts = table["cause"].value_counts()
    kinds = [
        c for c in EVENT_KINDS if c in by_cause.index and total_s and by_cause[c] >= EVIDENCE_SHARE * total_s
    ]
    if not kinds:
        return []
    kind = max(kinds, key=lambda c: by_cause[c])
    return [_time_in_events(table, kind, by_cause, counts, total_s, waited)]


def _time_in_events(
    table: pd.DataFrame,
    kind: str,
    by_cause: pd.Series,
    counts: pd.Series,
    total_s: float,
    waited: dict[str, float] | None,
) -> Finding:
    """One kind of event holds a real share of the steady steps' time and no finding names it."""
    n_steps = int(len(table[["rank", "step"]].drop_duplicates())) or 1
    mine = table[table["cause"] == kind]
    share, seconds = float(by_cause[kind]) / total_s, float(by_cause[kind])
    return Finding(
        id="steps.time_in_events",
        title=(
            f"{int(counts[kind])} of {n_steps} steps spent most of their time in {CAUSES[kind]} "
            f"({f'{seconds:.1f} s' if seconds >= 1 else f'{seconds * 1e3:.0f} ms'} in all)"
        ),
        severity=ev.severity_for_share(share),
        analyzer="step_causes",
        summary=(
            f"{share:.0%} of the steady steps' time is {CAUSES[kind]}, recorded by the shim, and no "
            "specialised analyzer made a finding of it: see the step chart and the compile "
            "events in the report."
        ),
        steps_affected=tuple(sorted({int(s) for s in mine["step"]})),
        seconds_lost_per_step=float(by_cause[kind]) / n_steps,
        share_of_step=share,
        ranks=tuple(sorted(set(mine["rank"]))),
        evidence={
            "kind": kind,
            "steps": int(counts[kind]),
            "of_steps": n_steps,
            "seconds": float(by_cause[kind]),
            "share_of_step_time": share,
            **({"runqueue_wait": waited} if waited else {}),
        },
    )


def without_core_wait(
    run: RunRecord, table: pd.DataFrame, secs: np.ndarray, t0: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """On a loaded machine a span's wall time holds the time the training thread waited for a
    core: its cost is its wall time less that wait, judged against the step's own time. GC
    pauses carry their own CPU clock (analyzers/core/evidence.py gc_core_waits); other events take
    the step's wait spread evenly (the shim's per-step reading, the nearest one). Returns
    (the events' own seconds, like secs; the steps' own seconds), or None for a run recorded
    without the wait, judged by wall time as before."""
    d = table["duration_s"].to_numpy(np.float64)
    runq = ev.step_runq_s(run, table["rank"], table["step"], table["end_s"], d)
    gc_waits = ev.gc_core_waits(run)
    if runq is None and not len(gc_waits):
        return None
    runq = np.zeros(len(d)) if runq is None else np.nan_to_num(runq)
    own = d - runq
    spread = np.where(d > 0, own / np.where(d > 0, d, 1.0), 1.0)
    secs = secs.copy()
    secs[:, :-1] *= spread[:, None]
    if len(gc_waits):
        start = t0 + (table["start_s"].to_numpy(np.float64) * 1e9).astype(np.int64)
        end = t0 + (table["end_s"].to_numpy(np.float64) * 1e9).astype(np.int64)
        secs[:, -1] = np.maximum(0.0, secs[:, -1] - ev.waits_inside(gc_waits, table["rank"], start, end))
    else:
        secs[:, -1] *= spread
    np.minimum(secs, own[:, None], out=secs)
    return secs, own
