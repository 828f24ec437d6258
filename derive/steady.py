"""Which steps to measure: the warm-up, the torch.profiler window (slower by design) and the
steady window between them, per rank. Derived from the run record; no judgement."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import pandas as pd

from traindx.common import untrusted
from traindx.derive.runview import RunView
from traindx.profiler.proctree import STOPPED_FILE
from traindx.profiler.shim._traindx_shim import schema


def profiled_steps(run: RunView, traced_only: bool = False) -> dict[str, set[int]]:
    """{rank: set(step)} of the steps inside a torch.profiler window (slower by design);
    traced_only: only the windows whose trace was written (one that stood down for its cost
    left none: its steps hold no events)."""
    out = {}
    for e in events_of_type(run, schema.TORCH_PROFILE).itertuples():
        first, last = getattr(e, "first_step", float("nan")), getattr(e, "last_step", float("nan"))
        stood_down = getattr(e, "stood_down", None)
        if traced_only and isinstance(stood_down, str) and stood_down:
            continue
        if pd.notna(first) and pd.notna(last):
            out.setdefault(e.rank, set()).update(range(int(first), int(last) + 1))
    return out


def stopped_intervals(run: RunView) -> list[tuple[int, int, int]]:
    """(pid, start_ns, end_ns) of each stop of one of the job's processes by a signal (state T:
    SIGSTOP), as the launcher saw it (manifest "stopped"; while the job runs, its file of the
    stops so far); unreadable entries skipped."""
    stops = run.manifest.get("stopped") if isinstance(run.manifest, dict) else None
    if stops is None:  # the job still runs: the launcher's file of the stops so far
        try:  # a run folder's file: no link, FIFO or device (untrusted)
            stops = untrusted.load_json(os.path.join(run.path, STOPPED_FILE))
        except (OSError, ValueError, TypeError):
            stops = []
    out = []
    for s in stops if isinstance(stops, list) else []:
        try:
            start, end = int(s["start_ns"]), int(s["end_ns"])
            pid = int(s.get("pid") or 0)
        except (TypeError, ValueError, KeyError, AttributeError):
            continue
        if end >= start:
            out.append((pid, start, end))
    return out


def stopped_steps(run: RunView) -> dict[str, set[int]]:
    """{rank: set(step)} of the steps a stop of the job overlaps (every rank: a stopped process
    holds up those that wait for it)."""
    stops = stopped_intervals(run)
    steps = run.steps
    if not stops or not len(steps) or "start_ns" not in steps or "end_ns" not in steps:
        return {}
    start = pd.to_numeric(steps["start_ns"], errors="coerce").to_numpy(np.float64)
    end = pd.to_numeric(steps["end_ns"], errors="coerce").to_numpy(np.float64)
    hit = np.zeros(len(steps), bool)
    for _, a, b in stops:
        hit |= (start <= b) & (end >= a)
    out: dict[str, set[int]] = {}
    for rank, step in zip(steps["rank"][hit], steps["step"][hit]):
        out.setdefault(str(rank), set()).add(int(step))
    return out


# why a steady measure leaves a step out, in the words a card or a report gives a reader
PROFILER_WINDOW = "inside a torch.profiler window (slower by design)"
AFTER_PROFILER_WINDOW = (
    "the step after a torch.profiler window (its stop drains the device: the step starts with an empty queue)"
)
STOPPED = "the job was stopped by a signal (SIGSTOP) during it: not its code's time"
MEMORY_HUNT = "traindx's memory hunt ran (tracemalloc and its censuses slow these steps)"


def perturbed_causes(run: RunView) -> dict[str, dict[str, set[int]]]:
    """{why: {rank: set(step)}} of the steps a steady measure leaves out, by cause (the keys
    are PROFILER_WINDOW, AFTER_PROFILER_WINDOW, STOPPED, MEMORY_HUNT, in that order; a step may
    be under several). The window's stop collects kineto's events after the device has drained,
    so on a GPU-bound job the next step starts with an empty queue and its host time is the
    host's alone (H200, a 22 ms GPU step: 6 ms after each window)."""
    window = profiled_steps(run)
    after = {rank: {s + 1 for s in steps if s + 1 not in steps} for rank, steps in window.items()}
    causes = {
        PROFILER_WINDOW: window,
        AFTER_PROFILER_WINDOW: after,
        STOPPED: stopped_steps(run),
        MEMORY_HUNT: memory_hunt_steps(run),
    }
    return {why: by_rank for why, by_rank in causes.items() if any(by_rank.values())}


def perturbed_steps(run: RunView) -> dict[str, set[int]]:
    """{rank: set(step)} a steady measure leaves out: every cause of perturbed_causes (the
    torch.profiler window's steps and the step after each window, the steps a stop of the job
    overlaps, the steps traindx's memory hunt slowed)."""
    out: dict[str, set[int]] = {}
    for by_rank in perturbed_causes(run).values():
        for rank, steps in by_rank.items():
            out.setdefault(rank, set()).update(steps)
    return out


