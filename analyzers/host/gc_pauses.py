"""GC pauses: full (generation-2) collections inside steps.

A gen-2 collection walks every tracked object the process holds; with a large object graph
(datasets, caches, metadata kept in Python objects) one pause costs tens to hundreds of ms and
lands in whatever step allocated the object that crossed the threshold. The shim aggregates the
collections per step (count, total and longest pause per generation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers import codefix
from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.declaration import Declaration, Removes
from traindx.analyzers.core.findings import Finding, Prescription
from traindx.analyzers.core.frameworks import runs_megatron
from traindx.derive import ledger

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="gc_pauses",
    order=40,
    ids=("gc.gen2_in_step",),
    live_categories=("gc",),
    explains=(
        "ranks.straggler",
        "ranks.pipeline_bubble",
        "steps.periodic_slow",
        "steps.instability",
        "gpu_idle.host_starved",
        "host_work.code",
    ),
    removes={"gc.gen2_in_step": Removes(("gc",))},
    straggler_lines={"gc": "gc.gen2_in_step"},
    call_site_lines={"gc": ("gc.gen2_in_step",)},
)

MIN_SHARE = 0.03
FREEZE = "import gc; gc.collect(); gc.freeze()  # set-up done: its objects leave the collector's view"


def _code_prescriptions(run: RunRecord, lost: float, collections_per_step: Any) -> Any:
    """Concrete edits of the job's own script: a `gc.collect()` called in its loop removed (when
    about one full collection per step shows it is the cause), and `gc.freeze()` inserted where
    set-up ends (before the training loop)."""
    out = []
    for path in ev.job_scripts(run):
        if collections_per_step >= 0.5:
            for line, source in codefix.calls_in_loops(path, "gc.collect"):
                change = codefix.code_change(path, line, source, "", op="delete")
                if change:
                    out.append(
                        Prescription(
                            kind="code",
                            summary=f"remove the gc.collect() called in the loop at "
                            f"{path}:{line}: a full collection every step",
                            change={"code": change},
                            expected_gain_s_per_step=lost,
                            automatic=True,
                        )
                    )
        spot = codefix.before_training_loop(path)
        if spot:
            change = codefix.code_change(path, spot[0], spot[2], FREEZE, last_line=spot[1], op="insert_after")
            if change:
                out.append(
                    Prescription(
                        kind="code",
                        summary=f"gc.freeze() after set-up ({path}:{spot[1]}, before the "
                        "training loop): full collections walk only new objects",
                        change={"code": change},
                        expected_gain_s_per_step=lost * 0.5,
                        automatic=True,
                    )
                )
    return out


def _from_ledger(run: RunRecord, rank: str, lost: float | None, share: float | None) -> Any:
    """(seconds per steady step, share) of GC from the time ledger: the shim's long GC pauses
    as intervals, each counted once even inside a data wait or a backward. Without the shim's
    spans (older runs), the per-step aggregates above stand."""
    if not ledger.has_spans(run):
        return lost, share
    led = ledger.steady_rows(run, rank)
    wall = float(led["wall_s"].sum()) if len(led) else 0.0
    if not wall:
        return lost, share
    gc_s = led["gc_s"].to_numpy(float)
    # on a loaded machine a pause's wall time holds the thread's wait for a core: its cost is
    # the pause less that wait (its own CPU clock), judged against the steps' own time
    waits = ev.gc_core_waits(run)
    if len(waits):
        gc_s = np.maximum(0.0, gc_s - ev.waits_inside(waits, led["rank"], led["start_ns"], led["end_ns"]))
    runq = ev.ledger_step_runq_s(run, rank, led["step"])
    if runq is not None:
        wall = float((led["wall_s"].to_numpy(float) - runq).sum()) or wall
    return float(gc_s.mean()), float(gc_s.sum()) / wall


def analyze(run: RunRecord) -> list[Finding]:
    findings: list[Finding] = []
    gc = run.gc
    if not len(gc) or "generation" not in gc:
        return findings
    by_rank = dict(tuple(gc.groupby("rank", sort=False)))  # one pass, not one scan per rank
    for rank in sorted(set(run.steps["rank"])) if len(run.steps) else []:
        steady = ev.steady_steps(run, rank)
        if not len(steady) or rank not in by_rank:
            continue
        found = _rank_finding(run, rank, steady, by_rank[rank])
        if found is not None:
            findings.append(found)
    return findings


def _rank_finding(run: RunRecord, rank: str, steady: pd.DataFrame, events: pd.DataFrame) -> Finding | None:
    """Full (generation-2) collections inside one rank's steady steps, or None below MIN_SHARE."""
    steady_ids = {int(s) for s in steady["step"]}
    events = events[events["step"].isin(steady_ids)]
    full = events[events["generation"] == 2]
    if not len(full):
        return None
    n_steps = len(steady)
    step_s = float(steady["duration_s"].median())
    mean_step_s = float(steady["duration_s"].mean())
    lost = float(full["total_s"].sum()) / n_steps
    share = lost / mean_step_s if mean_step_s else 0.0
    lost, share = _from_ledger(run, rank, lost, share)
    if share < MIN_SHARE:
        return None
    steps_hit = sorted(int(s) for s in full["step"])
    by_generation = {
        int(g): {
            "collections": int(rows["count"].sum()),
            "total_s": round(float(rows["total_s"].sum()), 4),
            "longest_s": round(float(rows["max_s"].max()), 4),
        }
        for g, rows in events.groupby("generation")
    }
    # how much slower the steps with a full collection are than the others
    hit = steady[steady["step"].isin(steps_hit)]["duration_s"]
    clean = steady[~steady["step"].isin(steps_hit)]["duration_s"]
    evidence: dict[str, Any] = {
        "rank": rank,
        "steady_steps": n_steps,
        "steps_with_gen2": steps_hit,
        "gen2_collections": int(full["count"].sum()),
        "gen2_seconds": round(float(full["total_s"].sum()), 4),
        "longest_gen2_pause_s": round(float(full["max_s"].max()), 4),
        "by_generation": by_generation,
        "median_step_with_gen2_s": round(float(hit.median()), 4) if len(hit) else None,
        "median_step_without_s": round(float(clean.median()), 4) if len(clean) else None,
    }
    return Finding(
        id="gc.gen2_in_step",
        title=f"Full garbage collections inside steps cost {lost * 1000:.0f} ms per step on rank {rank}",
        severity=ev.severity_for_share(share),
        analyzer="gc_pauses",
        summary=(
            f"{evidence['gen2_collections']} generation-2 collections in "
            f"{len(steps_hit)} of {n_steps} steady steps, {evidence['gen2_seconds']:.2f} s "
            f"in all (longest {evidence['longest_gen2_pause_s'] * 1000:.0f} ms); median "
            f"step {step_s * 1000:.0f} ms."
        ),
        steps_affected=tuple(steps_hit),
        seconds_lost_per_step=lost,
        share_of_step=share,
        evidence=evidence,
        prescriptions=_gc_prescriptions(run, lost, evidence["gen2_collections"] / max(n_steps, 1)),
        ranks=(rank,),
    )


