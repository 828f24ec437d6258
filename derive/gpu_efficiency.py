"""The GPU's busy time against the device: per rank, the profiled window's kernel-class table
(kernel_classes.py), the math it did (the profiler's FLOP counts, written by the shim in the
`torch_profile` event), the device's peak (device_peaks.py), the syncs priced by what the host
waited for, and the run's MFU.

MFU = model FLOP/s over the device's dense BF16 peak (PaLM's convention, as recipe cards). The
model FLOPs per step are, in this order: 6·N·tokens when the trained parameters N (the shim's
`optimizer_created` event) and the tokens per step (step_end `tokens`, or the job's log line) are
known; else the matmul and convolution FLOPs torch.profiler counted in its window (`with_flops`:
aten::mm/addmm/bmm/baddbmm/conv2d, forward and backward GEMMs; a convolution's backward has no
formula and is counted as twice its forward). Derive layer: numbers, no judgement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from traindx.derive import device_peaks, kernel_classes
from traindx.derive.runview import RunView
from traindx.derive.steady import events_of_type, median_step_s, profiled_steps
from traindx.derive.steptables import steady_median, step_table
from traindx.profiler.torchtrace import GPU_CATS, union_ns

MATMUL_FLOP_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")
CONV_FLOP_OPS = ("aten::conv2d", "aten::conv1d", "aten::conv3d", "aten::convolution")


@dataclass
class RankGpu:
    """One rank's profiled window, per step."""

    rank: str
    steps: int
    wall_s: float
    busy_s: float
    rows: pd.DataFrame  # kernel_classes.class_rows
    families: dict[str, float]
    precisions: dict[str, float]  # matmul/conv seconds per precision
    matmul_flops: float | None  # per step, from the profiler's counts
    sync: dict[str, float] = field(default_factory=dict)  # sync_waits()


def _window_bounds(run: RunView, rank: str, mine: pd.DataFrame) -> list[tuple[int, int]] | None:
    """The profiled steps' own intervals that the trace covers (a window may skip a step and
    leaves out the profiler's start and stop between steps: spanning them would count their
    seconds as GPU idle), else the GPU events' extent as one step."""
    steps = run.rank_steps(rank)
    inside = steps[steps["step"].isin(profiled_steps(run).get(rank, set()))] if len(steps) else steps
    if len(inside) and len(mine):
        # a window that stood down for its cost wrote no trace: its steps hold none of these
        # events (counting them would divide one traced step's time by three)
        lo, hi = int(mine["start_ns"].min()), int(mine["end_ns"].max())
        inside = inside[((inside["end_ns"] > lo) & (inside["start_ns"] < hi)).to_numpy()]
    if len(inside):
        return [(int(a), int(b)) for a, b in zip(inside["start_ns"], inside["end_ns"]) if b > a] or None
    gpu = mine[mine["cat"].isin(GPU_CATS).to_numpy()]
    if not len(gpu):
        return None
    return [(int(gpu["start_ns"].min()), int(gpu["end_ns"].max()))]


def _busy_in(gpu: pd.DataFrame, spans: list[tuple[int, int]]) -> int:
    """Nanoseconds the GPU was busy inside the spans (its events' union, clipped to each)."""
    lo, hi = gpu["start_ns"].to_numpy(np.int64), gpu["end_ns"].to_numpy(np.int64)
    total = 0
    for start, end in spans:
        keep = (hi > start) & (lo < end)
        if keep.any():
            total += union_ns(np.clip(lo[keep], start, end), np.clip(hi[keep], start, end))[0]
    return int(total)


def _launched_in(mine: pd.DataFrame, spans: list[tuple[int, int]]) -> pd.DataFrame | None:
    """The GPU events the profiled steps launched (by the launch's correlation id), wherever they
    ran: a step that ends at the optimizer's launch runs its kernels during the next step, so
    a step's own interval does not hold its GPU work. None when the trace has no correlations."""
    if "correlation" not in mine.columns:
        return None
    host = mine[mine["cat"].isin(("cuda_runtime", "cuda_driver")).to_numpy()]
    t = host["start_ns"].to_numpy(np.int64)
    inside = np.zeros(len(host), dtype=bool)
    for start, end in spans:
        inside |= (t >= start) & (t < end)
    ids = set(pd.to_numeric(host["correlation"][inside], errors="coerce").dropna().astype(np.int64))
    if not ids:
        return None
    gpu = mine[mine["cat"].isin(GPU_CATS).to_numpy()]
    mine_ids = pd.to_numeric(gpu["correlation"], errors="coerce")
    launched = gpu[mine_ids.isin(ids).to_numpy()]
    return launched if len(launched) else None


