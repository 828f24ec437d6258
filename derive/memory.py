"""Memory over time: per rank and step, the process's resident memory and the device's allocated
and reserved memory, what was left (MemAvailable, the cgroup's limit, the device's total), and
the shim's hunt for where growing memory is held (`mem_held`). Statistics of a series' growth
(its rate, and whether it levels off); no judgement (traindx.analyzers.memory.memory judges).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from traindx.derive.runview import RunView
from traindx.derive.steady import events_of_type
from traindx.profiler.shim._traindx_shim import schema

SERIES = ("rss_bytes", "heap_bytes", "dev_alloc_bytes", "dev_reserved_bytes")
LIMITS = (
    "host_available_bytes",
    "cgroup_limit_bytes",
    "cgroup_usage_bytes",
    "dev_total_bytes",
)
COLUMNS = ["rank", "step", *SERIES, *LIMITS]


def memory_table(run: RunView) -> pd.DataFrame:
    """One row per rank and step (the last `mem` event of a step), its limits carried forward
    from the last step that read them."""
    events = events_of_type(run, schema.MEM)
    if not len(events) or "step" not in events:
        return pd.DataFrame(columns=COLUMNS)
    table = events.reindex(columns=COLUMNS).copy()
    table["rank"] = table["rank"].astype(str)
    table = table.dropna(subset=["step"]).astype({"step": np.int64})
    table = table.sort_values(["rank", "step"], kind="stable").drop_duplicates(["rank", "step"], keep="last")
    for column in (*SERIES, *LIMITS):
        table[column] = pd.to_numeric(table[column], errors="coerce")
    table[list(LIMITS)] = table.groupby("rank", sort=False)[list(LIMITS)].ffill()
    return table.reset_index(drop=True)


def held_table(run: RunView) -> pd.DataFrame:
    """The shim's hunts (`mem_held`): rank, step, since_step, grew, holders, sites, device_sites,
    graph_tensors (alive at its end) and graph_tensors_before (at its start; absent in older
    records)."""
    events = events_of_type(run, schema.MEM_HELD)
    cols = [
        "rank",
        "step",
        "since_step",
        "grew",
        "holders",
        "sites",
        "device_sites",
        "graph_tensors",
        "graph_tensors_before",
        "cost_s",
    ]
    if not len(events):
        return pd.DataFrame(columns=cols)
    out = events.reindex(columns=cols).copy()
    out["rank"] = out["rank"].astype(str)
    return out.reset_index(drop=True)


def _slope(x: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> float:
    if len(x) < 2 or float(np.ptp(x)) == 0:
        return 0.0
    return float(np.polyfit(x, y, 1)[0])


def growth(steps: Sequence[int], values: Sequence[float]) -> dict[str, Any] | None:
    """How a series grows over steps: {rate (per step, least squares over all points),
    first_rate / last_rate (each half's own), grew (last - first), rises / last_rises (share of
    step-to-step increases, over all points and over the second half), median_step (the median
    change per step between points: one freed transient does not move it), falls (step-to-step decreases), rank_corr (Spearman's between
    step and value), first_step, last_step, last}; None with fewer than 6 finite points."""
    s = np.asarray(steps, dtype=float)
    v = np.asarray(values, dtype=float)
    keep = np.isfinite(s) & np.isfinite(v)
    s, v = s[keep], v[keep]
    if len(s) < 6:
        return None
    order = np.argsort(s, kind="stable")
    s, v = s[order], v[order]
    half = len(s) // 2
    diffs = np.diff(v)
    rank_s = pd.Series(s).rank().to_numpy()
    rank_v = pd.Series(v).rank().to_numpy()
    corr = float(np.corrcoef(rank_s, rank_v)[0, 1]) if np.ptp(rank_v) > 0 else 0.0
    return {
        "rate": _slope(s, v),
        "first_rate": _slope(s[:half], v[:half]),
        "last_rate": _slope(s[half:], v[half:]),
        "grew": float(v[-1] - v[0]),
        "rises": float((diffs > 0).mean()),
        "last_rises": float((diffs[half:] > 0).mean()),
        # a change per step: a series read on a clock (the device's) has gaps between its points
        "median_step": float(np.median(diffs / np.diff(s))),
        "falls": int((diffs < 0).sum()),
        "rank_corr": corr,
        "first_step": int(s[0]),
        "last_step": int(s[-1]),
        "last": float(v[-1]),
        "points": len(s),
    }


def host_headroom(row: pd.Series) -> tuple[float | None, str | None]:
    """(bytes the process may still grow by, what bounds it) at one row of memory_table: the
    machine's MemAvailable, or the cgroup's limit less its usage when that is less."""
    options = []
    avail = row.get("host_available_bytes")
    if avail is not None and np.isfinite(avail):
        options.append((float(avail), "MemAvailable"))
    limit, usage = row.get("cgroup_limit_bytes"), row.get("cgroup_usage_bytes")
    if limit is not None and usage is not None and np.isfinite(limit) and np.isfinite(usage):
        options.append((max(0.0, float(limit - usage)), "the cgroup's memory limit"))
    if not options:
        return None, None
    return min(options)


def device_headroom(row: pd.Series) -> float | None:
    """Bytes of device memory the caching allocator has not reserved yet at one row."""
    total, reserved = row.get("dev_total_bytes"), row.get("dev_reserved_bytes")
    if total is None or reserved is None or not np.isfinite(total) or not np.isfinite(reserved) or total <= 0:
        return None
    return max(0.0, float(total - reserved))