def _gc_prescriptions(run: RunRecord, lost: float, per_step: float) -> tuple[Prescription, ...]:
    """Megatron's manual GC, the job's own gc lines, gc.freeze() after set-up, or collecting
    between steps."""
    prescriptions = []
    if runs_megatron(run.command):
        prescriptions.append(
            Prescription(
                kind="arg",
                summary="Megatron: --manual-gc --manual-gc-interval 100 (collect on all ranks "
                "together, every 100 steps, instead of inside random steps)",
                change={
                    "arg": {
                        "framework": "megatron",
                        "set": {"--manual-gc": True, "--manual-gc-interval": "100"},
                    }
                },
                expected_gain_s_per_step=lost,
                automatic=True,
            )
        )
    prescriptions.extend(_code_prescriptions(run, lost, per_step))
    prescriptions.append(
        Prescription(
            kind="code",
            summary="call gc.collect(); gc.freeze() once after the model, data and caches are "
            "built (before the training loop): the long-lived graph leaves the "
            "collector's view and a full collection walks only new objects",
            command="gc.collect(); gc.freeze()  # once, after set-up, before the training loop",
            expected_gain_s_per_step=lost,
        )
    )
    prescriptions.append(
        Prescription(
            kind="code",
            summary="or collect between steps: gc.disable() after setup and gc.collect() every N "
            "steps at the step end; or raise the gen-2 threshold "
            "(gc.set_threshold(700, 10, 1000))",
            command="gc.disable()  # after set-up; then at a step end: if step % 100 == 0: gc.collect()",
            expected_gain_s_per_step=lost,
        )
    )
    return tuple(prescriptions)
