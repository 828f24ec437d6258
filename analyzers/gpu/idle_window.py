"""gpu_idle's torch.profiler window: the GPU's idle gaps in the profiled steps, each sampled point
tied to what the training thread ran then (the measured call, the user's frame, the innermost
call or the driver call it blocked in), and the line py-spy names in that frame."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core import gpu_window as window
from traindx.derive.sources import source_line

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

    pass


MIN_GAP_NS = 20_000  # shorter gaps are launch latency, not the host's work
# a gap the host's own work makes: the GPU waits longer than the launches between two kernels
# take (tens of µs; a few hundred after a sync, while Python refills the queue)
MIN_HOST_GAP_NS = 250_000
SHIM_FRAME = "_traindx_shim/"  # how the profiler names the shim's frames
OWN_CATEGORY = "traindx"
MAX_POINTS = 2000  # points sampled over a window's idle time, at most
# the host blocked inside the driver (allocating, freeing, waiting for the GPU, a synchronous
# copy) is not the host's own work: those calls have their findings (allocator, host_sync,
# pageable copies)
BLOCKING_RUNTIME = re.compile(
    r"^(?:cudaMalloc|cudaFree|cuMemAlloc|cuMemFree|cudaHostAlloc|"
    r"cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|"
    r"cuStreamSynchronize|cuCtxSynchronize|cudaMemcpy)"
)


# -- the window: idle gaps tied to the host's code -----------------------------------------------
def main_tid(py: pd.DataFrame) -> Any:
    """The training thread among the profiled Python threads: the busiest one that is not
    traindx's own (the shim's 50 Hz host sampler wakes often enough to out-count a training
    thread of few, long steps)."""
    if not len(py):
        return None
    ours = set(py["tid"][py["name"].str.contains(SHIM_FRAME, regex=False).to_numpy()])
    counts = py["tid"].value_counts()
    theirs = [t for t in counts.index if t not in ours]
    return theirs[0] if theirs else counts.index[0]


def frames_at(py: pd.DataFrame, t: Any) -> Any:
    """(innermost user frame (file, def line, function) or None, innermost call name) at t."""
    users, calls = _frames_at_points(py, np.array([t], dtype=np.int64))
    return users[0], calls[0]


def _innermost(starts: np.ndarray, ends: np.ndarray, order: np.ndarray, points: np.ndarray) -> Any:
    """Index (into the event arrays) of the innermost event enclosing each sorted point, -1 for
    none: events of one thread nest, so visiting them by start and overwriting leaves the
    innermost."""
    out = np.full(len(points), -1, dtype=np.int64)
    for i in order:
        lo, hi = np.searchsorted(points, starts[i], "left"), np.searchsorted(points, ends[i], "right")
        if hi > lo:
            out[lo:hi] = i
    return out


def _frames_at_points(py: pd.DataFrame, points: np.ndarray) -> Any:
    """frames_at for many points at once (sorted int64 ns)."""
    users, calls, _ = _frames_and_owner_at_points(py, points)
    return users, calls


def _frames_and_owner_at_points(py: pd.DataFrame, points: np.ndarray) -> Any:
    """(users, calls, ours) for sorted points: ours, where the innermost frame that is not a
    library's is traindx's shim (its own step-end work: writing an event, timing the GPU, and
    the library calls it makes). The shim's wrappers around the job's calls are never that
    frame while the job's code runs inside them (the job's frame is innermer)."""
    if not len(py) or not len(points):
        return [None] * len(points), [None] * len(points), np.zeros(len(points), dtype=bool)
    names = py["name"].to_numpy(object)
    starts, ends = py["start_ns"].to_numpy(np.int64), py["end_ns"].to_numpy(np.int64)
    order = np.argsort(starts, kind="stable")
    parsed = {n: ev.parse_trace_frame(n) for n in set(names)}
    user_name = {n: p for n, p in parsed.items() if p and not ev.is_library_trace_file(p[0])}
    is_user = np.array([n in user_name for n in names], dtype=bool)
    is_ours = np.array([SHIM_FRAME in n for n in names], dtype=bool)
    inner = _innermost(starts, ends, order, points)
    inner_user = _innermost(starts, ends, order[is_user[order]], points)
    inner_ours = _innermost(starts, ends, order[(is_user | is_ours)[order]], points)
    calls = [names[i] if i >= 0 else None for i in inner]
    users = [user_name[names[i]] if i >= 0 else None for i in inner_user]
    ours = np.array([i >= 0 and bool(is_ours[i]) for i in inner_ours], dtype=bool)
    return users, calls, ours


def _categories(spans: pd.DataFrame, points: np.ndarray) -> Any:
    """The measured call (span category) covering each sorted point, 'host' where none does."""
    out = np.full(len(points), "host", dtype=object)
    if not len(spans) or not len(points):
        return out
    starts, ends = spans["start_ns"].to_numpy(np.int64), spans["end_ns"].to_numpy(np.int64)
    cats = spans["cat"].to_numpy(object)
    which = _innermost(starts, ends, np.argsort(starts, kind="stable"), points)
    hit = which >= 0
    out[hit] = cats[which[hit]]
    return out


def window_idle(run: RunRecord, rank: str, trace: pd.DataFrame) -> Any:
    """(per-step idle seconds in the window, rows of idle seconds per step by (category, user
    frame, call)) for one rank's profiled steps; (None, empty) without a usable window."""
    steps = ev.trace_steps(run, rank)
    gpu = trace[trace["cat"].isin(("kernel", "gpu_memcpy", "gpu_memset")).to_numpy()]
    if not len(steps) or not len(gpu):
        return None, pd.DataFrame()
    py = trace[(trace["cat"] == "python_function").to_numpy()]
    py = py[(py["tid"] == main_tid(py)).to_numpy()] if len(py) else py
    spans = run.spans
    spans = spans[(spans["rank"] == rank).to_numpy()] if len(spans) else spans
    busy = sorted(zip(gpu["start_ns"].to_numpy(np.int64), gpu["end_ns"].to_numpy(np.int64)))
    gaps = []
    for step in steps.itertuples():
        s0, s1 = int(step.start_ns), int(step.end_ns)
        cursor = s0
        for a, b in busy:
            if b <= cursor or a >= s1:
                continue
            if a - cursor >= MIN_GAP_NS:
                gaps.append((cursor, a))
            cursor = max(cursor, b)
        if s1 - cursor >= MIN_GAP_NS:
            gaps.append((cursor, s1))
    total = sum(b - a for a, b in gaps)
    n_steps = len(steps)
    if not total:
        return 0.0, pd.DataFrame()
    spacing = max(total / MAX_POINTS, 50_000)  # one point per 50 µs of idle at least
    at: list[float] = []
    weights: list[float] = []
    long_gap: list[bool] = []
    for a, b in gaps:
        n = max(1, int((b - a) // spacing))
        weight = (b - a) / n
        at.extend(a + (k + 0.5) * weight for k in range(n))
        weights.extend([weight / 1e9 / n_steps] * n)
        long_gap.extend([b - a >= MIN_HOST_GAP_NS] * n)
    points = np.asarray(at, dtype=np.int64)  # gaps are in time order: sorted
    users, calls, ours = _frames_and_owner_at_points(py, points)
    runtime = trace[trace["cat"].isin(("cuda_runtime", "cuda_driver")).to_numpy()]
    runtime = runtime[runtime["name"].str.match(BLOCKING_RUNTIME).to_numpy()]
    blocked = _innermost(
        runtime["start_ns"].to_numpy(np.int64),
        runtime["end_ns"].to_numpy(np.int64),
        np.argsort(runtime["start_ns"].to_numpy(np.int64), kind="stable"),
        points,
    )
    runtime_names = runtime["name"].to_numpy(object)
    calls = [runtime_names[b] if b >= 0 else c for b, c in zip(blocked, calls)]
    categories = _categories(spans, points)
    categories[ours & (categories == "host")] = OWN_CATEGORY  # traindx's, not the job's host work
    rows = list(zip(categories, users, calls, long_gap, weights))
    table = pd.DataFrame(rows, columns=["category", "user", "call", "long_gap", "seconds"])
    table["user"] = table["user"].map(lambda u: u if u is None else tuple(u))
    grouped = (
        table.groupby(["category", "user", "call", "long_gap"], dropna=False)["seconds"]
        .sum()
        .reset_index()
        .sort_values("seconds", ascending=False)
    )
    return total / 1e9 / n_steps, grouped


def line_from_pyspy(run: RunRecord, rank: str, user: Any) -> Any:
    """(absolute file, call line) of the user's function `user` = (file, def line, function) in
    the py-spy samples of the training thread inside the step loop: its most sampled line in
    the host's own code (between the measured calls), else its most sampled line. The whole
    run would name set-up lines (model construction, the first CUDA call) that outweigh the
    loop's."""
    if not user:
        return None
    return window.line_in_function(run, rank, user[0], user[2], kind="host")


def job_line_text(file: str | None, line: int | None) -> str:
    return source_line(file, line) or ""


def call_label(call: Any) -> Any:
    call = call or ""
    m = re.match(r"<built-in (?:method|function) (\w+)", call)
    if m:
        return m.group(1)
    parsed = ev.parse_trace_frame(call)
    return f"{parsed[0]}:{parsed[2]}" if parsed else call
