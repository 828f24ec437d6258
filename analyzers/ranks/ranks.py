"""Multi-rank: the straggler - the rank the others wait for - and pipeline bubbles.

In a synchronous job every rank's step takes as long as the slowest rank's, so step times alone
do not show the straggler. Evidence, best first: the meeting points (analyzers/ranks/sync_points.py),
the smallest wait in the torch.profiler window or py-spy for runs without spans (attach mode,
older runs), and per-rank step times for ranks that do not wait for each other. Blocking
send/recv waits are the pipeline's bubbles (`ranks.pipeline_bubble`), never stragglers."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding, Prescription
from traindx.analyzers.ranks import sync_points as sp
from traindx.analyzers.ranks.points import (
    steady_ledger,
    step_points,
    straggler_from_points,
    syncs_every_step,
)
from traindx.analyzers.ranks.waits import MIN_SHARE, MIN_WAIT_DIFF_S, by_smallest_wait
from traindx.derive import ledger as ledger_mod

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord


DECLARATION = Declaration(
    name="ranks",
    order=100,
    ids=("ranks.straggler", "ranks.pipeline_bubble"),
    cross_rank=True,
    live_categories=("collective",),
    capture=True,
    explains=("gpu_idle.exposed_communication",),
)


# -- pipeline bubbles: blocking send/recv -------------------------------------------------------
def _bubbles(run: RunRecord, ranks: list[Any], spans: pd.DataFrame) -> list[Finding]:
    p2p = spans[sp.is_point_to_point(spans)] if len(spans) else spans
    if not len(p2p):
        return []
    steady = ev.steady_steps(run)
    per_rank: dict[Any, dict[str, Any]] = {}
    for rank, rows in p2p.groupby("rank"):
        st = steady[steady["rank"] == rank]
        if not len(st):
            continue
        wall = float(st["duration_s"].sum())
        idx = sp.step_of(
            run.steps.dropna(subset=["start_ns", "end_ns"]), rank, rows["start_ns"].to_numpy(np.int64)
        )
        rows = rows[np.isin(idx, st["step"].astype(int).to_numpy())]
        secs = ev.union_seconds(zip(rows["start_ns"], rows["end_ns"]))
        per_rank[rank] = {
            "share_of_step": round(secs / wall, 3) if wall else 0.0,
            "seconds_per_step": round(secs / len(st), 4),
            "ops": dict(Counter(rows["op"].astype(str))),
            "peers": sorted({int(p) for p in rows["peer"].dropna()}),
        }
    if not per_rank:
        return []
    share = float(np.mean([v["share_of_step"] for v in per_rank.values()]))
    worst = max(per_rank, key=lambda r: per_rank[r]["share_of_step"])
    if per_rank[worst]["share_of_step"] < MIN_SHARE:
        return []
    slow_stage = _slow_stage(run, per_rank, worst)
    text = "; ".join(
        f"rank {r}: {v['share_of_step']:.0%} ({v['seconds_per_step'] * 1000:.0f} ms) "
        f"in {'/'.join(v['ops'])} with rank {'/'.join(map(str, v['peers']))}"
        for r, v in sorted(per_rank.items())
    )
    return [
        Finding(
            id="ranks.pipeline_bubble",
            title=f"Pipeline bubbles: the stages wait {share:.0%} of each step for their neighbours "
            "(send/recv)",
            severity=ev.severity_for_share(share),
            analyzer="ranks",
            summary=(
                f"Blocking point-to-point waits per steady step: {text}. A stage waiting in recv "
                "for its upstream stage (or in send for its downstream one) is the pipeline "
                "schedule's idle time, not a straggler."
                + (
                    f" The stages are unbalanced: rank {worst} waits for rank "
                    f"{slow_stage['rank']}, whose own ledger has, beyond rank {worst}'s: "
                    + " · ".join(
                        f"{ledger_mod.LABELS.get(c, c)} +{v * 1000:.0f} ms"
                        for c, v in list(slow_stage["ledger_beyond_per_step_s"].items())[:3]
                    )
                    + "."
                    if slow_stage
                    else ""
                )
            ),
            seconds_lost_per_step=per_rank[worst]["seconds_per_step"],
            share_of_step=share,
            evidence={
                "per_rank": per_rank,
                "source": "shim send/recv spans",
                **({"slow_stage": slow_stage} if slow_stage else {}),
            },
            prescriptions=(
                Prescription(
                    kind="code",
                    summary="more micro-batches per step (bubble ≈ (stages − 1) / "
                    "micro-batches of the step), or an interleaved schedule (virtual pipeline stages)",
                ),
            ),
            ranks=tuple(ranks),
        )
    ]


def _slow_stage(run: RunRecord, per_rank: dict[Any, dict[str, Any]], worst: Any) -> dict[str, Any] | None:
    """The neighbour the most-waiting stage waits for, when the stages are unbalanced (its bubble
    at least MIN_SHARE of the step below the waiting one's), with its ledger lines (waits left
    out) beyond the waiting stage's: what makes that stage slow."""
    peers = [str(p) for p in per_rank[worst]["peers"] if str(p) in per_rank]
    if not peers:
        return None
    slow = min(peers, key=lambda r: per_rank[r]["share_of_step"])
    if per_rank[worst]["share_of_step"] - per_rank[slow]["share_of_step"] < 2 * MIN_SHARE:
        return None
    led = steady_ledger(run)
    cats = [c for c in list(ledger_mod.CATEGORIES) + ["unexplained"] if c not in ("sync", "collective")]
    means = led.groupby("rank")[[f"{c}_s" for c in cats]].mean()
    if slow not in means.index or worst not in means.index:
        return None
    beyond = (means.loc[slow] - means.loc[worst]).to_numpy()
    lines = {c: round(float(x), 4) for c, x in sorted(zip(cats, beyond), key=lambda kv: -kv[1]) if x > 0.0005}
    return {"rank": slow, "waited_for_by": worst, "ledger_beyond_per_step_s": lines} if lines else None