def _compile_spans(run: RunView, rank: str) -> list[tuple[int, int]]:
    comp = run.compiles
    if not len(comp) or "start_ns" not in comp or "end_ns" not in comp:
        return []
    mine = comp[(comp["rank"].astype(str) == str(rank)).to_numpy()] if "rank" in comp else comp
    out = []
    for lo, hi in zip(mine["start_ns"], mine["end_ns"]):
        if pd.notna(lo) and pd.notna(hi):
            out.append((int(lo), int(hi)))
    return out


def profiled_flops(run: RunView, rank: str) -> tuple[float, int] | None:
    """(matmul + conv FLOPs, profiled steps) the shim counted in a rank's window; None when the
    window was recorded without FLOP counts."""
    total, steps = 0.0, 0
    for e in events_of_type(run, "torch_profile").itertuples():
        if str(getattr(e, "rank", "")) != str(rank):
            continue
        flops = getattr(e, "flops", None)
        first, last = getattr(e, "first_step", None), getattr(e, "last_step", None)
        if not isinstance(flops, dict) or first is None or last is None or pd.isna(first) or pd.isna(last):
            continue
        for op, value in flops.items():
            if op in MATMUL_FLOP_OPS:
                total += float(value)
            elif op in CONV_FLOP_OPS:
                total += 3.0 * float(value)  # forward counted; backward (dgrad + wgrad) ~2x it
        steps += int(last) - int(first) + 1
    return (total, steps) if steps else None


def sync_waits(trace: pd.DataFrame, start_ns: int, end_ns: int, n_steps: int) -> dict[str, float]:
    """What the host waited for in its syncs, per step: the host seconds blocked in sync calls
    (cuda*Synchronize, synchronous cudaMemcpy), and the GPU work inside those waits: copies
    (device-to-host by memory kind) and kernels. A wait that covers a copy costs the copy; one
    that covers a queue of kernels costs only the GPU idle it leaves after."""
    rt = trace[(trace["cat"].to_numpy() == "cuda_runtime")]
    names = rt["name"].astype(str)
    # a copy call blocks the host until its copy ends where the copy is synchronous: cudaMemcpy,
    # and cudaMemcpyAsync to or from pageable memory (`.cpu()`); one that returns at once adds µs
    syncs = rt[(names.str.match(kernel_classes.SYNC_CALLS) | names.str.startswith("cudaMemcpy")).to_numpy()]
    syncs = syncs[(syncs["start_ns"] >= start_ns).to_numpy() & (syncs["start_ns"] < end_ns).to_numpy()]
    n = max(int(n_steps), 1)
    out = {"calls": len(syncs) / n, "blocked_s": 0.0, "copy_s": 0.0, "dtoh_pageable_s": 0.0, "kernels_s": 0.0}
    if not len(syncs):
        return out
    s, e = syncs["start_ns"].to_numpy(np.int64), syncs["end_ns"].to_numpy(np.int64)
    blocked, waits = union_ns(s, e)
    out["blocked_s"] = blocked / 1e9 / n
    gpu = trace[trace["cat"].isin(GPU_CATS).to_numpy()]
    gs, ge = gpu["start_ns"].to_numpy(np.int64), gpu["end_ns"].to_numpy(np.int64)
    covered = np.zeros(len(gpu))
    for lo, hi in waits:
        covered += np.clip(np.minimum(ge, hi) - np.maximum(gs, lo), 0, None)
    is_copy = gpu["cat"].to_numpy() == "gpu_memcpy"
    pageable = (
        is_copy & gpu["name"].astype(str).str.contains("DtoH (Device -> Pageable", regex=False).to_numpy()
    )
    out["copy_s"] = float(covered[is_copy].sum()) / 1e9 / n
    out["dtoh_pageable_s"] = float(covered[pageable].sum()) / 1e9 / n
    out["kernels_s"] = float(covered[~is_copy].sum()) / 1e9 / n
    return out


def cached_rank_views(run: RunView) -> dict[str, RankGpu]:
    """rank_views, computed once per loaded run (the GPU analyzers and host_work read it)."""
    return run.cached("gpu_efficiency.rank_views", lambda: rank_views(run))


