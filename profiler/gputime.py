"""The GPU's busy and idle time per rank-step, from the shim's `gpu_time` events (CUDA events
recorded at the measured boundaries: profiler/shim/_traindx_shim/gputime.py). Derive layer: no
judgement here.

Each mark is a pair (host time h, GPU time g): the event was recorded at h and completed at g,
once the GPU had finished everything queued before it. The event's elapsed times give g exactly
on the GPU's clock, relative to the step's first mark; the GPU clock is placed on the host clock
by g >= h for every mark (an event cannot complete before it is recorded), tight at the marks
where the GPU had caught up with the host (its queue empty): offset = max(h - g) over a few
steps around each step (a rolling window, so the two clocks' drift over a long run stays out).

A stretch is the time between two consecutive marks. Over stretch [h0, h1] the GPU runs, from
g0 on, only the work the host queued inside it, so:
  - a stretch that queues no GPU work (inside a DataLoader fetch, a garbage collection) idles
    the GPU for exactly g1 - g0 (nothing to align: both on the GPU's clock);
  - any other stretch idles it for at most min(g1 - g0, max(0, h1 - g0)): after h1 everything is
    queued and the GPU runs to g1 without a gap; before g0 it was busy with earlier work. The
    least is 0 (the stretch's own work may fill the gap).
So each step's idle time has a floor (the kernel-free stretches) and a ceiling; busy = GPU
interval - idle. The idle interval of a stretch on the host clock is [g0, min(g1, h1)]: what the
host did then is what the GPU waited for (analyzers tie it to the ledger and py-spy).
"""

from typing import Any

import numpy as np
import pandas as pd

from traindx.profiler.shim._traindx_shim.gputime import GPU_TIME_EVENT  # the shim's event type

# (step, [(mark label, host ns, GPU us since the step's first mark)]) of one step
StepMarks = tuple[int, list[tuple[str, int, float]]]

KERNEL_FREE_OPEN = {"data>": "data", "gc>": "gc"}
KERNEL_FREE_CLOSE = {"data<": "data", "gc<": "gc"}
ALIGN_WINDOW_STEPS = 8  # steps each side whose marks place one step's GPU clock on the host's
STRETCH_COLUMNS = [
    "rank",
    "step",
    "seq",
    "from",
    "to",
    "line",
    "host_start_ns",
    "host_end_ns",
    "gpu_start_ns",
    "gpu_end_ns",
    "gpu_s",
    "kernel_free",
    "idle_min_s",
    "idle_max_s",
    "idle_from_ns",
    "idle_to_ns",
]
STEP_COLUMNS = [
    "rank",
    "step",
    "start_ns",
    "end_ns",
    "wall_s",
    "gpu_s",
    "idle_min_s",
    "idle_max_s",
    "busy_min_s",
    "busy_max_s",
    "busy_min_share",
    "busy_max_share",
    "lag_end_s",
    "top_idle_line",
    "top_idle_s",
]
# the ledger line (traindx.derive.ledger) a stretch belongs to, by the marks around it
MEASURED = {("bwd>", "bwd<"): "backward", ("opt>", "opt<"): "optimizer"}
# a measured call's start and end marks: a stretch between them is that call's, even when other
# marks fall inside it (the step boundary is marked inside optimizer.step)
CALL_OPEN = {"bwd>": "backward", "opt>": "optimizer"}
CALL_CLOSE = {"bwd<": "backward", "opt<": "optimizer"}


def line_of(first: str, last: str, kernel_free_region: str | None, open_call: str | None = None) -> str:
    """The ledger line of the stretch between marks `first` and `last`: a measured call, the
    kernel-free region it lies in (data, gc), the measured call it lies in (`open_call`), a
    sync's wait (the stretch ends where a sync span ends), else the training thread's own code
    between its measured calls ('host')."""
    if kernel_free_region:
        return kernel_free_region
    if (first, last) in MEASURED:
        return MEASURED[(first, last)]
    if open_call:
        return open_call
    if last in ("sync<", "coll<", "io<"):
        return {"sync<": "sync", "coll<": "collective", "io<": "io"}[last]
    return "host"


