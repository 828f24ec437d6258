"""Evaluation is not the training step: forward calls without grad (torch.no_grad,
inference_mode, a generate() loop) on the training thread are evaluation or inference work. The
ledger books them on their own line (`eval`); here each is named at the job's line that called
it (the shim's caller of the first forward of each run of them), with its period in steps and
its mean price each time it runs, so that neither the training step's forward/backward nor the
optimizer step's line takes its time.

It is work the job asked for: the finding names it and its price; its severity is at most low.
A run of them whose rows the optimizer steps after it train on, new rows each run (the shim's
`nograd_phase` events: fed, fresh), is the training algorithm's own data collection (an RL
rollout, a pseudo-labelling pass), not an evaluation: `evaluation.rollout`, a note.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding, Prescription, severity_index
from traindx.common.units import ordinal
from traindx.derive import sources

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="evaluation",
    order=105,
    ids=("evaluation.in_loop", "evaluation.rollout"),
    not_causes=("evaluation.rollout",),
    # the steps an evaluation runs in are slow: that is its price, not a cause of its own
    explains=(
        "steps.periodic_slow",
        "steps.instability",
        "host_work.periodic_line",
        "host_work.code",
        "gpu_idle.host_starved",
    ),
)
MIN_SHARE = 0.01  # of the step time: below it an evaluation is a note
MAX_SEVERITY = "low"


def analyze(run: RunRecord) -> list[Finding]:
    spans = run.spans
    if not len(spans) or not (spans["cat"] == "eval").any():
        return []
    out = []
    for rank in sorted({str(r) for r in spans.loc[spans["cat"] == "eval", "rank"]}):
        out.extend(_analyze_rank(run, rank))
    return out


def _site(caller: Any) -> dict[str, Any] | None:
    """The job's line an evaluation is named at: the framework-called frame of the job (its
    callback's line, `hook`) where one ran it, else the job's line that called the forward."""
    if not isinstance(caller, dict) or not caller.get("file"):
        return None
    hook = caller.get("hook")
    return hook if isinstance(hook, dict) and hook.get("file") else caller


def _sites(evals: pd.DataFrame) -> pd.Series:
    """Each eval span's call site "file:line" (a span without a caller belongs to the run of
    them its named first one opened)."""
    names = [f"{s['file']}:{s['line']}" if (s := _site(c)) else None for c in evals["caller"]]
    return pd.Series(names, index=evals.index, dtype=object).ffill()


def _analyze_rank(run: RunRecord, rank: str) -> list[Finding]:
    spans = run.rank_rows("spans", rank)
    evals = spans[spans["cat"] == "eval"].sort_values("start_ns")
    led = run.rank_rows("ledger", rank).sort_values("start_ns")
    if not len(evals) or not len(led):
        return []
    begin, end = led["start_ns"].to_numpy(np.int64), led["end_ns"].to_numpy(np.int64)
    s = evals["start_ns"].to_numpy(np.int64)
    i = np.searchsorted(begin, s, side="right") - 1
    inside = (i >= 0) & (s < end[np.maximum(i, 0)])
    evals = evals.assign(
        step=led["step"].to_numpy(np.int64)[np.maximum(i, 0)],
        site=_sites(evals),
        window_end=end[np.maximum(i, 0)],
    )[inside]
    evals = evals.dropna(subset=["site"])
    step_s = float(led["wall_s"].mean())
    evals = _with_run_ends(spans, evals)
    phases = _phases_by_site(run, rank, spans[spans["cat"] == "eval"].sort_values("end_ns"))
    findings = []
    for site, rows in evals.groupby("site", sort=False):
        found = _site_finding(run, rank, str(site), rows, spans, len(led), step_s)
        if found is not None and _collects_training_data(phases.get(str(site), [])):
            found = _as_rollout(found)
        if found is not None:
            findings.append(found)
    return findings


# spans that are no part of the training step's own work: an evaluation's host code (a metric
# over its predictions) runs on until the step's next one of the others (a batch, a forward)
_NOT_THE_STEPS = ("eval", "gc", "traindx")


def _with_run_ends(spans: pd.DataFrame, evals: pd.DataFrame) -> pd.DataFrame:
    """Each eval span with `run_end_ns`: where the work it belongs to ends, the start of the
    training step's next span on its thread (a batch, a forward with grad, an optimizer step),
    at most the step's end."""
    own = spans[~spans["cat"].isin(_NOT_THE_STEPS)]
    run_end = evals["window_end"].to_numpy(np.int64).copy()
    for tid, rows in evals.groupby("tid", sort=False):
        starts = np.sort(own.loc[own["tid"] == tid, "start_ns"].to_numpy(np.int64))
        e = rows["end_ns"].to_numpy(np.int64)
        j = np.searchsorted(starts, e, side="left")
        nxt = np.where(
            j < len(starts), starts[np.minimum(j, max(0, len(starts) - 1))], np.iinfo(np.int64).max
        )
        where = evals.index.get_indexer(rows.index)
        run_end[where] = np.minimum(run_end[where], np.maximum(nxt, e))
    return evals.assign(run_end_ns=run_end)


