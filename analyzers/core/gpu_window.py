"""Exact interval arithmetic over the torch.profiler window's GPU timeline, shared by the GPU
analyzers (gpu_idle, allocator, host_sync, launch_bound), and the user's line of a function
from py-spy's samples of the step loop.

What each analyzer asks of the window is one of: when was the GPU idle in the profiled steps,
and how much of that idle lies inside given host calls (the host blocked in cudaMalloc, in a
synchronous copy, in a sync). The GPU is busy while any kernel, copy or memset runs on any
stream; idle is the rest of each profiled step.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core import stacks  # the loop window and a sample's kind: defined there once
from traindx.derive.sources import source_line

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
# the host waiting inside the driver: the GPU's idle while the host is in one of these is the
# call's cost, not the cost of launching kernels (allocator, syncs, synchronous copies)
ALLOCATOR_CALLS = re.compile(
    r"^(?:cudaMalloc|cudaFree|cuMemAlloc|cuMemFree|cuMemCreate|"
    r"cuMemRelease|cuMemMap|cuMemUnmap)"
)


def merged(starts: Any, ends: Any) -> np.ndarray:
    """The union of intervals [start, end) as a sorted (n, 2) int64 array."""
    s, e = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    if not len(s):
        return np.empty((0, 2), np.int64)
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    out = []
    a, b = int(s[0]), int(e[0])
    for x, y in zip(s[1:].tolist(), e[1:].tolist()):
        if x > b:
            out.append((a, b))
            a, b = x, y
        else:
            b = max(b, y)
    out.append((a, b))
    return np.asarray(out, np.int64)


def overlap_s(a: np.ndarray, b: np.ndarray) -> float:
    """Seconds in both unions of intervals a and b (each merged, sorted)."""
    if not len(a) or not len(b):
        return 0.0
    total = 0
    for lo_b, hi_b in b.tolist():
        lo = int(np.searchsorted(a[:, 1], lo_b, "right"))
        hi = int(np.searchsorted(a[:, 0], hi_b, "left"))
        if hi > lo:
            part = a[lo:hi]
            total += int((np.minimum(part[:, 1], hi_b) - np.maximum(part[:, 0], lo_b)).clip(min=0).sum())
    return total / 1e9


def idle_intervals(trace: pd.DataFrame, start_ns: int, end_ns: int, opens_window: bool = False) -> np.ndarray:
    """The GPU's idle intervals in [start_ns, end_ns): no kernel, copy or memset running. In
    the first step of a window (`opens_window`) the GPU may still run work queued before the
    profiler started, which it does not record: the idle before its first recorded work is
    unknown, and left out."""
    gpu = trace[
        trace["cat"].isin(GPU_WORK).to_numpy()
        & (trace["end_ns"] > start_ns).to_numpy()
        & (trace["start_ns"] < end_ns).to_numpy()
    ]
    busy = merged(
        np.clip(gpu["start_ns"].to_numpy(np.int64), start_ns, end_ns),
        np.clip(gpu["end_ns"].to_numpy(np.int64), start_ns, end_ns),
    )
    out, cursor = [], int(start_ns)
    if opens_window:
        if not len(busy):
            return np.empty((0, 2), np.int64)
        cursor = int(busy[0, 0])
    for a, b in busy.tolist():
        if a > cursor:
            out.append((cursor, a))
        cursor = max(cursor, b)
    if end_ns > cursor:
        out.append((cursor, int(end_ns)))
    return np.asarray(out, np.int64).reshape(-1, 2)


def window_steps(run: RunRecord, rank: str, trace: pd.DataFrame) -> Any:
    """[(step, start_ns, end_ns, idle intervals)] of one rank's profiled steps."""
    steps = ev.trace_steps(run, rank)
    profiled = {int(s) for s in steps["step"]}
    return [
        (
            int(s.step),
            int(s.start_ns),
            int(s.end_ns),
            idle_intervals(
                trace, int(s.start_ns), int(s.end_ns), opens_window=int(s.step) - 1 not in profiled
            ),
        )
        for s in steps.itertuples()
    ]


def idle_in_calls_per_step(run: RunRecord, rank: str, trace: pd.DataFrame, pattern: Any) -> float | None:
    """Seconds per profiled step the GPU idles while the host is inside a runtime/driver call
    whose name matches `pattern` (any thread); None without profiled steps or GPU work."""
    if not len(trace) or not trace["cat"].isin(GPU_WORK).any():
        return None
    steps = window_steps(run, rank, trace)
    if not steps:
        return None
    calls = trace[trace["cat"].isin(("cuda_runtime", "cuda_driver")).to_numpy()]
    calls = calls[calls["name"].str.match(pattern).to_numpy()]
    inside = merged(calls["start_ns"], calls["end_ns"])
    return sum(overlap_s(idle, inside) for _, _, _, idle in steps) / len(steps)


def busy_per_step(run: RunRecord, rank: str, trace: pd.DataFrame) -> tuple[float, float] | None:
    """(mean profiled step, mean GPU busy seconds in it), or None."""
    steps = window_steps(run, rank, trace)
    if not steps:
        return None
    wall = float(np.mean([(b - a) / 1e9 for _, a, b, _ in steps]))
    idle = float(np.mean([float((i[:, 1] - i[:, 0]).sum()) / 1e9 for _, _, _, i in steps]))
    return wall, max(0.0, wall - idle)


def line_in_function(
    run: RunRecord, rank: str, file: str, function: Any, kind: str | None = None, calling: str | None = None
) -> Any:
    """(absolute file, line) of the job's function `function` in `file` (any directory) most
    sampled by py-spy on the training thread inside the step loop (start-up and teardown left
    out); with `kind` ("host", "forward", ...), only samples stacks.classify_stack puts
    there when any are; with `calling` (a method's name: "cpu"), only lines whose source calls
    it when any do (the profiler names the copy's method, py-spy the lines: the function's
    busiest line is often another one, an optimizer step waiting on the GPU). None without
    such samples."""
    recording = run.pyspy.get((rank, "all"))
    if not recording or not function:
        return None
    main = ev.main_thread_id(recording, run.pyspy.get((rank, "gil")))
    threads = ev.merge_threads(recording)
    if main not in threads:
        return None
    samples = threads[main][1]
    window = stacks.loop_window(samples.stacks)
    lo, hi = window if window else (0, len(samples.stacks) - 1)
    base = os.path.basename(str(file or ""))
    counts: dict[Any, float] = {}
    of_kind: dict[Any, float] = {}
    of_call: dict[Any, float] = {}
    for stack, w in zip(samples.stacks[lo : hi + 1], samples.weights[lo : hi + 1]):
        frame = next(
            (
                f
                for f in reversed(stack)
                if f.name.split(".")[-1] == function.split(".")[-1]
                and (not base or os.path.basename(f.file) == base)
            ),
            None,
        )
        if frame is None:
            continue
        key = (frame.file, frame.line)
        counts[key] = counts.get(key, 0.0) + w
        if kind and stacks.classify_stack(stack)[0] == kind:
            of_kind[key] = of_kind.get(key, 0.0) + w
        if calling and f".{calling}(" in (source_line(frame.file, frame.line) or ""):
            of_call[key] = of_call.get(key, 0.0) + w
    pick = of_call or of_kind or counts
    return max(pick, key=pick.__getitem__) if pick else None
