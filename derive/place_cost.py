"""The profiler's own cost in a profiled step, per place: torch.profiler records every op, every
runtime call and (with stacks) every Python call, and each record costs the host about the same
time, so a profiled step runs longer than a steady one by a cost per recorded event, not per
second. A place's host time on a steady step is its profiled time less its events' share of the
profiled step's excess over the steady median. Derive layer: arithmetic, no judgement.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver", "python_function", "user_annotation")


def event_counts(
    rows: pd.DataFrame, host: pd.DataFrame, spans: list[tuple[int, int]]
) -> tuple[list[int], float]:
    """(per host op row: the host events recorded from its start to its end on its thread, itself
    included; the host events a profiled step recorded)."""
    cat = rows["cat"].to_numpy()
    starts = rows["start_ns"].to_numpy(np.int64)
    keep = np.isin(cat, HOST_CATS)
    inside = np.zeros(len(rows), dtype=bool)
    for lo, hi in spans:
        inside |= (starts >= lo) & (starts < hi)
    keep &= inside
    tids = rows["tid"].to_numpy(object)
    by_tid: dict[Any, np.ndarray[Any, Any]] = {
        t: np.sort(starts[keep & (tids == t)]) for t in pd.unique(tids[keep])
    }
    counts = []
    for tid, lo, hi in zip(host["tid"], host["start_ns"], host["end_ns"]):
        mine = by_tid.get(tid)
        counts.append(int(np.searchsorted(mine, hi) - np.searchsorted(mine, lo)) if mine is not None else 1)
    return counts, float(keep.sum()) / max(len(spans), 1)


def cost_per_event(window_s: float, wall_s: float, events_per_step: float) -> float:
    """Seconds each recorded event added to a profiled step (0 when it was not longer)."""
    excess = window_s - wall_s
    return excess / events_per_step if window_s and events_per_step > 0 and excess > 0 else 0.0


__all__ = ["HOST_CATS", "cost_per_event", "event_counts"]