def _traindx_ns(spans: pd.DataFrame, first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """traindx's own time (its spans on the job's threads) inside each [first, last): not the job's."""
    ours = spans[spans["cat"] == "traindx"]
    s, e = ours["start_ns"].to_numpy(np.int64), ours["end_ns"].to_numpy(np.int64)
    return np.array(
        [float(np.clip(np.minimum(e, b) - np.maximum(s, a), 0, None).sum()) for a, b in zip(first, last)]
    )


def _phases_by_site(run: RunRecord, rank: str, evals: pd.DataFrame) -> dict[str, list[dict[str, Any]]]:
    """The shim's nograd_phase checks, each under the site of the last no-grad forward before it
    (it is made at the grad forward that ends that run)."""
    events = run.of_type("nograd_phase")
    if not len(events) or not len(evals):
        return {}
    events = events[events["rank"].astype(str) == rank]
    ends = evals["end_ns"].to_numpy(np.int64)
    sites = _sites(evals).to_numpy(object)
    out: dict[str, list[dict[str, Any]]] = {}
    for _, e in events.iterrows():
        i = int(np.searchsorted(ends, int(e["t"]), side="right")) - 1
        if i >= 0 and sites[i] is not None:
            out.setdefault(str(sites[i]), []).append({"fed": e.get("fed"), "fresh": e.get("fresh")})
    return out


def _collects_training_data(phases: list[dict[str, Any]]) -> bool:
    """Every run checked fed the optimizer steps after it, and every run after the first brought
    rows the one before had not (a fixed data set's metric brings the same rows each time)."""
    if not phases or not all(p.get("fed") is True for p in phases):
        return False
    later = [p.get("fresh") for p in phases[1:]]
    return bool(later) and all(f is True for f in later)


def _as_rollout(f: Finding) -> Finding:
    where = f.title.split(" at ", 1)[1].split(":", 2)
    return dataclasses.replace(
        f,
        id="evaluation.rollout",
        title=f"Data collection at {where[0]}:{where[1]}: the optimizer steps after it train on its rows",
        severity="info",
        summary=f.summary.replace(
            "Booked as evaluation, not as the training step's forward/backward.",
            "The optimizer steps after each run train on rows it produced, new each run: the "
            "training algorithm's own data collection (an RL rollout, a pseudo-labelling pass), "
            "work the job asked for, not an evaluation. Booked on the eval/inference line.",
        ),
        prescriptions=(),
        evidence={**f.evidence, "feeds_training": True},
    )


def _site_finding(
    run: RunRecord, rank: str, site: str, rows: pd.DataFrame, spans: pd.DataFrame, n_steps: int, step_s: float
) -> Finding | None:
    # each time it runs: from its first forward until the training step's work goes on (a
    # generate() loop's own code between its forwards, a metric computed over its predictions
    # after them, are the evaluation's too), less traindx's own time in it
    per_step = rows.groupby("step").agg(
        first=("start_ns", "min"), last=("run_end_ns", "max"), calls=("cat", "size")
    )
    first, last = per_step["first"].to_numpy(np.int64), per_step["last"].to_numpy(np.int64)
    each = ((last - first) - _traindx_ns(spans, first, last)) / 1e9
    forwards_s = float((rows.groupby("step")["end_ns"].max().to_numpy(np.int64) - first).mean()) / 1e9
    steps = [int(x) for x in per_step.index]
    period = int(np.median(np.diff(steps))) if len(steps) > 1 else None
    mean_s = float(each.mean())
    per_run_step = float(each.sum()) / max(1, n_steps)
    share = per_run_step / step_s if step_s else 0.0
    forward_at = next(c for c in rows["caller"] if isinstance(c, dict) and c.get("file"))
    caller = _site(forward_at) or forward_at
    file, line = str(caller["file"]), int(caller["line"])
    function = caller.get("function")
    source = _source_line(run, file, line)
    where = f"{os.path.basename(file)}:{line}"
    every = f"every {ordinal(period)} step" if period else f"in step {steps[0]}"
    severity = ev.severity_for_share(share) if share >= MIN_SHARE else "info"
    if severity_index(severity) > severity_index(MAX_SEVERITY):
        severity = MAX_SEVERITY
    calls = int(per_step["calls"].sum())
    summary = (
        f"{calls} forward call(s) without grad (an evaluation, a generate() loop) run from "
        f"{where}{f' ({function})' if function else ''}"
        f"{f': `{source}`' if source else ''}{_inner(forward_at, caller)} {every} ({len(steps)} time(s)), "
        f"{mean_s * 1e3:.1f} ms each time (its forwards and the job's code after them until the "
        f"training step goes on), {per_run_step * 1e3:.1f} ms a step over the run "
        f"({share:.0%}). Booked as evaluation, not as the training step's forward/backward."
    )
    prescriptions: tuple[Prescription, ...] = ()
    if severity != "info" and period:
        prescriptions = (
            Prescription(
                kind="code",
                summary=f"evaluate less often (every {2 * period} steps instead of every {period} "
                f"halves its {per_run_step * 1e3:.1f} ms a step), on fewer samples, or off the "
                f"training loop (a separate process on a saved checkpoint), at {where}",
                expected_gain_s_per_step=per_run_step / 2,
            ),
        )
    return Finding(
        id="evaluation.in_loop",
        title=f"Evaluation at {where} {every}: {mean_s * 1e3:.0f} ms each time",
        severity=severity,
        analyzer="evaluation",
        summary=summary,
        steps_affected=tuple(steps),
        seconds_lost_per_step=per_run_step,
        share_of_step=share,
        evidence={
            **_evidence(rank, caller, source, steps, period, mean_s, calls, per_run_step),
            "forward_at": {k: forward_at.get(k) for k in ("file", "line", "function")},
            "forward_s_each": round(forwards_s, 6),  # its forwards alone, first to last
        },
        prescriptions=prescriptions,
        ranks=(rank,),
    )


def _inner(forward_at: dict[str, Any], site: dict[str, Any]) -> str:
    """Where the forwards themselves are called, when the site is the framework-called line above."""
    if forward_at is site:
        return ""
    return f", its forwards at {os.path.basename(str(forward_at['file']))}:{forward_at['line']}"


def _evidence(
    rank: str,
    caller: dict[str, Any],
    source: str | None,
    steps: list[int],
    period: int | None,
    mean_s: float,
    calls: int,
    per_run_step: float,
) -> dict[str, Any]:
    return {
        "rank": rank,
        "file": caller["file"],
        "line": int(caller["line"]),
        "function": caller.get("function"),
        "source": source,
        "steps": steps,
        "period": period,
        "mean_s_each": round(mean_s, 6),
        "forward_calls": calls,
        "seconds_per_step": round(per_run_step, 6),
        "grad": False,
    }


def _source_line(run: RunRecord, file: str, line: int) -> str | None:
    """The job's source line, or None where it cannot be read."""
    text = sources.source_line(file, line, run.manifest.get("cwd"))
    return text.strip() if text and text.strip() else None
