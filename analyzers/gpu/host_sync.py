"""Host-device syncs inside the step, from the torch.profiler window.

A sync makes Python wait until the GPU has run every kernel queued before it, so the GPU idles
until the CPU has queued the next kernel. Each sync call costs what a step saves without it: the
GPU's idle after it (bounded by how long the call held the CPU back) and the GPU's idle while the
host runs the statement that ends in it (in a host-bound loop those ops, not the wait, are the
cost). On a CPU-only run there is no queue: the syncs are counted, the cost cannot be measured."""

from __future__ import annotations

import os
import re
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers import codefix
from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core import gpu_window
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding, Prescription
from traindx.derive import ledger
from traindx.derive.gpu_efficiency import sync_waits

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="host_sync",
    order=50,
    ids=("sync.host_device",),
    live_categories=("sync",),
    explains=("gpu.launch_bound", "gpu_idle.host_starved", "host_work.code"),
    # no ledger line removed: the time the host blocks in a sync is mostly the GPU finishing
    # queued work, which stays after the fix; its cost is the GPU idle after it
    call_site_lines={"sync": ("sync.host_device",)},
)

SCALAR_READ = "aten::_local_scalar_dense"  # every .item()/float()/int()/bool() of a tensor
CUDA_SYNC = re.compile(
    r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|"
    r"cudaMemcpy|cudaMemcpy2D|cuStreamSynchronize|cuCtxSynchronize)$"
)
MODULE_CALL = re.compile(r"torch/nn/modules/module\.py\(\d+\): _(wrapped_)?call_impl$")
MIN_SYNCS_PER_STEP_CPU = 3  # one scalar read per step (the loss for the log) is the norm
MIN_SHARE_GPU = 0.03


def _sites(run: RunRecord, rank: str, rows: pd.DataFrame, all_rows: pd.DataFrame, syncs: pd.DataFrame) -> Any:
    """{(file, line, function) or None: [count, seconds]} for the sync events."""
    py = all_rows[all_rows["cat"] == "python_function"]
    sites = defaultdict(lambda: [0, 0.0])
    for row in syncs.itertuples():
        if "site" in syncs:
            site = row.site
        else:
            site = ev.enclosing_user_function(py, row.tid, row.start_ns) if len(py) else None
        sites[site][0] += 1
        sites[site][1] += row.dur_s
    return sites


# frames of a measured call (a module's forward, backward, the optimizer step, the DataLoader):
# a sync's statement never reaches back past one (core/stacks.OWNING names the same calls)
MEASURED_FRAME = re.compile(
    r"torch/nn/modules/module\.py\(\d+\): _(wrapped_)?call_impl$|"
    r"run_backward|^torch/autograd/|torch/_tensor\.py\(\d+\): backward$|"
    r"^torch/optim/|^torch/utils/data/"
)


# torch.profiler's own syncs (the window closing) and the shim's: not the job's
OWN_SYNC_FRAME = re.compile(r"^torch/profiler/|^torch/autograd/profiler|^_traindx_shim/(?!spans)")


class _Frames:
    """One thread's python_function events as arrays, with each call's children."""

    def __init__(self, py: pd.DataFrame) -> None:
        order = np.argsort(py["start_ns"].to_numpy(np.int64), kind="stable")
        py = py.iloc[order]
        self.start = py["start_ns"].to_numpy(np.int64)
        self.end = py["end_ns"].to_numpy(np.int64)
        self.id = py["py_id"].to_numpy(float)
        self.parent = py["py_parent"].to_numpy(float)
        self.name = py["name"].to_numpy(object)
        parsed = {n: ev.parse_trace_frame(n) for n in set(self.name)}
        self.own = np.array(
            [(p := parsed[n]) is not None and not ev.is_library_trace_file(p[0]) for n in self.name],
            dtype=np.bool_,
        )
        self.children = {}
        for i, parent in enumerate(self.parent):
            if np.isfinite(parent):
                self.children.setdefault(parent, []).append(i)