def rank_views(run: RunView) -> dict[str, RankGpu]:
    """{rank: RankGpu} of every rank with GPU events in its torch.profiler window."""
    trace = getattr(run, "torch_trace", None)
    if trace is None or not len(trace) or not trace["cat"].isin(GPU_CATS).any():
        return {}
    out = {}
    for rank in sorted(set(trace["rank"]), key=lambda r: (len(str(r)), str(r))):
        mine = trace[(trace["rank"] == rank).to_numpy()]
        spans = _window_bounds(run, str(rank), mine)
        if spans is None:
            continue
        n = len(spans)
        gpu = _launched_in(mine, spans)
        if gpu is None:  # no correlations: the GPU events inside the steps' intervals
            start, end = spans[0][0], spans[-1][1]
            busy = _busy_in(mine[mine["cat"].isin(GPU_CATS).to_numpy()], spans)
            classed = mine
        else:
            start = min(spans[0][0], int(gpu["start_ns"].min()))
            end = max(spans[-1][1], int(gpu["end_ns"].max()))
            busy = union_ns(gpu["start_ns"].to_numpy(np.int64), gpu["end_ns"].to_numpy(np.int64))[0]
            classed = pd.concat([mine[~mine["cat"].isin(GPU_CATS).to_numpy()], gpu])
        rows = kernel_classes.class_rows(classed, start, end, n, _compile_spans(run, str(rank)))
        # a step's wall: the rank's steady median (the profiled steps themselves are perturbed:
        # the profiler's start and stop drain the GPU between them), else the window's mean
        window_s = sum(b - a for a, b in spans) / 1e9 / n
        wall = median_step_s(run, str(rank)) or window_s
        counted = profiled_flops(run, str(rank))
        out[str(rank)] = RankGpu(
            rank=str(rank),
            steps=n,
            wall_s=wall,
            busy_s=busy / 1e9 / n,
            rows=rows,
            families=kernel_classes.family_seconds(rows),
            precisions=kernel_classes.matmul_precision_seconds(rows),
            matmul_flops=counted[0] / counted[1] if counted else None,
            sync=sync_waits(mine, start, end, n),
        )
    return out


def _numbers(table: pd.DataFrame, column: str) -> pd.Series | None:
    """A column's numbers (None when it has none)."""
    if not len(table) or column not in table:
        return None
    values = pd.to_numeric(table[column], errors="coerce").dropna()
    return values if len(values) else None


def trained_parameters(run: RunView) -> float | None:
    """Parameters the optimizer trains (the shim's optimizer_created `params`), None if unknown."""
    values = _numbers(events_of_type(run, "optimizer_created"), "params")
    return float(values.max()) if values is not None else None


def tokens_per_step(run: RunView) -> float | None:
    """Tokens of one step: the shim's step_end `tokens`, else the job's 'tokens per step: N'."""
    values = _numbers(events_of_type(run, "step_end"), "tokens")
    values = values if values is not None else _numbers(run.log_steps, "tokens")
    return float(values.median()) if values is not None else None


def model_flops_utilisation(run: RunView, views: dict[str, RankGpu] | None = None) -> dict[str, Any] | None:
    """{mfu, model_flops_per_step, step_s, peak_flops, device, method, note} of a GPU run; None
    for a CPU run or one whose model FLOPs cannot be read (no parameters+tokens, no counts)."""
    device = device_peaks.device_name(run.manifest)
    peak = device_peaks.peak_flops(device, "bf16")
    if device is None:
        return None
    table, _ = step_table(run)
    step_s = steady_median(table) if len(table) else None
    params, tokens = trained_parameters(run), tokens_per_step(run)
    views = cached_rank_views(run) if views is None else views
    counted = [v.matmul_flops for v in views.values() if v.matmul_flops]
    if params and tokens:
        flops, method = (
            6.0 * params * tokens,
            f"6·N·tokens (N={params:.4g} trained parameters, {tokens:.6g} tokens/step)",
        )
    elif counted:
        flops, method = (
            float(np.median(counted)),
            "the matmul/conv FLOPs torch.profiler counted in its window",
        )
    else:
        return {
            "mfu": None,
            "device": device,
            "note": "model FLOPs unknown (no parameter count, no FLOP counts)",
        }
    if peak is None or not step_s:
        return {
            "mfu": None,
            "device": device,
            "note": f"no peak known for {device}" if peak is None else "no steps",
        }
    return {
        "mfu": flops / step_s / peak,
        "model_flops_per_step": flops,
        "step_s": step_s,
        "peak_flops": peak,
        "device": device,
        "method": method,
        "note": f"{method}; peak {peak / 1e12:g} TFLOP/s dense BF16 ({device})",
    }
