"""The GPU's own view for the report: busy and idle per step beside the ledger (from the CUDA
events at the measured boundaries), and in the torch.profiler window the busy time by kind and
the top kernels. Present layer: it shows derived tables, it decides nothing."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from traindx.derive import gpu_efficiency
from traindx.derive import ledger as L
from traindx.derive.steady import profiled_steps
from traindx.profiler import gputime
from traindx.profiler.torchtrace import gpu_window, top_kernels

if TYPE_CHECKING:
    from traindx.derive.run import RunRecord

MAX_ROWS = 60  # steps listed; a longer run is binned to this many rows
TOP_KERNELS = 10
MAX_NAME = 160


def _f(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def _short(name: object) -> str:
    name = str(name or "")
    return name if len(name) <= MAX_NAME else name[: MAX_NAME - 1] + "…"


def _ledger_parts(run: RunRecord, rank: str) -> dict[int, list[tuple[str, float]]]:
    """{step: [(label, seconds), ...]} of one rank's ledger (largest first, top 3)."""
    try:
        led = run.rank_rows("ledger", rank)
    except Exception:
        return {}
    out = {}
    cats = [c for c in L.CATEGORIES + ("unexplained",) if f"{c}_s" in led]
    for row in led.itertuples():
        parts = sorted(
            ((L.LABELS.get(c, c), float(getattr(row, f"{c}_s"))) for c in cats), key=lambda p: -p[1]
        )
        out[int(row.step)] = [p for p in parts if p[1] > 0][:3]
    return out


def _per_step(run: RunRecord, steps: Any, rank: str) -> tuple[list[dict[str, Any]], int]:
    mine = steps[(steps["rank"] == rank).to_numpy()].sort_values("step")
    parts = _ledger_parts(run, rank)
    size = max(1, math.ceil(len(mine) / MAX_ROWS))
    rows = []
    for i in range(0, len(mine), size):
        chunk = mine.iloc[i : i + size]
        first, last = int(chunk["step"].iloc[0]), int(chunk["step"].iloc[-1])
        rows.append(
            {
                "step": first,
                "last_step": last,
                "wall_s": _f(chunk["wall_s"].mean()),
                "busy_min": _f(chunk["busy_min_share"].mean()),
                "busy_max": _f(chunk["busy_max_share"].mean()),
                "idle_min_s": _f(chunk["idle_min_s"].mean()),
                "idle_max_s": _f(chunk["idle_max_s"].mean()),
                "ledger": parts.get(first, []) if size == 1 else [],
                "idle_line": (
                    str(chunk["top_idle_line"].iloc[0])
                    if size == 1 and _f(chunk["top_idle_s"].iloc[0])
                    else None
                ),
                "idle_line_s": _f(chunk["top_idle_s"].iloc[0]) if size == 1 else None,
            }
        )
    return rows, size


def _window(run: RunRecord) -> dict[str, Any] | None:
    """Busy time by kind and top kernels of the torch.profiler window (first rank with one)."""
    trace = run.torch_trace
    if not len(trace) or not trace["cat"].isin(("kernel", "gpu_memcpy", "gpu_memset")).any():
        return None
    rank = sorted(set(trace["rank"]), key=lambda r: (len(str(r)), str(r)))[0]
    mine = trace[(trace["rank"] == rank).to_numpy()]
    steps = run.rank_steps(rank)
    # the window's steps, as recorded
    inside = steps[steps["step"].isin(profiled_steps(run).get(rank, set()))]
    if len(inside):
        start, end = int(inside["start_ns"].min()), int(inside["end_ns"].max())
        n = len(inside)
    else:
        gpu = mine[mine["cat"].isin(("kernel", "gpu_memcpy", "gpu_memset")).to_numpy()]
        start, end, n = int(gpu["start_ns"].min()), int(gpu["end_ns"].max()), 1
    view = gpu_window(mine, start, end)
    per_step = {k: v / n for k, v in view.items()}
    wall = per_step["wall_s"] or None
    kernels = [
        {
            "name": _short(k["name"]),
            "kind": k["kind"],
            "calls": int(k["calls"]),
            "seconds": float(k["seconds"]),
            "share": float(k["share"]),
        }
        for k in top_kernels(mine, TOP_KERNELS).to_dict("records")
    ]
    return {
        "rank": str(rank),
        "steps": n,
        "per_step": per_step,
        "shares": {
            k: (per_step[k] / wall if wall else None)
            for k in ("busy_s", "compute_s", "communication_s", "copy_s", "exposed_communication_s", "idle_s")
        },
        "kernels": kernels,
    }


MAX_CLASS_RANKS = 8  # ranks whose kernel-class table is listed (the slowest first)


def kernel_class_view(run: RunRecord) -> list[dict[str, Any]]:
    """Per rank (slowest first), the profiled window's GPU time by kernel class, per step: the
    derived table (derive/kernel_classes.py) and what the host's syncs waited for."""
    try:
        views = gpu_efficiency.cached_rank_views(run)
    except Exception:  # the report renders without this block
        return []
    out = []
    for v in sorted(views.values(), key=lambda v: -v.wall_s)[:MAX_CLASS_RANKS]:
        rows = [
            {
                "family": r["family"],
                "label": r["label"],
                "calls": float(r["calls"]),
                "seconds": float(r["seconds"]),
                "share": float(r["share"]),
                "of_step": float(r["seconds"]) / v.wall_s if v.wall_s else None,
                "bytes": _f(r["bytes"]),
                "gb_per_s": _f(r["gb_per_s"]),
            }
            for r in v.rows.to_dict("records")
        ]
        out.append(
            {
                "rank": v.rank,
                "steps": v.steps,
                "wall_s": v.wall_s,
                "busy_s": v.busy_s,
                "idle_s": max(0.0, v.wall_s - v.busy_s),
                "rows": rows,
                "sync": dict(v.sync),
            }
        )
    return out


def gpu_time_view(run: RunRecord) -> dict[str, Any]:
    """{available, rank, rows (per step: wall, GPU busy floor/ceiling share, idle, ledger's top
    lines), median, window (busy by kind, top kernels)}; available False with a reason."""
    try:
        _, steps = gputime.for_run(run)
    except Exception as exc:  # the report renders without this block
        return {
            "available": False,
            "reason": f"{type(exc).__name__}: {exc}",
            "window": None,
            "classes": kernel_class_view(run),
        }
    try:
        window = _window(run)
    except Exception:
        window = None
    classes = kernel_class_view(run)
    if not len(steps):
        return {
            "available": False,
            "window": window,
            "classes": classes,
            "reason": "no per-step GPU clock (a CPU job, or a run recorded without it)",
        }
    means = steps.groupby("rank")["wall_s"].mean()
    rank = means.idxmax()
    rows, size = _per_step(run, steps, rank)
    mine = steps[(steps["rank"] == rank).to_numpy()]
    median = {
        "busy_min": _f(mine["busy_min_share"].median()),
        "busy_max": _f(mine["busy_max_share"].median()),
        "idle_min_s": _f(mine["idle_min_s"].median()),
        "idle_max_s": _f(mine["idle_max_s"].median()),
        "wall_s": _f(mine["wall_s"].median()),
    }
    return {
        "available": True,
        "rank": str(rank),
        "ranks": int(steps["rank"].nunique()),
        "rows": rows,
        "bin_size": size,
        "median": median,
        "window": window,
        "classes": classes,
    }