def _marks_of(events: pd.DataFrame) -> dict[Any, list[StepMarks]]:
    """Per rank, the steps' marks in step order: [(step, [(label, h_ns, g_us)...])]."""
    out: dict[Any, list[StepMarks]] = {}
    if not len(events) or "marks" not in events:
        return out
    for rank, rows in events.groupby("rank", sort=True):
        seq = []
        for step, marks in zip(rows["step"], rows["marks"]):
            try:
                parsed = [(str(m[0]), int(m[1]), float(m[2])) for m in marks]
            except (TypeError, ValueError, IndexError):
                continue
            if len(parsed) >= 2:
                seq.append((int(step), parsed))
        seq.sort(key=lambda item: item[0])
        out[rank] = seq
    return out


def _place(seq: list[StepMarks]) -> list[list[float]]:
    """Absolute GPU times (host-clock ns) of every mark of one rank's steps."""
    # chains of steps: a step's first mark is the previous step's last when they are consecutive
    chains: list[list[int]] = []
    for i, (step, marks) in enumerate(seq):
        if i and seq[i - 1][0] + 1 == step and seq[i - 1][1][-1][1] == marks[0][1]:
            chains[-1].append(i)
        else:
            chains.append([i])
    placed: list[list[float]] = [[] for _ in seq]
    for chain in chains:
        rel: list[float] = []
        total = 0.0  # ns from the chain's first mark to each step's first mark
        for j, i in enumerate(chain):
            if j:
                total += seq[chain[j - 1]][1][-1][2] * 1000.0
            rel.append(total)
        slack = np.array(
            [max(h - (rel[j] + g * 1000.0) for _, h, g in seq[i][1]) for j, i in enumerate(chain)]
        )
        w = ALIGN_WINDOW_STEPS
        for j, i in enumerate(chain):
            offset = slack[max(0, j - w) : j + w + 1].max()
            placed[i] = [offset + rel[j] + g * 1000.0 for _, _, g in seq[i][1]]
    return placed


def stretches(events: pd.DataFrame) -> pd.DataFrame:
    """One row per stretch between consecutive marks (STRETCH_COLUMNS); times in ns."""
    rows = []
    for rank, seq in _marks_of(events).items():
        placed = _place(seq)
        open_regions: list[str] = []
        open_call: str | None = None
        previous: int | None = None
        for (step, marks), gs in zip(seq, placed):
            if previous is not None and step != previous + 1:
                open_call = None  # a step missing in between: what was open is unknown
            previous = step
            for k in range(len(marks) - 1):
                (la, ha, _), (lb, hb, _) = marks[k], marks[k + 1]
                if la in KERNEL_FREE_OPEN:
                    open_regions.append(KERNEL_FREE_OPEN[la])
                elif la in KERNEL_FREE_CLOSE and KERNEL_FREE_CLOSE[la] in open_regions:
                    open_regions.remove(KERNEL_FREE_CLOSE[la])
                if la in CALL_OPEN:
                    open_call = CALL_OPEN[la]
                elif la in CALL_CLOSE:
                    open_call = None
                ga, gb = gs[k], gs[k + 1]
                gpu = max(0.0, gb - ga)
                free = bool(open_regions)
                line = line_of(la, lb, open_regions[-1] if open_regions else None, open_call)
                if free:
                    idle_min = idle_max = gpu
                    idle_to = ga + gpu
                else:
                    idle_min, idle_max = 0.0, min(gpu, max(0.0, hb - ga))
                    idle_to = ga + idle_max
                rows.append(
                    (
                        rank,
                        step,
                        k,
                        la,
                        lb,
                        line,
                        ha,
                        hb,
                        int(ga),
                        int(gb),
                        gpu / 1e9,
                        free,
                        idle_min / 1e9,
                        idle_max / 1e9,
                        int(ga),
                        int(idle_to),
                    )
                )
            # a step's last mark opens nothing (it is the next step's first: counted there)
    return pd.DataFrame(rows, columns=STRETCH_COLUMNS)


