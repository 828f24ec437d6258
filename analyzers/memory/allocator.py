"""CUDA caching-allocator retries and fragmentation (GPU only).

A failed cudaMalloc makes the allocator free every cached block (a device-wide sync) and retry;
retries growing in the steady window, and explicit torch.cuda.empty_cache() calls, cost a sync
and a free/malloc storm each. With a GPU trace the cost is the GPU's idle while the host is inside
cudaMalloc/cudaFree (the rest of those calls overlaps kernels queued before them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandas as pd

from traindx.analyzers import codefix
from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding, Prescription
from traindx.analyzers.core.gpu_window import ALLOCATOR_CALLS, idle_in_calls_per_step

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="allocator",
    order=60,
    ids=("alloc.retries", "alloc.empty_cache"),
    explains=("gpu_idle.host_starved", "host_work.code"),
)

EXPANDABLE = "expandable_segments:True"
MALLOC_CALLS = (
    "cudaMalloc",
    "cudaFree",
    "cudaMallocAsync",
    "cudaFreeAsync",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
)


def _alloc_conf(run: RunRecord) -> Any:
    env = run.manifest.get("env") or {}
    return env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF") or ""


def _with_expandable(current: Any) -> Any:
    parts = [p for p in current.split(",") if p and not p.startswith("expandable_segments")]
    return ",".join(parts + [EXPANDABLE])


def _empty_cache_sites(run: RunRecord, rank: str, steady_ids: set[int]) -> Any:
    calls = ev.events_of_type(run, "empty_cache")
    if not len(calls):
        return []
    calls = calls[calls["rank"] == rank]
    sites = {}
    for row in calls.itertuples():
        caller = row.caller if isinstance(row.caller, dict) else {}
        key = (caller.get("file"), caller.get("line"), caller.get("function"))
        entry = sites.setdefault(
            key,
            {
                "file": key[0],
                "line": key[1],
                "function": key[2],
                "source": getattr(row, "source", None),
                "calls": 0,
                "in_steady_steps": 0,
            },
        )
        entry["calls"] += 1
        entry["in_steady_steps"] += int(row.step) in steady_ids
    return sorted(sites.values(), key=lambda e: -e["calls"])


def _malloc_seconds_per_step(run: RunRecord, rank: str) -> Any:
    """Seconds per profiled step the CPU spent in cudaMalloc/cudaFree (a retry frees the whole
    cache and mallocs again; cudaFree synchronizes the device), or None without a GPU trace."""
    trace = run.torch_trace
    if not len(trace):
        return None
    steps = ev.trace_steps(run, rank)
    rows = trace[(trace["rank"] == rank) & (trace["cat"] == "cuda_runtime")]
    if not len(steps) or not len(rows):
        return None
    rows = rows[(rows["start_ns"] >= steps["start_ns"].min()) & (rows["end_ns"] <= steps["end_ns"].max())]
    calls = rows[rows["name"].isin(MALLOC_CALLS)]
    return float(calls["dur_s"].sum()) / len(steps)


def _idle_in_malloc_per_step(run: RunRecord, rank: str) -> Any:
    """Seconds per profiled step the GPU idles while the host is inside an allocator call, or
    None without a GPU trace."""
    trace = run.torch_trace
    if not len(trace):
        return None
    return idle_in_calls_per_step(run, rank, trace[(trace["rank"] == rank).to_numpy()], ALLOCATOR_CALLS)


def _retry_cost(
    run: RunRecord, rank: str, with_retry: pd.Series, without: pd.Series, durations: pd.Series
) -> tuple[float | None, str | None, float | None, float | None]:
    """(seconds lost per step, how it was measured, cudaMalloc/cudaFree seconds per step, the
    GPU's idle in them per step): from the torch.profiler window where it has the calls, else
    the steps with a retry against those without."""
    lost, cost_method = None, None
    malloc = _malloc_seconds_per_step(run, rank)
    idle = _idle_in_malloc_per_step(run, rank)
    if idle is not None and malloc:
        # the host blocked in cudaMalloc/cudaFree costs a step only while the GPU has nothing
        # queued; the rest of those calls overlap kernels queued before them
        lost, cost_method = (
            float(idle),
            (
                "cudaMalloc/cudaFree: the GPU's idle while the host is in "
                "them, per step of the torch.profiler window"
            ),
        )
    elif malloc is not None:
        lost, cost_method = malloc, "cudaMalloc/cudaFree time per step in the torch.profiler window"
    elif len(with_retry) and len(without):
        lost = max(0.0, float(with_retry.median() - without.median())) * len(with_retry) / len(durations)
        cost_method = "median step with a retry minus without, times the share of such steps"
    return lost, cost_method, malloc, idle


def _alloc_prescriptions(
    run: RunRecord,
    empty_cache: list[dict[str, Any]],
    empties_in_steps: int,
    new_retries: int,
    lost: float | None,
) -> list[Prescription]:
    prescriptions = []
    # the empty_cache() line first: it is the cause when it runs inside the steps (the
    # allocator setting only softens what it does); each removal is measured by --fix
    for site in empty_cache[:3]:
        source = (site.get("source") or "").strip()
        change = (
            codefix.code_change(site["file"], site["line"], source, "", op="delete")
            if site.get("file") and not ev.is_library_path(str(site["file"]))
            else None
        )
        prescriptions.append(
            Prescription(
                kind="code",
                summary=f"remove torch.cuda.empty_cache() at {site['file']}:{site['line']} "
                f"({site['calls']} calls): it throws the allocator's cache away and the next "
                "allocations go to cudaMalloc again",
                change={"code": change} if change else {},
                # calls outside the steps cost no step time: prescribed, not measured
                expected_gain_s_per_step=lost,
                automatic=bool(change) and bool(empties_in_steps),
            )
        )
    current = _alloc_conf(run)
    if EXPANDABLE not in current.replace(" ", ""):
        prescriptions.append(
            Prescription(
                kind="env",
                summary=f"PYTORCH_CUDA_ALLOC_CONF={_with_expandable(current)}: segments grow in place "
                "instead of failing and retrying; fragmentation drops",
                change={"env": {"PYTORCH_CUDA_ALLOC_CONF": _with_expandable(current)}},
                # with empty_cache() calls in the steps the setting only softens what they do: half
                # the saving is a guess, which --fix measures after the line's removal
                expected_gain_s_per_step=lost
                if new_retries or not empties_in_steps or lost is None
                else lost * 0.5,
                automatic=True,
            )
        )
    return prescriptions


def _retry_steps(rows: pd.DataFrame, steady_ids: set[int], durations: pd.Series) -> tuple[int, set[int]]:
    """(retries in the steady steps, the steady steps that had one). The counter is cumulative;
    a reading spans the steps since the last one (`span_steps`: the shim reads the allocator on
    a 100 ms clock; 1 in records read every step): its new retries are the steady steps'
    when any of its steps is steady, and fell in its slowest steady steps (a retry frees the
    cache and synchronizes the device: its step is the slow one), one a retry."""
    retries = pd.to_numeric(rows["num_alloc_retries"], errors="coerce").fillna(0)
    new = retries.diff().fillna(retries.iloc[0]).to_numpy()
    spans = (
        pd.to_numeric(rows["span_steps"], errors="coerce").fillna(1).clip(lower=1).astype(int).to_numpy()
        if "span_steps" in rows
        else [1] * len(rows)
    )
    total, hits = 0, set()
    for step, k, n in zip(rows["step"].astype(int), spans, new):
        covered = [s for s in range(step - k + 1, step + 1) if s in steady_ids]
        if not covered:
            continue
        total += int(n)
        if n > 0:
            slowest = sorted(covered, key=lambda s: -float(durations.get(s, 0.0)))
            hits.update(slowest[: int(n)])
    return total, hits


def _analyze_rank(run: RunRecord, rank: str, rows: pd.DataFrame) -> list[Finding]:
    """rows: this rank's alloc events."""
    steady = ev.steady_steps(run, rank)
    steady_ids = {int(s) for s in steady["step"]}
    rows = rows.sort_values("step")
    if not len(rows) or "num_alloc_retries" not in rows:
        return []
    durations = steady.set_index("step")["duration_s"]
    new_retries, hit_ids = _retry_steps(rows, steady_ids, durations)
    empty_cache = _empty_cache_sites(run, rank, steady_ids)
    empties_in_steps = sum(s["in_steady_steps"] for s in empty_cache)
    if new_retries <= 0 and not empties_in_steps:
        return []
    # cost: how much slower the steps with a retry are than the steps without
    with_retry = durations[durations.index.isin(hit_ids)]
    without = durations[~durations.index.isin(hit_ids)]
    lost, cost_method, malloc, idle = _retry_cost(run, rank, with_retry, without, durations)
    mean_step = float(durations.mean()) if len(durations) else None
    share = lost / mean_step if lost is not None and mean_step else None
    last = rows.iloc[-1]
    reserved = float(last.get("reserved_bytes_all_current") or 0)
    allocated = float(last.get("allocated_bytes_all_current") or 0)
    inactive = float(last.get("inactive_split_bytes_all_current") or 0)
    evidence = {
        "rank": rank,
        "alloc_retries_in_steady_steps": new_retries,
        "steps_with_retries": sorted(hit_ids),
        "num_ooms": int(pd.to_numeric(rows["num_ooms"], errors="coerce").fillna(0).max())
        if "num_ooms" in rows
        else None,
        "reserved_gib": round(reserved / 2**30, 2),
        "allocated_gib": round(allocated / 2**30, 2),
        "inactive_split_gib": round(inactive / 2**30, 2),
        "fragmentation": round(1 - allocated / reserved, 3) if reserved else None,
        "median_step_with_retry_s": round(float(with_retry.median()), 4) if len(with_retry) else None,
        "median_step_without_s": round(float(without.median()), 4) if len(without) else None,
        "empty_cache_calls": empty_cache[:5],
        "PYTORCH_CUDA_ALLOC_CONF": _alloc_conf(run) or None,
        "cost_method": cost_method,
        "malloc_free_s_per_step": None if malloc is None else round(malloc, 6),
        "gpu_idle_in_malloc_free_s_per_step": None if idle is None else round(idle, 6),
    }
    severity = ev.severity_for_share(share) if share is not None else "low"
    if new_retries and severity == "info":
        severity = "low"  # every retry is a device-wide sync: worth fixing even when cheap here
    prescriptions = _alloc_prescriptions(run, empty_cache, empties_in_steps, new_retries, lost)
    what = []
    if new_retries:
        what.append(f"{new_retries} allocator retries in {len(hit_ids)} steady steps")
    if empties_in_steps:
        what.append(f"{empties_in_steps} torch.cuda.empty_cache() calls inside steps")
    return [
        Finding(
            id="alloc.retries" if new_retries else "alloc.empty_cache",
            title=f"CUDA allocator: {'; '.join(what)} on rank {rank}",
            severity=severity,
            analyzer="allocator",
            summary=(
                f"{'; '.join(what)}. Reserved {evidence['reserved_gib']} GiB, allocated "
                f"{evidence['allocated_gib']} GiB at the end"
                + (
                    f"; steps with a retry take {evidence['median_step_with_retry_s']} s against "
                    f"{evidence['median_step_without_s']} s."
                    if len(with_retry) and len(without)
                    else "."
                )
            ),
            steps_affected=tuple(sorted(hit_ids)),
            seconds_lost_per_step=lost,
            share_of_step=share,
            evidence=evidence,
            prescriptions=tuple(prescriptions),
            ranks=(rank,),
        )
    ]


def analyze(run: RunRecord) -> list[Finding]:
    alloc = run.alloc
    if not len(alloc) or "num_alloc_retries" not in alloc:
        # empty_cache calls alone still matter on a GPU run; on a CPU run there is no alloc
        return []
    findings = []
    by_rank = dict(tuple(alloc.groupby("rank", sort=False)))  # one pass, not one scan per rank
    for rank in sorted(by_rank):
        findings.extend(_analyze_rank(run, rank, by_rank[rank]))
    return findings
