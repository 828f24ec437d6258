"""Derived step tables (the derive layer: numbers from the run record, no judgement).

`step_table` is every rank's steps as columns; `event_seconds` adds, per step, the seconds that
compile/autotune/recompile events and GC pauses cover; `steady_durations` drops each rank's
first step. Analyzers judge from these tables and the report draws them; neither recomputes them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from traindx.derive import ledger as L
from traindx.derive.runview import RunView
from traindx.profiler import gputime

Array = npt.NDArray[Any]

STEP_COLUMNS = ["rank", "step", "start_s", "end_s", "duration_s"]
# kinds of time a step can hold, in the order they win ties ("gc" last: it is not an event span)
EVENT_KINDS = ("compile", "autotune", "dynamo", "gc")
# compile-event kind (the shim's `kind`) -> the kind of time it is
COMPILE_KIND = {"cute_dsl": "compile", "triton": "compile", "triton_autotune": "autotune", "dynamo": "dynamo"}


def run_t0(run: RunView) -> int:
    """The run's time origin (ns): manifest start, else the first recorded event."""
    t0: int = run.manifest.get("start_ns") or (run.t_min or 0)
    return t0


def step_table(run: RunView, t0: int | None = None) -> tuple[pd.DataFrame, str | None]:
    """Every rank's steps as columns (rank, step, start_s, end_s, duration_s), in run.steps
    order, seconds since t0; from the shim, else from the job's log lines. Returns (table,
    source) with source "shim", "log" or None. Vectorised: a thousand ranks have millions of
    steps."""
    t0 = run_t0(run) if t0 is None else t0
    steps = run.steps
    if len(steps):
        start = pd.to_numeric(steps["start_ns"], errors="coerce")
        s = steps[start.notna().to_numpy()]
        table = pd.DataFrame(
            {
                "rank": pd.Series(s["rank"].astype(str).to_numpy(object), dtype=object),
                "step": s["step"].to_numpy(np.int64),
                "start_s": (s["start_ns"].to_numpy(np.int64) - t0) / 1e9,
                "end_s": (s["end_ns"].to_numpy(np.int64) - t0) / 1e9,
                "duration_s": s["duration_s"].to_numpy(np.float64),
            }
        )
        return table, "shim"
    ls = run.log_steps
    ls = ls[ls["step_time_s"].notna() & ls["step"].notna()] if len(ls) else ls
    if not len(ls):
        empty = pd.DataFrame(
            {c: pd.Series(dtype=object if c == "rank" else np.float64) for c in STEP_COLUMNS}
        )
        return empty, None
    duration = ls["step_time_s"].to_numpy(np.float64)
    end = (ls["t"].to_numpy(np.int64) - t0) / 1e9
    table = pd.DataFrame(
        {
            "rank": pd.Series(["0"] * len(ls), dtype=object),
            "step": ls["step"].to_numpy(np.int64),
            "start_s": end - duration,
            "end_s": end,
            "duration_s": duration,
        }
    )
    return table, "log"


def steady_mask(table: pd.DataFrame) -> np.ndarray:
    """True for every step but each rank's first (warm-up); all True when no rank has two."""
    if not len(table):
        return np.zeros(0, bool)
    later = table.groupby("rank", sort=False).cumcount().to_numpy() > 0
    return later if later.any() else np.ones(len(table), bool)


def steady_median(table: pd.DataFrame) -> float | None:
    """The median step time of the steady steps (each rank's first step left out)."""
    d = table["duration_s"].to_numpy(np.float64)[steady_mask(table)]
    return float(np.median(d)) if len(d) else None


def steps_per_rank(table: pd.DataFrame) -> int:
    """The most steps any rank recorded (0 without steps)."""
    return int(table.groupby("rank", sort=False).size().max()) if len(table) else 0