# -- 3. ranks that do not wait for each other --------------------------------------------------
def _by_step_time(run: RunRecord, ranks: list[Any]) -> list[Finding]:
    step_s = {r: ev.median_step_s(run, r) for r in ranks}
    known = {r: v for r, v in step_s.items() if v}
    if len(known) < 2:
        return []
    slow = max(known, key=known.__getitem__)
    fast = min(known, key=known.__getitem__)
    diff = known[slow] - known[fast]
    if diff < MIN_WAIT_DIFF_S or diff / known[slow] < 0.2:
        return []
    return [
        Finding(
            id="ranks.straggler",
            title=f"Rank {slow} is {diff / known[fast]:.0%} slower per step than rank {fast}",
            severity=ev.severity_for_share(diff / known[slow]),
            analyzer="ranks",
            summary=f"Median steady step: rank {slow} {known[slow]:.3f} s, rank {fast} {known[fast]:.3f} s.",
            seconds_lost_per_step=diff,
            share_of_step=diff / known[slow],
            evidence={
                "source": "shim step times",
                "median_step_s": {r: round(v, 4) for r, v in known.items()},
            },
            ranks=tuple(ranks),
        )
    ]


def analyze(run: RunRecord) -> list[Finding]:
    steps = run.steps.dropna(subset=["duration_s"])
    ranks = sorted(set(steps["rank"]), key=lambda r: (len(str(r)), str(r)))
    if len(ranks) < 2:
        return []
    spans = sp.collective_spans(run)
    findings = _bubbles(run, ranks, spans)
    if findings:
        # a pipeline: the stage that makes the others wait is the bubble's slow stage (named in
        # it); the few ms by which the stages reach their all-reduce apart follow the schedule
        # and the machine's load, not a straggler
        return findings
    points = sp.meeting_points(run, spans)
    if len(points) and syncs_every_step(run):
        # NCCL: the host does not wait in the collective; it waits in the step's syncs
        found = straggler_from_points(run, ranks, step_points(run), by_step=True)
        if found is None:
            found = straggler_from_points(run, ranks, points)  # a CPU group (gloo) in a GPU job
        if found is None:
            # a rank slow on its GPU only: every host waits for its own GPU about as long, and
            # only the GPUs' NCCL kernels (the torch.profiler window) show who waited
            legacy = by_smallest_wait(run, ranks, sources=("torch.profiler",))
            return findings + (legacy or [])
        return findings + ([found] if found else [])
    if len(points):
        # the ranks meet: the straggler, if any, is who they waited for (none: a healthy job)
        found = straggler_from_points(run, ranks, points)
        return findings + ([found] if found else [])
    if len(spans) and sp.is_point_to_point(spans).all():
        return findings  # they only exchange point to point: bubbles, not stragglers
    legacy = by_smallest_wait(run, ranks)
    if legacy is not None:
        return findings + legacy
    return findings + _by_step_time(run, ranks)