def steps_table(stretch_rows: pd.DataFrame) -> pd.DataFrame:
    """One row per rank-step (STEP_COLUMNS): its wall time on the host, its span on the GPU, the
    GPU's idle time (floor, ceiling) and busy time (floor, ceiling; shares of the wall time)."""
    if not len(stretch_rows):
        return pd.DataFrame(columns=STEP_COLUMNS)
    g = stretch_rows.groupby(["rank", "step"], sort=True)
    out = g.agg(
        start_ns=("host_start_ns", "min"),
        end_ns=("host_end_ns", "max"),
        gpu_start=("gpu_start_ns", "min"),
        gpu_end=("gpu_end_ns", "max"),
        idle_min_s=("idle_min_s", "sum"),
        idle_max_s=("idle_max_s", "sum"),
    ).reset_index()
    out["wall_s"] = (out["end_ns"] - out["start_ns"]) / 1e9
    out["gpu_s"] = (out["gpu_end"] - out["gpu_start"]) / 1e9
    out["busy_min_s"] = (out["gpu_s"] - out["idle_max_s"]).clip(lower=0.0)
    out["busy_max_s"] = (out["gpu_s"] - out["idle_min_s"]).clip(lower=0.0)
    wall = out["wall_s"].where(out["wall_s"] > 0)
    out["busy_min_share"] = (out["busy_min_s"] / wall).clip(upper=1.0)
    out["busy_max_share"] = (out["busy_max_s"] / wall).clip(upper=1.0)
    out["lag_end_s"] = (out["gpu_end"] - out["end_ns"]) / 1e9  # how far the GPU trailed the host
    by_line = (
        stretch_rows.groupby(["rank", "step", "line"], sort=False)["idle_max_s"]
        .sum()
        .reset_index()
        .sort_values("idle_max_s", ascending=False)
        .drop_duplicates(["rank", "step"])
    )
    out = out.merge(
        by_line.rename(columns={"line": "top_idle_line", "idle_max_s": "top_idle_s"}),
        on=["rank", "step"],
        how="left",
    )
    return out[STEP_COLUMNS]


BUSY_COLUMNS = ["rank", "start_ns", "end_ns"]


def busy_before(stretch_rows: pd.DataFrame) -> pd.DataFrame:
    """Per rank, the host-clock intervals in which the GPU still ran work the host had queued
    before them (BUSY_COLUMNS): over stretch [h0, h1] the GPU finishes the earlier work at g0,
    so it is busy with it over [h0, min(h1, g0)]. g0 is placed at or before the true finish
    (the placement is tight only where the GPU caught up), so these intervals never overstate
    it. Whatever the host does then - waits in a sync or a blocking copy, or runs loop code
    that the GPU's queue hides - does not set the step's time: the GPU does."""
    if not len(stretch_rows):
        return pd.DataFrame(columns=BUSY_COLUMNS)
    start = stretch_rows["host_start_ns"].to_numpy(np.int64)
    end = np.minimum(
        stretch_rows["host_end_ns"].to_numpy(np.int64), stretch_rows["gpu_start_ns"].to_numpy(np.int64)
    )
    keep = end > start
    return pd.DataFrame(
        {"rank": stretch_rows["rank"].to_numpy(object)[keep], "start_ns": start[keep], "end_ns": end[keep]}
    )


def for_run(run: Any) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(stretches, steps) of a run, derived once and shared (run.cached)."""

    def build() -> tuple[pd.DataFrame, pd.DataFrame]:
        events = run.of_type(GPU_TIME_EVENT) if hasattr(run, "of_type") else pd.DataFrame()
        rows = stretches(events)
        return rows, steps_table(rows)

    if hasattr(run, "cached"):
        cached: tuple[pd.DataFrame, pd.DataFrame] = run.cached("gpu_time", build)
        return cached
    return build()
