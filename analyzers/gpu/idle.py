"""The GPU idles while the host works: from the GPU's own clock on every step (CUDA events at the
measured boundaries) and, in the torch.profiler window, from the exact kernel timeline.

Findings: `gpu_idle.host_starved` (host work between the measured calls, tied to the code the
training thread ran in the idle gaps), `gpu_idle.pageable_copy` (host-to-device copies from
pageable memory, priced never below the GPU work that stays), `gpu_idle.exposed_communication`
and `gpu_idle.between_steps`. Idle ending in a sync or empty_cache() is left to host_sync and
allocator."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers import codefix
from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core import frameworks
from traindx.analyzers.core import gpu_window as window
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding, Prescription
from traindx.analyzers.data import dataloader
from traindx.analyzers.gpu.idle_window import (
    call_label,
    frames_at,
    job_line_text,
    line_from_pyspy,
    main_tid,
    window_idle,
)
from traindx.derive.ledger import host_code
from traindx.profiler import gputime
from traindx.profiler.torchtrace import gpu_window

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="gpu_idle",
    order=90,
    ids=(
        "gpu_idle.host_starved",
        "gpu_idle.pageable_copy",
        "gpu_idle.exposed_communication",
        "gpu_idle.between_steps",
    ),
    capture=True,
    explains=(
        "ranks.straggler",
        "gpu_idle.exposed_communication",
        "gpu_idle.host_starved",
        "host_work.code",
        "host_work.periodic_line",
    ),
    generic_at_line=("gpu_idle.host_starved",),
)


MIN_SHARE = 0.03  # a cause worth a finding: >= 3 % of the steady step
# the GPU waiting for the host: >= 5 % and >= 200 µs (a healthy loop's launches after its one
# loss read per step leave the GPU a few hundred µs idle: that is launch latency, not a cause)
MIN_HOST_SHARE, MIN_HOST_S = 0.05, 200e-6
# H2D copy speed from pinned memory when the window has none to measure (PCIe 5 x16: 64 GB/s
# raw; ~50 GB/s is typical of pinned copies on an H100/H200 host; a lead, not measured here)
PINNED_H2D_BPS = 50e9
# calls other analyzers own (host_sync, allocator, launch_bound, ranks) or measured calls seen
# without their span (backward's engine, collectives): their idle time is not host work
CLAIMED_CALL = re.compile(
    r"(?:\bitem|\btolist|\bcpu|synchronize|_local_scalar_dense|empty_cache|"
    r"\bnonzero|run_backward|allreduce|all_reduce|allgather|all_gather|"
    r"reduce_scatter|broadcast|barrier)\b|^cu"
)


# -- per-step idle from the markers --------------------------------------------------------------
def _host_idle_per_step(stretch_rows: pd.DataFrame) -> Any:
    """{step: (host idle ceiling, between-steps idle ceiling)}: the stretches of the ledger's
    `host` line (the training thread's code between its measured calls), and of those the ones
    after the optimizer (the loop's end-of-step code: logging, evaluation, checkpoints)."""
    if not len(stretch_rows):
        return {}
    rows = stretch_rows[(stretch_rows["line"] == "host").to_numpy()]
    host = rows.groupby("step")["idle_max_s"].sum()
    opt_end = stretch_rows[(stretch_rows["from"] == "opt<").to_numpy()].groupby("step")["seq"].max()
    after = rows["seq"].to_numpy() >= rows["step"].map(opt_end).fillna(np.inf).to_numpy()
    between = rows[after].groupby("step")["idle_max_s"].sum()
    steps = stretch_rows["step"].unique()
    return {int(s): (float(host.get(s, 0.0)), float(between.get(s, 0.0))) for s in steps}


def _host_code_top(run: RunRecord, rank: str, steps: set[int]) -> Any:
    """(file, line, function, call, seconds per step) of the code that ran most inside the
    ledger's host intervals (traindx.derive.ledger.host_code, py-spy samples in those intervals), or
    None where the ledger has no such table."""
    try:
        table = host_code(run)
    except Exception:
        return None
    if table is None or not len(table):
        return None
    mine = table[(table["rank"] == rank).to_numpy() & table["step"].isin(steps).to_numpy()]
    if not len(mine):
        return None
    mine = mine[~mine["call"].astype(str).str.contains(CLAIMED_CALL).to_numpy()]
    if not len(mine):
        return None
    # a line that calls no library has no call (NaN): groupby drops NaN keys unless told, and
    # a step of such lines only left an empty table (IndexError on an H200 run)
    g = mine.groupby(["file", "line", "function", "call"], dropna=False)["seconds"].sum().sort_values()
    if not len(g):
        return None
    (file, line, function, call), seconds = g.index[-1], float(g.iloc[-1])
    call = call if isinstance(call, str) else None
    return file, int(line), function, call, seconds / max(1, len(set(steps)))


# -- findings -----------------------------------------------------------------------------------
def _host_starved(
    run: RunRecord,
    rank: str,
    step_s: float | None,
    host_idle: dict[int, tuple[float, float]],
    window_rows: pd.DataFrame,
) -> list[Finding]:
    steady = ev.steady_steps(run, rank)
    ids = {int(s) for s in steady["step"]} if len(steady) else set(host_idle)
    per_step = [host_idle[s][0] for s in ids if s in host_idle]
    marker_s = float(np.median(per_step)) if per_step else None
    found = _starving_code(run, rank, ids, marker_s, window_rows)
    if found is None:
        return []
    file, line, function, where, lost, top_calls, source, window_host_s = found
    lost = min(max(lost, 0.0), step_s or 0.0)
    if not step_s or lost < max(MIN_HOST_SHARE * step_s, MIN_HOST_S):
        return []
    src = job_line_text(file, line) if where else ""
    share = lost / step_s
    evidence = {
        "rank": rank,
        "function": function,
        "file": file,
        "line": line,
        "source": src,
        "calls": top_calls,
        "gpu_idle_s_per_step": round(lost, 6),
        "code_from": source,
        "window_idle_host_s_per_step": window_host_s,
        "marker_host_idle_s_per_step": None if marker_s is None else round(marker_s, 6),
    }
    what = ", ".join(c["call"] for c in top_calls[:2])
    return [
        Finding(
            id="gpu_idle.host_starved",
            title=(
                f"The GPU waits {lost * 1000:.1f} ms a step ({share:.0%}) for host work in "
                f"{function}() at {os.path.basename(file)}:{line}"
            ),
            severity=ev.severity_for_share(share),
            analyzer="gpu_idle",
            summary=(
                f"Between its measured calls the training thread runs {function}() "
                f"({what}) while the GPU has nothing queued: {lost * 1000:.1f} ms of GPU idle "
                f"per step of {step_s * 1000:.1f} ms (GPU clock at every step; the code from "
                f"the {source})."
            ),
            seconds_lost_per_step=lost,
            share_of_step=share,
            evidence=evidence,
            prescriptions=_starved_prescriptions(function, file, line, what, lost),
            ranks=(rank,),
        )
    ]


def _starving_code(
    run: RunRecord, rank: str, ids: set[int], marker_s: float | None, window_rows: pd.DataFrame
) -> tuple[Any, Any, Any, Any, float, list[dict[str, Any]], str, float | None] | None:
    """(file, line, function, where, idle seconds per step, top calls, where the code is from,
    the window's host idle per step) of the host code the GPU waits for: the window's idle
    gaps tied to the user's function that holds the most, else the ledger's host code with the
    markers' idle; None without either."""
    host_rows = pd.DataFrame()
    if len(window_rows):
        host_rows = window_rows[
            (window_rows["category"] == "host").to_numpy() & window_rows["long_gap"].to_numpy(bool)
        ]
        claimed = [bool(CLAIMED_CALL.search(c)) if isinstance(c, str) else False for c in host_rows["call"]]
        host_rows = host_rows[~np.array(claimed, dtype=bool)].dropna(subset=["user"])
    if len(host_rows):
        # the user's function that holds the most idle time, with the library calls inside it
        by_user = host_rows.groupby("user")["seconds"].sum()
        user = by_user.idxmax()
        window_s, window_host = float(by_user.max()), float(host_rows["seconds"].sum())
        # every step's measure: the window's exact idle, capped by the markers' host-stretch
        # idle ceiling (a loose one: the forward, unmarked, lies in the host stretches)
        lost = window_s if marker_s is None else min(window_s, marker_s)
        calls = host_rows[(host_rows["user"] == user).to_numpy()]
        top_calls = [
            {"call": call_label(c), "seconds_per_step": round(float(v), 6)}
            for c, v in calls.groupby("call")["seconds"].sum().sort_values(ascending=False).head(4).items()
        ]
        where = line_from_pyspy(run, rank, user)
        file, line = where if where else (user[0], user[1])
        return file, line, user[2], where, lost, top_calls, "torch.profiler window", round(window_host, 6)
    # no window: the per-step clock says how long, the ledger's host code says where
    top = _host_code_top(run, rank, ids) if marker_s else None
    if top is None or marker_s is None:
        return None
    file, line, function, call, seconds = top
    top_calls = [{"call": call or "its own Python code", "seconds_per_step": round(seconds, 6)}]
    return (
        file,
        line,
        function,
        (file, line),
        min(marker_s, seconds),
        top_calls,
        "py-spy samples in the ledger's host intervals",
        None,
    )


def _starved_prescriptions(
    function: str, file: str, line: int, what: str, lost: float
) -> tuple[Prescription, ...]:
    return (
        Prescription(
            kind="code",
            summary=(
                f"move the work in {function}() ({os.path.basename(file)}:{line}) off the training "
                f"thread: into a DataLoader's workers (a Dataset whose __getitem__ builds the sample, "
                f"num_workers >= 2, pin_memory=True), or onto the GPU (torch ops on the device "
                f"instead of {what or 'host code'})"
            ),
            expected_gain_s_per_step=lost,
        ),
        Prescription(
            kind="code",
            summary=(
                "or do it less often / ahead of time: cache what does not change between steps, "
                "prepare the next batch in a background thread while the GPU runs this one"
            ),
            expected_gain_s_per_step=lost,
        ),
    )


def _pageable(run: RunRecord, rank: str, trace: pd.DataFrame, step_s: float | None) -> list[Finding]:
    steps = ev.trace_steps(run, rank)
    copies = trace[(trace["cat"] == "gpu_memcpy").to_numpy()]
    if not len(copies) or not len(steps) or not step_s:
        return []
    pageable = copies[copies["name"].str.contains("HtoD (Pageable", regex=False).to_numpy()]
    pinned = copies[copies["name"].str.contains("HtoD (Pinned", regex=False).to_numpy()]
    if not len(pageable):
        return []
    n = len(steps)
    seconds = float(pageable["dur_s"].sum()) / n
    nbytes = float(np.nansum(pageable["bytes"].to_numpy(np.float64))) / n
    big = pinned[(pinned["bytes"] >= 1 << 20).to_numpy()]
    bw = float((big["bytes"] / big["dur_s"]).max()) if len(big) else PINNED_H2D_BPS
    saving, floor_s, share_of_window = _pageable_saving(run, rank, trace, step_s, seconds, nbytes, bw)
    if saving < MIN_SHARE * step_s:
        return []
    file, line, src = _copy_line(run, rank, trace, pageable)
    share = saving / step_s
    at = f" at {os.path.basename(file)}:{line}" if file else ""
    return [
        Finding(
            id="gpu_idle.pageable_copy",
            title=(
                f"Host-to-device copies from pageable memory: {seconds * 1000:.1f} ms a step "
                f"({nbytes / 1e6:.0f} MB at {nbytes / seconds / 1e9 if seconds else 0:.1f} GB/s)"
            ),
            severity=ev.severity_for_share(share),
            analyzer="gpu_idle",
            summary=(
                f"Each step copies {nbytes / 1e6:.0f} MB to the GPU from pageable memory"
                f"{at}: the driver stages "
                f"it through a pinned buffer and the host waits; from pinned memory at "
                f"{bw / 1e9:.0f} GB/s it would take {nbytes / bw * 1000:.1f} ms and run "
                f"asynchronously."
            ),
            seconds_lost_per_step=saving,
            share_of_step=share,
            evidence={
                "rank": rank,
                "pageable_h2d_s_per_step": round(seconds, 6),
                "bytes_per_step": int(nbytes),
                "pinned_reference_GBps": round(bw / 1e9, 1),
                "pinned_reference": "measured in this window" if len(big) else "lead",
                "gpu_work_left_s_per_step": None if floor_s is None else round(floor_s, 6),
                "copy_share_of_window_step": None if share_of_window is None else round(share_of_window, 4),
                "steady_step_s": round(step_s, 6),
                "file": file,
                "line": line,
                "source": src,
            },
            prescriptions=_pageable_prescriptions(run, rank, file, line, src, saving),
            ranks=(rank,),
        )
    ]


def _pageable_saving(
    run: RunRecord, rank: str, trace: pd.DataFrame, step_s: float, seconds: float, nbytes: float, bw: float
) -> tuple[float, float | None, float | None]:
    """(seconds a steady step saves with pinned copies, the GPU work left per step, the copies'
    share of the window's step) of `seconds` of pageable copies of `nbytes` a step."""
    saving = max(0.0, seconds - nbytes / bw)
    busy = window.busy_per_step(run, rank, trace)
    floor_s = share_of_window = None
    if busy is not None:
        # a pageable copy's speed follows the host's memory traffic: the window's share of the
        # step it covers, applied to the steady step (H200: 58 ms of a 68 ms window step, steady
        # steps 74-94 ms, the fixed step 23.4 ms)
        if busy[0] > 0:
            share_of_window = min(seconds / busy[0], 1.0)
            saving = max(0.0, share_of_window * step_s - nbytes / bw)
        # the step cannot get shorter than the GPU's own work that stays: what it was busy with
        # less the pageable copies, plus the same bytes from pinned memory (the compute the
        # slow copies hid shows again)
        floor_s = max(0.0, busy[1] - seconds) + nbytes / bw
        saving = max(0.0, min(saving, step_s - floor_s))
    return saving, floor_s, share_of_window


def _copy_line(
    run: RunRecord, rank: str, trace: pd.DataFrame, pageable: pd.DataFrame
) -> tuple[Any, Any, str]:
    """(file, line, source) of the user's frame around the runtime call that issued the largest
    pageable copy."""
    runtime = trace[
        (trace["cat"] == "cuda_runtime").to_numpy() & trace["name"].str.startswith("cudaMemcpy").to_numpy()
    ]
    top = pageable.sort_values("bytes", ascending=False).iloc[0]
    issuing = runtime[
        (runtime["start_ns"] <= top.start_ns).to_numpy() & (runtime["end_ns"] >= top.start_ns).to_numpy()
    ]
    t = int(issuing["start_ns"].iloc[0]) if len(issuing) else int(top.start_ns)
    # the Python frames of the thread that issued the copy (else the training thread's)
    py = trace[(trace["cat"] == "python_function").to_numpy()]
    tid = (
        issuing["tid"].iloc[0]
        if len(issuing) and (py["tid"] == issuing["tid"].iloc[0]).any()
        else main_tid(py)
    )
    py = py[(py["tid"] == tid).to_numpy()] if len(py) else py
    user, _ = frames_at(py, t)
    where = line_from_pyspy(run, rank, user) if user else None
    file, line = where if where else ((user[0], user[1]) if user else (None, None))
    src = job_line_text(file, line) if where else ""
    return file, line, src


def _pageable_prescriptions(
    run: RunRecord, rank: str, file: str, line: int, src: str, saving: float
) -> tuple[Prescription, ...]:
    """Pinned memory and asynchronous copies: through the job's DataLoader (pin_memory=True, the
    copy at the line made non_blocking) where it has one, else pinned host tensors."""
    at = f" at {os.path.basename(file)}:{line}" if file else ""
    loader = len(ev.events_of_type(run, "span")) and (run.spans["cat"] == "data").any()
    if not loader:
        return (
            Prescription(
                kind="code",
                summary=(
                    "keep the host tensors in pinned memory (tensor.pin_memory() once, where they are "
                    f"made) and copy with .to(device, non_blocking=True){at}"
                ),
                expected_gain_s_per_step=saving,
            ),
        )
    change = {}
    m = re.search(r"\.(to|cuda)\(([^()]*)\)", src or "")
    if m and "non_blocking" not in m.group(2):
        # with the loader's pinned batches, the copy at this line becomes asynchronous
        args = m.group(2).strip()
        new = f".{m.group(1)}({args + ', ' if args else ''}non_blocking=True)"
        code = codefix.code_change(file, line, src, src.replace(m.group(0), new, 1))
        if code:
            change = {"code": code}
    site = dataloader.starving_site(frameworks.data_sites(run, rank), "DataLoader")
    pin = dataloader.loader_site_change(site, "DataLoader", {"pin_memory": "True"}) if site else None
    return (
        Prescription(
            kind="code",
            summary=(
                f"DataLoader(..., pin_memory=True){dataloader.site_text(site) if site else ''}: its "
                "pinning thread copies each batch to pinned memory off the training thread"
            ),
            change={"code": pin} if pin else {},
            expected_gain_s_per_step=saving,
        ),
        Prescription(
            kind="code",
            summary=f"with it, copy asynchronously: .to(device, non_blocking=True){at}",
            change=change,
            expected_gain_s_per_step=saving,
        ),
    )


def _exposed_communication(
    run: RunRecord, rank: str, trace: pd.DataFrame, step_s: float | None
) -> list[Finding]:
    steps = ev.trace_steps(run, rank)
    if not len(steps) or not step_s:
        return []
    views = [gpu_window(trace, int(s.start_ns), int(s.end_ns)) for s in steps.itertuples()]
    exposed = float(np.mean([v["exposed_communication_s"] for v in views]))
    comm = float(np.mean([v["communication_s"] for v in views]))
    if exposed < MIN_SHARE * step_s:
        return []
    share = exposed / step_s
    return [
        Finding(
            id="gpu_idle.exposed_communication",
            title=(
                f"Communication not overlapped with compute: {exposed * 1000:.1f} ms a step "
                f"({share:.0%}) on rank {rank}"
            ),
            severity=ev.severity_for_share(share),
            analyzer="gpu_idle",
            summary=(
                f"Collective kernels run {comm * 1000:.1f} ms a step, {exposed * 1000:.1f} ms "
                "of it with no compute kernel beside them: the GPU computes nothing while it "
                "communicates (or waits for a slower rank inside the collective)."
            ),
            seconds_lost_per_step=exposed,
            share_of_step=share,
            evidence={
                "rank": rank,
                "communication_s_per_step": round(comm, 6),
                "exposed_s_per_step": round(exposed, 6),
                "window": views,
            },
            prescriptions=(
                Prescription(
                    kind="code",
                    summary=(
                        "overlap the gradient all-reduce with backward: DDP(model, bucket_cap_mb=25, "
                        "gradient_as_bucket_view=True) with no collective of your own between backward and "
                        "the optimizer; FSDP: forward/backward prefetch; if one rank is slow, fix that "
                        "rank first (the collective waits for it)"
                    ),
                    expected_gain_s_per_step=exposed,
                ),
            ),
            ranks=(rank,),
        )
    ]


def _between_steps(run: RunRecord, rank: str, host_idle: Any, step_s: float | None) -> list[Finding]:
    steady = ev.steady_steps(run, rank)
    ids = [int(s) for s in steady["step"]] if len(steady) else sorted(host_idle)
    between = pd.Series({s: host_idle[s][1] for s in ids if s in host_idle}, dtype=float)
    if len(between) < 4 or not step_s:
        return []
    base = float(between.median())
    extra = (between - base).clip(lower=0.0)
    slow = extra[extra >= max(MIN_SHARE * step_s, 1e-4)]
    lost = float(extra.sum()) / len(between)
    if not len(slow) or lost < MIN_SHARE * step_s:
        return []
    share = lost / step_s
    io = (
        run.spans[(run.spans["rank"] == rank).to_numpy() & (run.spans["cat"] == "io").to_numpy()]
        if len(run.spans)
        else pd.DataFrame()
    )
    callers = sorted({str(c) for c in io.get("caller", pd.Series(dtype=object)).dropna()})[:3]
    steps = [int(s) for s in slow.index]
    gaps = np.diff(steps)
    period = int(np.median(gaps)) if len(gaps) else None
    return [
        Finding(
            id="gpu_idle.between_steps",
            title=(
                f"The GPU idles between steps on {len(steps)} of {len(between)} steps "
                f"({slow.mean() * 1000:.1f} ms each{f', every {period} steps' if period else ''})"
            ),
            severity=ev.severity_for_share(share),
            analyzer="gpu_idle",
            summary=(
                "After the optimizer step and before the next step's work the host runs "
                "something (logging, evaluation, a checkpoint) while the GPU has nothing "
                f"queued: {lost * 1000:.1f} ms a step on average."
            ),
            steps_affected=tuple(steps),
            seconds_lost_per_step=lost,
            share_of_step=share,
            evidence={
                "rank": rank,
                "steps": steps[:50],
                "period": period,
                "idle_s_on_those_steps": round(float(slow.mean()), 6),
                "idle_s_median_step": round(base, 6),
                "checkpoint_callers": callers,
            },
            prescriptions=(
                Prescription(
                    kind="code",
                    summary=(
                        "do it less often, or off the critical path: log device values read once every N "
                        "steps, evaluate every N steps, save checkpoints asynchronously "
                        "(torch.distributed.checkpoint.async_save) or less often"
                    ),
                    expected_gain_s_per_step=lost,
                ),
            ),
            ranks=(rank,),
        )
    ]


def analyze(run: RunRecord) -> list[Finding]:
    stretch_rows, _ = gputime.for_run(run)
    trace = run.torch_trace
    if not len(stretch_rows) and not (len(trace) and (trace["cat"] == "kernel").any()):
        return []
    findings = []
    ranks = sorted(
        set(stretch_rows["rank"]) | (set(trace["rank"]) if len(trace) else set()),
        key=lambda r: (len(str(r)), str(r)),
    )
    for rank in ranks:
        step_s = ev.median_step_s(run, rank)
        rows = stretch_rows[(stretch_rows["rank"] == rank).to_numpy()] if len(stretch_rows) else stretch_rows
        host_idle = _host_idle_per_step(rows)
        rank_trace = trace[(trace["rank"] == rank).to_numpy()] if len(trace) else trace
        window_rows = pd.DataFrame()
        if len(rank_trace):
            _, window_rows = window_idle(run, rank, rank_trace)
            findings += _pageable(run, rank, rank_trace, step_s)
            findings += _exposed_communication(run, rank, rank_trace, step_s)
        findings += _host_starved(run, rank, step_s, host_idle, window_rows)
        findings += _between_steps(run, rank, host_idle, step_s)
    return findings