def gc_frame(run: RunView) -> pd.DataFrame:
    """(rank, step, gc) seconds in GC per step: the ledger's gc line when the shim timed GC
    pauses as intervals (start-up's collections then stay in start-up, not in step 0), else the
    shim's per-step aggregates (one grouped sum, not a Python loop over every event)."""

    def frame(rank: Any, step: Any, gc: Any) -> pd.DataFrame:
        return pd.DataFrame(
            {
                "rank": pd.Series(np.asarray(rank).astype(str).astype(object), dtype=object),
                "step": np.asarray(step, np.int64),
                "gc": np.asarray(gc, np.float64),
            }
        )

    try:
        if L.has_spans(run):
            led = run.ledger
            return frame(led["rank"].to_numpy(object), led["step"], led["gc_s"])
    except Exception:  # a ledger that cannot be built: fall back to the shim's aggregates
        pass
    gc = run.gc
    if len(gc) and "total_s" in gc and "step" in gc:
        step = pd.to_numeric(gc["step"], errors="coerce")
        total = pd.to_numeric(gc["total_s"], errors="coerce")
        total = total.where(total.abs() != math.inf).fillna(0.0)
        ok = step.notna() & (step.abs() != math.inf)
        table = pd.DataFrame(
            {
                "rank": gc["rank"][ok].astype(str).to_numpy(object),
                "step": step[ok].astype("int64"),
                "total": total[ok],
            }
        )
        sums = table.groupby(["rank", "step"], sort=False)["total"].sum()
        return frame(sums.index.get_level_values(0), sums.index.get_level_values(1), sums.to_numpy())
    return frame([], [], [])


def event_seconds(table: pd.DataFrame, compiles: list[dict[str, Any]], gc: pd.DataFrame) -> Array:
    """(steps x EVENT_KINDS) seconds each step spent in each kind of event: compile events'
    overlap with the step's window, and the step's GC seconds (clamped to the step: the first
    GC aggregate also holds collections from before step 0). compiles: dicts with rank, kind,
    start_s, end_s (report.compiles.compile_events)."""
    n = len(table)
    secs = np.zeros((n, len(EVENT_KINDS)))
    if not n:
        return secs
    by_rank: dict[str, list[dict[str, Any]]] = {}
    for e in compiles:
        by_rank.setdefault(e["rank"], []).append(e)
    if by_rank:
        groups = table.groupby("rank", sort=False).indices
        s0, s1 = table["start_s"].to_numpy(np.float64), table["end_s"].to_numpy(np.float64)
        for rank, events in by_rank.items():
            idx = groups.get(rank)
            if idx is None:
                continue
            a, b = s0[idx], s1[idx]
            for e in events:
                ov = np.minimum(b, e["end_s"]) - np.maximum(a, e["start_s"])
                hit = ov > 0
                if hit.any():
                    col = EVENT_KINDS.index(COMPILE_KIND.get(e["kind"], "compile"))
                    secs[idx[hit], col] += ov[hit]
    if len(gc):
        g = table[["rank", "step"]].merge(gc, on=["rank", "step"], how="left")["gc"].to_numpy(np.float64)
        secs[:, -1] = np.minimum(np.nan_to_num(g), table["duration_s"].to_numpy(np.float64))
    return secs


def gaps_table(table: pd.DataFrame, floor_s: float) -> list[dict[str, Any]]:
    """Wall time between one step's end and the next one's start (same rank) of at least
    floor_s: evaluation, checkpointing, a profiler export; no step's duration counts it."""
    if len(table) < 2:
        return []
    rank = table["rank"].to_numpy(object)
    same = rank[1:] == rank[:-1]
    start, end, step = (
        table["start_s"].to_numpy(np.float64),
        table["end_s"].to_numpy(np.float64),
        table["step"].to_numpy(np.int64),
    )
    gap = start[1:] - end[:-1]
    return [
        {
            "rank": rank[i],
            "after_step": int(step[i]),
            "before_step": int(step[i + 1]),
            "start_s": float(end[i]),
            "end_s": float(start[i + 1]),
            "duration_s": float(gap[i]),
        }
        for i in np.flatnonzero(same & (gap >= floor_s))
    ]


def compile_span(start_ns: Any, end_ns: Any, duration_s: Any, t0: int) -> tuple[float, float] | None:
    """(start_s, end_s) since t0 of one compile event (start from end - duration when only the
    end was recorded), or None without a time."""

    def num(v: Any) -> float | None:
        try:
            f = float(v)
        except (TypeError, ValueError):
            return None
        return None if math.isnan(f) or math.isinf(f) else f

    start, end = num(start_ns), num(end_ns)
    if start is None and end is not None:
        start = end - (num(duration_s) or 0) * 1e9
    if start is None:
        return None
    end = end if end is not None else start
    return (start - t0) / 1e9, (end - t0) / 1e9