def _statement_ops(frames: Any, op_start: Any, op_end: Any, t_ns: Any, previous_sync_ns: Any) -> Any:
    """([(start, end)] of the tensor ops of the statement that ends in the sync at t_ns, the
    job's function it is in as (file, def line, function), whether a module's forward holds
    it); (None, None, False) for a sync of
    torch.profiler's or traindx's own: the calls of the job's innermost own
    function from the one holding the sync back to (not into) the previous measured call, own
    function or sync; the ops are the aten calls (cpu_op) inside them. torch.profiler does not
    record a call's line, so a statement is that run of calls: in `x = gelu(layer(x))` then
    `if not isfinite(x).all().item()`, the gelu counts with the check (one op of several)."""
    if frames is None:
        return [], None, False
    around = np.flatnonzero((frames.start <= t_ns) & (frames.end >= t_ns))
    around = around[np.argsort(-frames.start[around], kind="stable")]  # innermost first
    in_model = any(MODULE_CALL.search(frames.name[i]) for i in around)
    user, child = None, None
    for i in around:
        if frames.own[i]:
            user = i
            break
        if OWN_SYNC_FRAME.search(frames.name[i]):
            return None, None, False
        child = i
    site = ev.parse_trace_frame(frames.name[user]) if user is not None else None
    if user is None or child is None or not np.isfinite(frames.id[user]):
        return [], site, in_model
    siblings = [i for i in frames.children.get(frames.id[user], ()) if frames.start[i] < frames.start[child]]
    first = int(frames.start[child])
    for i in reversed(siblings):
        if frames.own[i] or MEASURED_FRAME.search(frames.name[i]) or frames.start[i] <= previous_sync_ns:
            break
        first = int(frames.start[i])
    keep = (op_start >= first) & (op_end <= frames.end[child])
    return list(zip(op_start[keep], op_end[keep])), site, in_model


def _sync_costs(
    run: RunRecord, rank: str, syncs: pd.DataFrame, all_rows: pd.DataFrame, steps: pd.DataFrame
) -> Any:
    """Per sync event, (the seconds a step would save without it, the job's function it is
    in or None, whether it is inside a model's forward): the GPU's idle while the host
    runs the statement that ends in it (its tensor ops, the read, the wait; a host-bound loop
    pays all of it), and the GPU's idle after it until the host has queued the next GPU work,
    bounded by how long the sync held the host back (without it the host would have queued
    that work earlier by at most that). Idle inside allocator calls and synchronous copies is
    their own findings' (allocator, gpu_idle.pageable_copy); idle while torch.profiler or
    traindx runs their own code in the window is nobody's."""
    gw = gpu_window

    py = all_rows[(all_rows["cat"] == "python_function").to_numpy()]
    has_tree = "py_id" in py and "py_parent" in py
    cpu_ops = all_rows[(all_rows["cat"] == "cpu_op").to_numpy()]
    frames, ops_of = {}, {}
    runtime = all_rows[all_rows["cat"].isin(("cuda_runtime", "cuda_driver")).to_numpy()]
    owned = runtime[
        runtime["name"].str.match(gw.ALLOCATOR_CALLS).to_numpy()
        | runtime["name"].str.startswith("cudaMemcpy").to_numpy()
    ]
    # and the tool's own work in its window (torch.profiler's, traindx's) is not the job's
    tool = _tool_frames(py)
    owned = gw.merged(
        np.concatenate([owned["start_ns"].to_numpy(np.int64), tool["start_ns"].to_numpy(np.int64)]),
        np.concatenate([owned["end_ns"].to_numpy(np.int64), tool["end_ns"].to_numpy(np.int64)]),
    )
    pieces = [i for _, _, _, i in gw.window_steps(run, rank, all_rows)]
    idle = np.concatenate(pieces) if pieces else np.empty((0, 2), np.int64)
    gpu = all_rows[all_rows["cat"].isin(gw.GPU_WORK).to_numpy()]
    starts = np.sort(gpu["start_ns"].to_numpy(np.int64))
    window_end = int(steps["end_ns"].max())
    costs: list[tuple[float | None, Any, bool]] = []
    previous: dict[Any, int] = {}
    for row in syncs.itertuples():
        start, end = int(row.start_ns), int(row.end_ns)
        if row.tid not in frames:
            mine = py[(py["tid"] == row.tid).to_numpy()] if has_tree else py.iloc[0:0]
            frames[row.tid] = _Frames(mine) if len(mine) else None
            ops = cpu_ops[(cpu_ops["tid"] == row.tid).to_numpy()]
            ops_of[row.tid] = (ops["start_ns"].to_numpy(np.int64), ops["end_ns"].to_numpy(np.int64))
        ops, site, in_model = _statement_ops(
            frames[row.tid], *ops_of[row.tid], start, previous.get(row.tid, -1)
        )
        previous[row.tid] = end
        if ops is None:
            costs.append((None, None, False))  # torch.profiler's or traindx's own
            continue
        i = np.searchsorted(starts, end, "left")
        nxt = min(int(starts[i]) if i < len(starts) else window_end, window_end)
        after = (end, max(end, min(nxt, end + (end - start))))
        # the statement's ops hold the read and its wait (aten::item): the GPU's idle in them,
        # then after the sync
        spans = gw.merged([a for a, _ in ops] + [after[0]], [b for _, b in ops] + [after[1]])
        free = gw.overlap_s(idle, spans) - gw.overlap_s(idle, _intersect(spans, owned))
        costs.append((max(0.0, free), site, in_model))
    return costs


