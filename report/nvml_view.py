"""NVML's view: GPU metrics per GPU (downsampled, spikes kept), clock-throttle reasons, and the
mean utilization while steps ran."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.report.text import clip, num, ranges

if TYPE_CHECKING:
    from traindx.derive.run import RunRecord

MAX_GPU_POINTS = 600  # per GPU and metric


def gpu_util_in_windows(run: RunRecord, t0: int, starts: Any, ends: Any) -> float | None:
    """gpu_util_in_steps over step windows given as arrays, vectorised."""
    gpu = run.gpu
    if not len(gpu) or "util" not in gpu or not len(starts):
        return None
    order = np.lexsort((ends, starts))
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)  # the latest end among windows starting at or before
    ts = (pd.to_numeric(gpu["t"], errors="coerce").to_numpy(np.float64) - t0) / 1e9
    util = pd.to_numeric(gpu["util"], errors="coerce").to_numpy(np.float64)
    i = np.searchsorted(starts, ts, side="right") - 1
    ok = ~np.isnan(util) & ~np.isnan(ts) & (i >= 0) & (util != np.inf) & (util != -np.inf)
    ok &= reach[np.maximum(i, 0)] >= ts
    return float(util[ok].mean()) if ok.any() else None


def _downsample(
    xs: Sequence[Any], ys: Sequence[Any], limit: int = MAX_GPU_POINTS
) -> tuple[list[Any], list[Any]]:
    """Min/max per bucket so spikes and dips survive the reduction."""
    if len(xs) <= limit:
        return list(xs), list(ys)
    size = math.ceil(len(xs) / (limit // 2))
    ox: list[Any] = []
    oy: list[Any] = []
    for i in range(0, len(xs), size):
        cx, cy = xs[i : i + size], ys[i : i + size]
        pairs = [(x, y) for x, y in zip(cx, cy) if y is not None]
        if not pairs:
            continue
        lo = min(pairs, key=lambda p: p[1])
        hi = max(pairs, key=lambda p: p[1])
        for p in sorted({lo, hi}):
            ox.append(p[0])
            oy.append(p[1])
    return ox, oy


CLOCK_REASONS = {
    0x1: "GPU idle",
    0x4: "power cap",
    0x8: "HW slowdown",
    0x20: "SW thermal",
    0x40: "HW thermal",
    0x80: "power brake",
}


def gpu_view(run: RunRecord, t0: int) -> dict[str, Any]:
    gpu = run.gpu
    if not len(gpu):
        why = (run.missing or {}).get("nvml") or (run.missing or {}).get("gpus")
        return {
            "available": False,
            "reason": clip(str(why).splitlines()[0], 300) if why else "no GPU samples were recorded",
        }
    series = []
    for index, g in gpu.groupby("gpu") if "gpu" in gpu else [(0, gpu)]:
        g = g.sort_values("t")
        ts = [(int(t) - t0) / 1e9 for t in g["t"]]
        entry: dict[str, Any] = {"gpu": int(index) if num(index) is not None else str(index), "metrics": {}}
        for col, label, unit in (
            ("util", "utilization", "%"),
            ("sm_clock_mhz", "SM clock", "MHz"),
            ("power_w", "power", "W"),
        ):
            if col in g:
                xs, ys = _downsample(ts, [num(v) for v in g[col]])
                if any(y is not None for y in ys):
                    entry["metrics"][col] = {"label": label, "unit": unit, "t_s": xs, "values": ys}
        reasons = {}
        if "clock_event_reasons" in g:
            for v in g["clock_event_reasons"]:
                v = num(v)
                for bit, name in CLOCK_REASONS.items():
                    if v is not None and int(v) & bit:
                        reasons[name] = reasons.get(name, 0) + 1
        entry["throttle"] = {k: v / len(g) for k, v in reasons.items()}
        util = [num(v) for v in g["util"]] if "util" in g else []
        entry["mean_util"] = (
            sum(u for u in util if u is not None) / max(1, sum(u is not None for u in util)) if util else None
        )
        series.append(entry)
    # clock throttling, one line per distinct pattern rather than one per GPU
    throttle = {}
    for e in series:
        for reason, share in e["throttle"].items():
            throttle.setdefault((reason, round(share, 2)), []).append(e["gpu"])
    notes = [
        {
            "reason": reason,
            "share": share,
            "gpus": ranges(g) if all(isinstance(x, int) for x in g) else ", ".join(map(str, g)),
        }
        for (reason, share), g in sorted(throttle.items(), key=lambda kv: -kv[0][1])
    ]
    return {"available": True, "series": series, "throttle": notes}