def compile_spans(run: RunView, t0: int | None = None) -> list[dict[str, Any]]:
    """Every compile event as {rank, kind, start_s, end_s} (what event_seconds reads)."""
    t0 = run_t0(run) if t0 is None else t0
    df = run.compiles
    out = []
    for c in df.itertuples() if len(df) else []:
        span = compile_span(c.start_ns, c.end_ns, c.duration_s, t0)
        if span is not None:
            out.append({"rank": str(c.rank), "kind": str(c.kind), "start_s": span[0], "end_s": span[1]})
    return out


# where step times come from: the shim's boundaries (on the GPU's clock when the job ran CUDA
# work: "shim:gpu"), else the job's own log
SHIM_SOURCES = ("shim", "shim:gpu")


def gpu_step_seconds(run: RunView) -> pd.Series:
    """Per (rank, step): the GPU's time from one step boundary to the next (the shim's CUDA
    events at the boundaries, traindx.profiler.gputime), empty without GPU work."""
    _, table = gputime.for_run(run)
    if not len(table):
        return pd.Series([], dtype=float)
    table = table.dropna(subset=["gpu_s"])
    table = table[table["gpu_s"] > 0]
    return table.set_index(["rank", "step"])["gpu_s"].astype(float)


def progress_step_seconds(run: RunView) -> tuple[pd.Series, str | None]:
    """Step durations in seconds, in step order (a Series indexed by step number): the shim's
    optimizer steps (the slowest rank's duration per step, since a synchronous job waits for
    it), else the job's own log; and where they came from.

    A job that runs CUDA work is timed on the GPU's clock between the same boundaries: a host
    that queues work ahead of the GPU ends its steps early (a short run with no sync never
    waits for the queue), so its own step times measure how fast it queues, not how fast the
    job trains (measured on an H200: host steps 2.8 ms, the GPU's 5.3 ms, for a job with no
    sync); the GPU's boundary-to-boundary time is the job's progress whichever side is slower.
    Steps without a GPU time (dropped, during a graph capture) keep the host's."""
    steps = run.steps.dropna(subset=["duration_s"])
    if len(steps) and "rank" not in steps:
        return steps.groupby("step")["duration_s"].max().sort_index().astype(float), "shim"
    if len(steps):
        host = steps.groupby(["rank", "step"])["duration_s"].max().astype(float)
        gpu = gpu_step_seconds(run)
        source = "shim"
        if len(gpu):
            common = host.index.intersection(gpu.index)
            if len(common):
                host = host.copy()
                host.loc[common] = gpu.loc[common].to_numpy()
                source = "shim:gpu"
        return host.groupby(level="step").max().sort_index().astype(float), source
    log = run.log_steps.dropna(subset=["step_time_s"]) if len(run.log_steps) else run.log_steps
    if len(log):
        return log.groupby("step")["step_time_s"].last().sort_index().astype(float), "log"
    return pd.Series([], dtype=float), None


def backwards_per_step(run: RunView) -> pd.Series:
    """Backward calls (the shim's `backward` spans) that began inside each step, by step number
    (the largest count over the ranks): the micro-batches one optimizer step holds. Empty when
    the shim recorded no step boundary or no backward."""
    steps, spans = run.steps, run.spans
    if not len(steps) or not len(spans):
        return pd.Series([], dtype=float)
    steps = steps.dropna(subset=["start_ns", "end_ns"])
    bwd = spans[spans["cat"] == "backward"]
    counts: dict[int, int] = {}
    by_rank = bwd.groupby("rank", sort=False) if "rank" in bwd else [(None, bwd)]
    for rank, rows in by_rank:
        own = steps[steps["rank"] == rank] if rank is not None and "rank" in steps else steps
        own = own.sort_values("start_ns")
        if not len(own):
            continue
        start = own["start_ns"].to_numpy(np.int64)
        end = own["end_ns"].to_numpy(np.int64)
        at = rows["start_ns"].to_numpy(np.int64)
        i = np.searchsorted(start, at, side="right") - 1
        inside = (i >= 0) & (at < end[np.maximum(i, 0)])
        for step, n in zip(*np.unique(own["step"].to_numpy()[i[inside]], return_counts=True), strict=True):
            counts[int(step)] = max(counts.get(int(step), 0), int(n))
    return pd.Series(counts, dtype=float).sort_index()