def _tool_frames(py: pd.DataFrame) -> Any:
    """torch.profiler's and traindx's own calls that hold none of the job's code (not the
    wrappers that run the job)."""
    if not len(py):
        return py
    tool = py[py["name"].str.contains(OWN_SYNC_FRAME).to_numpy()]
    names = py["name"].to_numpy(object)
    parsed = {n: ev.parse_trace_frame(n) for n in set(names)}
    own = py[
        np.array(
            [(p := parsed[n]) is not None and not ev.is_library_trace_file(p[0]) for n in names],
            dtype=np.bool_,
        )
    ].sort_values("start_ns")
    starts, ends = own["start_ns"].to_numpy(np.int64), own["end_ns"].to_numpy(np.int64)
    i = np.searchsorted(starts, tool["start_ns"].to_numpy(np.int64), "left")
    inside = i < len(starts)
    holds = np.zeros(len(tool), dtype=bool)
    holds[inside] = ends[i[inside]] <= tool["end_ns"].to_numpy(np.int64)[inside]
    return tool[~holds]


def _intersect(a: Any, b: Any) -> Any:
    """The intersection of two merged interval arrays, merged."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i, 0], b[j, 0]), min(a[i, 1], b[j, 1])
        if hi > lo:
            out.append((lo, hi))
        if a[i, 1] < b[j, 1]:
            i += 1
        else:
            j += 1
    return np.asarray(out, np.int64).reshape(-1, 2)


def _scalar_reads_by_the_job(rows: pd.DataFrame, all_rows: pd.DataFrame) -> Any:
    """Scalar reads the job's own code asks for inside a model's forward (an nn.Module call).
    On a CPU-only run this is the honest proxy for a sync: model activations live on the GPU,
    while reads in batch preparation, in DataLoader.__next__, in logging, or inside libraries
    (AdamW reading its CPU `step` counters) touch CPU tensors."""
    py = all_rows[all_rows["cat"] == "python_function"]
    loading = rows[rows["name"].str.startswith("enumerate(DataLoader)#")]
    keep = []
    for row in rows[rows["name"] == SCALAR_READ].itertuples():
        if (
            (loading["tid"] == row.tid)
            & (loading["start_ns"] <= row.start_ns)
            & (loading["end_ns"] >= row.end_ns)
        ).any():
            continue
        frames = ev.enclosing_frames(py, row.tid, row.start_ns)
        if not any(MODULE_CALL.search(n) for n in frames):
            continue  # outside a model's forward: batch preparation, logging, on CPU tensors
        caller = next((ev.parse_trace_frame(n) for n in frames if ev.parse_trace_frame(n)), None)
        if caller is not None and not ev.is_library_trace_file(caller[0]):
            keep.append(row.Index)
    return rows.loc[keep]


def _analyze_rank(run: RunRecord, rank: str, trace: pd.DataFrame) -> list[Finding]:
    all_rows = trace[trace["rank"] == rank]
    steps = ev.trace_steps(run, rank)
    if not len(steps) or not len(all_rows):
        return []
    start, end = steps["start_ns"].min(), steps["end_ns"].max()
    rows = all_rows[(all_rows["start_ns"] >= start) & (all_rows["end_ns"] <= end)]
    n_steps = len(steps)
    has_cuda = bool((rows["cat"] == "cuda_runtime").any() or (rows["cat"] == "kernel").any())
    if has_cuda:
        found = _costed_syncs(run, rank, rows, all_rows, steps)
        if found is None:
            return []
        syncs, severity, lost, share = found
    else:
        syncs = _scalar_reads_by_the_job(rows, all_rows)
        per_step = len(syncs) / n_steps
        if per_step < MIN_SYNCS_PER_STEP_CPU:
            return []
        severity, lost, share = "low", None, None
    site_list, top = _site_list(run, rank, rows, all_rows, syncs, n_steps, has_cuda)
    where = f"{top[2]} ({top[0]}:{top[1]})" if top else "an unknown function"
    count = len(syncs) / n_steps
    evidence: dict[str, Any] = {
        "rank": rank,
        "profiled_steps": [int(s) for s in steps["step"]],
        "syncs_per_step": round(count, 2),
        "call_sites": site_list,
        "syncs_in_model_per_step": round(float(syncs["in_model"].sum()) / n_steps, 2)
        if "in_model" in syncs
        else None,
        "device_in_trace": has_cuda,
        "line_note": "torch.profiler names a function by its first line (or, for one "
        "already running when the window opened, the line it stood on); "
        "torch.cuda.set_sync_debug_mode('warn') prints the exact line on a GPU",
    }
    blocked = _ledger_sync(run, rank)
    if blocked is not None:
        # the host's side, every step of the run (the shim times syncs on CUDA tensors): how long
        # the training thread waited in them; mostly the GPU finishing queued work, so not the cost
        evidence["host_blocked_in_syncs_s_per_step"] = round(blocked, 6)
    waits = sync_waits(rows, int(start), int(end), n_steps) if has_cuda else None
    if waits is not None:
        # what the host waited for in them: a copy (its own cost, gpu.dtoh_copy) or queued kernels
        evidence["host_waited_for"] = {k: round(v, 6) for k, v in waits.items()}
    if has_cuda:
        summary = (
            f"{count:.0f} syncs per step leave the GPU idle {(lost or 0.0) * 1000:.1f} ms per step "
            f"({share:.0%}) until the CPU queues the next kernel; the most costly in {where}."
        )
        if waits and waits["blocked_s"]:
            summary += (
                f" The host blocks {waits['blocked_s'] * 1000:.1f} ms per step in them, waiting for "
                f"copies {waits['copy_s'] * 1000:.1f} ms and queued kernels {waits['kernels_s'] * 1000:.1f} ms."
            )
    else:
        summary = (
            f"{count:.0f} host reads of tensor values per step ({SCALAR_READ}, i.e. "
            f".item()/float()/bool()), the most in {where}. On a GPU each one waits for "
            "every queued kernel; this run has no GPU, so the cost is not measured."
        )
    return [
        Finding(
            id="sync.host_device",
            title=f"{count:.0f} host-device syncs per step on rank {rank}, most in {top[2] if top else '?'}",
            severity=severity,
            analyzer="host_sync",
            summary=summary,
            steps_affected=tuple(int(s) for s in steps["step"]),
            seconds_lost_per_step=lost,
            share_of_step=share,
            evidence=evidence,
            prescriptions=_sync_prescriptions(run, site_list, where, lost),
            ranks=(rank,),
        )
    ]


def _costed_syncs(
    run: RunRecord, rank: str, rows: pd.DataFrame, all_rows: pd.DataFrame, steps: pd.DataFrame
) -> tuple[pd.DataFrame, str, float, float] | None:
    """(the sync calls with their cost, severity, seconds lost per step, share of the step) of
    a CUDA run's window, or None where they are too few and cheap to name."""
    n_steps = len(steps)
    step_s = float(steps["duration_s"].mean())
    syncs = rows[(rows["cat"] == "cuda_runtime") & rows["name"].str.match(CUDA_SYNC)]
    if not len(syncs):
        return None
    # a sync costs the GPU's idle in its statement and after it (_sync_costs); the time the
    # CPU blocks in it while the GPU finishes queued work is not lost by itself
    syncs = syncs.sort_values("start_ns")
    costed = _sync_costs(run, rank, syncs, all_rows, steps)
    # the sites below rank by the idle they cause
    syncs = syncs.assign(
        dur_s=[c for c, _, _ in costed],
        site=[s for _, s, _ in costed],
        in_model=[m for _, _, m in costed],
    )
    syncs = syncs[[c is not None for c, _, _ in costed]]  # torch.profiler's own (window closing)
    if not len(syncs):
        return None
    blocked = float(syncs["dur_s"].sum()) / n_steps
    # the profiler slows the host in its window: the share is of the run's steady step
    step_s = min(step_s, ev.median_step_s(run, rank) or step_s)
    share = blocked / step_s if step_s else 0.0
    if share < MIN_SHARE_GPU and len(syncs) / n_steps < MIN_SYNCS_PER_STEP_CPU:
        return None
    return syncs, ev.severity_for_share(share), blocked, share  # many cheap syncs: "info", with numbers