def memory_hunt_steps(run: RunView) -> dict[str, set[int]]:
    """{rank: set(step)} the shim's memory hunt slowed (memwatch.py): it runs at a step's end, so
    its censuses land in the next step, and tracemalloc slows the steps in between."""
    out: dict[str, set[int]] = {}
    begun = events_of_type(run, schema.MEM_HUNT)
    if not len(begun):
        return out
    held = events_of_type(run, schema.MEM_HELD)
    for e in begun.itertuples():
        first = int(e.step) + 1
        done = held[(held["rank"] == e.rank) & (held["since_step"] == e.step)] if len(held) else held
        last = int(done["step"].iloc[0]) + 1 if len(done) else first + 64
        out.setdefault(str(e.rank), set()).update(range(first, last + 1))
    return out


def warmup_count(durations: Sequence[float]) -> int:
    """How many leading steps are warm-up: step 0 always (imports, first compiles, allocator);
    then every leading step slower than 1.5x the median of the second half (at most half)."""
    n = len(durations)
    if n == 0:
        return 0
    reference = float(pd.Series(durations[n // 2 :]).median())
    count = 1
    while count < n // 2 and durations[count] > 1.5 * reference:
        count += 1
    return count


def steady_steps(run: RunView, rank: str | None = None, keep_profiled: bool = False) -> pd.DataFrame:
    """The steps of the steady window, per rank: no warm-up, no torch.profiler window (nor the
    step after it: perturbed_steps).
    Built once per run for every rank (vectorised warm-up count), then sliced per rank."""
    key = ("steady_steps", keep_profiled)
    table = run.cached(key, lambda: _steady_all(run, keep_profiled))
    if rank is None:
        return table.copy(deep=False)
    return run.rank_rows(key, rank, table)


def _steady_all(run: RunView, keep_profiled: bool) -> pd.DataFrame:
    steps = run.steps.dropna(subset=["duration_s"])
    if not len(steps):
        return steps.iloc[0:0]
    # rank order as groupby gives it, step order within a rank
    steps = steps.sort_values(["rank", "step"], kind="stable")
    rank = steps["rank"]
    pos = steps.groupby("rank", sort=False).cumcount().to_numpy()
    n = rank.map(rank.value_counts()).to_numpy()
    d = steps["duration_s"].to_numpy(np.float64)
    second_half = pos >= n // 2
    ref = steps["duration_s"][second_half].groupby(rank[second_half], sort=False).median()
    ref = rank.map(ref).to_numpy(np.float64)
    # warmup_count per rank: step 0, then the leading steps slower than 1.5x the reference
    stop = (pos >= 1) & ~(d > 1.5 * ref)
    first_stop = (
        pd.Series(np.where(stop, pos, np.iinfo(np.int64).max), index=steps.index)
        .groupby(rank, sort=False)
        .transform("min")
        .to_numpy()
    )
    count = np.maximum(1, np.minimum(first_stop, n // 2))
    out = steps[pos >= count]
    if not keep_profiled:
        profiled = perturbed_steps(run)
        if profiled:
            pairs = {(r, int(s)) for r, ss in profiled.items() for s in ss}
            keys = pd.MultiIndex.from_arrays([out["rank"], out["step"].astype(np.int64)])
            out = out[~keys.isin(list(pairs))]
    return out


def steps_seconds(run: RunView, rank: str) -> float:
    """Total seconds of all the completed steps of a rank: what py-spy seconds spent in the
    training loop compare against (py-spy has no timestamps; set-up and exit are not steps)."""
    steps = run.rank_steps(rank).dropna(subset=["duration_s"])
    return float(steps["duration_s"].sum()) if len(steps) else 0.0


def median_step_s(run: RunView, rank: str | None = None) -> float | None:
    steady = steady_steps(run, rank)
    if len(steady):
        return float(steady["duration_s"].median())
    steps = run.steps.dropna(subset=["duration_s"])
    if len(steps):
        return float(steps["duration_s"].median())
    # no shim (attach, --no-shim): the step time the job prints itself, if it does
    logged = run.log_steps["step_time_s"].dropna() if len(run.log_steps) else pd.Series(dtype=float)
    return float(logged.iloc[len(logged) // 4 :].median()) if len(logged) else None


def step_of(run: RunView, rank: str, t_ns: int) -> int | None:
    steps = run.rank_steps(rank)
    hit = steps[(steps["start_ns"] <= t_ns) & (steps["end_ns"] >= t_ns)]
    return None if not len(hit) else int(hit["step"].iloc[0])


def trace_steps(run: RunView, rank: str) -> pd.DataFrame:
    """Steps of `rank` inside its torch.profiler windows that wrote a trace, as rows of
    run.steps."""
    steps = run.rank_steps(rank)
    return steps[steps["step"].isin(profiled_steps(run, traced_only=True).get(rank, set()))]


def events_of_type(run: object, type_: str) -> pd.DataFrame:
    """The events of one type: RunRecord.of_type (the per-type table); for a record-like object
    with only a wide `events` frame, that frame filtered."""
    if hasattr(run, "of_type"):
        table: pd.DataFrame = run.of_type(type_)
        return table
    events = getattr(run, "events", None)
    if events is None or not len(events) or "type" not in events:
        return pd.DataFrame()
    return events[events["type"] == type_].dropna(axis=1, how="all")