def _site_list(
    run: RunRecord,
    rank: str,
    rows: pd.DataFrame,
    all_rows: pd.DataFrame,
    syncs: pd.DataFrame,
    n_steps: int,
    has_cuda: bool,
) -> tuple[list[dict[str, Any]], Any]:
    """(the five call sites that cost most, each at the line py-spy sampled most in its
    function, the top one's (file, line, function))."""
    sites = _sites(run, rank, rows, all_rows, syncs)
    ranked = sorted(sites.items(), key=lambda kv: (-kv[1][1], -kv[1][0]) if has_cuda else -kv[1][0])
    site_list = [
        {
            "file": s[0] if s else None,
            "line": s[1] if s else None,
            "function": s[2] if s else None,
            "per_step": round(c / n_steps, 2),
            "gpu_idle_s_per_step": round(t / n_steps, 6) if has_cuda else None,
        }
        for s, (c, t) in ranked[:5]
    ]
    for site in site_list:
        # torch.profiler names the function by its first line: the line in it that py-spy
        # sampled most inside the step loop is the statement's
        at = (
            gpu_window.line_in_function(run, rank, site["file"], site["function"])
            if site["function"]
            else None
        )
        if at is not None and at[1] != site["line"]:
            site.update(def_line=site["line"], line=at[1], path=at[0])
    top = ranked[0][0]
    if top and site_list[0].get("def_line") is not None:
        top = (top[0], site_list[0]["line"], top[2])
    return site_list, top


def _sync_prescriptions(
    run: RunRecord, site_list: list[dict[str, Any]], where: str, lost: float | None
) -> tuple[Prescription, ...]:
    """The device-side forms of the reads at each of the job's call sites (a sum kept, a guard
    checked there), then the host read removed."""
    prescriptions = []
    seen = set()
    for site in site_list:
        if not site["file"] or not site["line"] or ev.is_library_path(str(site["file"])):
            continue
        path = _source_path(run, site)
        # the device-side forms of the reads at this site: a sum kept, a guard checked there
        for edits, what, why in (
            (codefix.device_accumulations, "accumulate", "read the sum once, when it is printed"),
            (
                codefix.device_checks,
                "check",
                "no wait for the queued kernels; a failing check "
                "stops the job with a device-side assert at a later sync instead of raising there",
            ),
        ):
            for change in edits(path, site["line"]):
                if (change["file"], change["line"]) in seen:
                    continue
                seen.add((change["file"], change["line"]))
                prescriptions.append(
                    Prescription(
                        kind="code",
                        summary=f"{what} on the device at {change['file']}:"
                        f"{change['line']}: `{change['after'].splitlines()[-1].strip()}` "
                        f"({why})",
                        change={"code": change},
                        expected_gain_s_per_step=lost,
                        automatic=True,
                    )
                )
    prescriptions.append(
        Prescription(
            kind="code",
            summary=f"remove the host read in {where}: keep the value on the device (torch.where, "
            "masks, torch.nan_to_num) or read it once per step / every N steps",
            expected_gain_s_per_step=lost,
        )
    )
    return tuple(prescriptions)


def _source_path(run: RunRecord, site: Any) -> Any:
    """The file a call site names, as the job's own file on this machine: py-spy's absolute
    path, else the name itself, else under the job's working directory, else the job's script
    of that name (torch.profiler names a file by its base name)."""
    name = str(site["file"])
    for candidate in (site.get("path"), name, os.path.join(run.manifest.get("cwd") or "", name)):
        if candidate and os.path.isfile(candidate):
            return candidate
    same = [p for p in ev.job_scripts(run) if os.path.basename(p) == os.path.basename(name)]
    return same[0] if same else name


def _ledger_sync(run: RunRecord, rank: str) -> Any:
    """Seconds per steady step the training thread spent in syncs (the ledger's sync line), or
    None without the shim's sync spans (CPU runs, older runs)."""
    spans = run.rank_rows("spans", rank)
    if not len(spans) or not (spans["cat"] == "sync").any():
        return None
    led = ledger.steady_rows(run, rank)
    return float(led["sync_s"].mean()) if len(led) else None


def analyze(run: RunRecord) -> list[Finding]:
    trace = run.torch_trace
    if not len(trace):
        return []
    findings = []
    for rank in sorted(set(trace["rank"])):
        findings.extend(_analyze_rank(run, rank, trace))
    return findings
