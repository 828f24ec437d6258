"""Host-device syncs inside the step, from the torch.profiler window.

A sync makes Python wait until the GPU has run every kernel queued before it (`.item()`,
`float(t)`, `if t:`, `.tolist()`, `.cpu()`, `nonzero`, `torch.cuda.synchronize`), so the CPU
cannot run ahead and queue the next kernels: the GPU idles from the sync until the CPU has queued
the next kernel. With CUDA in the trace that idle time is measured after each sync call
(cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, synchronous cudaMemcpy),
bounded by how long the call held the CPU back.
On a CPU-only run there is no queue to wait for: the syncs and their call sites are counted, the
cost cannot be measured.
"""
import bisect
import re
from collections import defaultdict

from traindx.findings import Finding, Prescription

from . import evidence as ev

SCALAR_READ = "aten::_local_scalar_dense"   # every .item()/float()/int()/bool() of a tensor
CUDA_SYNC = re.compile(r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|"
                       r"cudaMemcpy|cudaMemcpy2D|cuStreamSynchronize|cuCtxSynchronize)$")
MODULE_CALL = re.compile(r"torch/nn/modules/module\.py\(\d+\): _(wrapped_)?call_impl$")
MIN_SYNCS_PER_STEP_CPU = 3     # one scalar read per step (the loss for the log) is the norm
MIN_SHARE_GPU = 0.03


def _sites(run, rank, rows, all_rows, syncs):
    """{(file, line, function) or None: [count, seconds]} for the sync events."""
    py = all_rows[all_rows["cat"] == "python_function"]
    sites = defaultdict(lambda: [0, 0.0])
    for row in syncs.itertuples():
        site = ev.enclosing_user_function(py, row.tid, row.start_ns) if len(py) else None
        sites[site][0] += 1
        sites[site][1] += row.dur_s
    return sites


def _gpu_idle_after(syncs, kernels, window_end):
    """Per sync event, the seconds it costs: the GPU idles from the sync's end to the next
    kernel (any stream) while the CPU queues it; without the sync the CPU would have queued it
    earlier by at most the time it blocked. So: min(idle after, time blocked)."""
    starts = sorted(int(t) for t in kernels["start_ns"])
    idle = []
    for start, end in zip(syncs["start_ns"], syncs["end_ns"]):
        i = bisect.bisect_left(starts, int(end))
        nxt = min(starts[i] if i < len(starts) else int(window_end), int(window_end))
        idle.append(max(0, min(nxt - int(end), int(end) - int(start))) / 1e9)
    return idle


def _scalar_reads_by_the_job(rows, all_rows):
    """Scalar reads the job's own code asks for inside a model's forward (an nn.Module call).
    On a CPU-only run this is the honest proxy for a sync: model activations live on the GPU,
    while reads in batch preparation, in DataLoader.__next__, in logging, or inside libraries
    (AdamW reading its CPU `step` counters) touch CPU tensors."""
    py = all_rows[all_rows["cat"] == "python_function"]
    loading = rows[rows["name"].str.startswith("enumerate(DataLoader)#")]
    keep = []
    for row in rows[rows["name"] == SCALAR_READ].itertuples():
        if ((loading["tid"] == row.tid) & (loading["start_ns"] <= row.start_ns)
                & (loading["end_ns"] >= row.end_ns)).any():
            continue
        frames = ev.enclosing_frames(py, row.tid, row.start_ns)
        if not any(MODULE_CALL.search(n) for n in frames):
            continue  # outside a model's forward: batch preparation, logging, on CPU tensors
        caller = next((ev.parse_trace_frame(n) for n in frames if ev.parse_trace_frame(n)), None)
        if caller is not None and not ev.is_library_trace_file(caller[0]):
            keep.append(row.Index)
    return rows.loc[keep]


def _analyze_rank(run, rank, trace):
    all_rows = trace[trace["rank"] == rank]
    steps = ev.trace_steps(run, rank)
    if not len(steps) or not len(all_rows):
        return []
    start, end = steps["start_ns"].min(), steps["end_ns"].max()
    rows = all_rows[(all_rows["start_ns"] >= start) & (all_rows["end_ns"] <= end)]
    n_steps = len(steps)
    step_s = float(steps["duration_s"].mean())
    has_cuda = bool((rows["cat"] == "cuda_runtime").any() or (rows["cat"] == "kernel").any())
    if has_cuda:
        syncs = rows[(rows["cat"] == "cuda_runtime") & rows["name"].str.match(CUDA_SYNC)]
        if not len(syncs):
            return []
        # a sync costs the GPU idle after it (bounded by how long the CPU was held back); the
        # time the CPU blocks in it is the GPU finishing queued work, not lost by itself
        idle = _gpu_idle_after(syncs, rows[rows["cat"] == "kernel"], end)
        syncs = syncs.assign(dur_s=idle)  # the sites below rank by the idle they cause
        blocked = float(sum(idle)) / n_steps
        share = blocked / step_s if step_s else 0.0
        if share < MIN_SHARE_GPU and len(syncs) / n_steps < MIN_SYNCS_PER_STEP_CPU:
            return []
        severity = ev.severity_for_share(share)  # many syncs that cost little: "info", with numbers
        lost = blocked
    else:
        syncs = _scalar_reads_by_the_job(rows, all_rows)
        per_step = len(syncs) / n_steps
        if per_step < MIN_SYNCS_PER_STEP_CPU:
            return []
        severity, lost, share = "low", None, None
    sites = _sites(run, rank, rows, all_rows, syncs)
    ranked = sorted(sites.items(), key=lambda kv: (-kv[1][1], -kv[1][0]) if has_cuda else -kv[1][0])
    site_list = [{"file": s[0] if s else None, "line": s[1] if s else None,
                  "function": s[2] if s else None, "per_step": round(c / n_steps, 2),
                  "gpu_idle_after_s_per_step": round(t / n_steps, 6) if has_cuda else None}
                 for s, (c, t) in ranked[:5]]
    top = ranked[0][0]
    where = f"{top[2]} ({top[0]}:{top[1]})" if top else "an unknown function"
    count = len(syncs) / n_steps
    evidence = {"rank": rank, "profiled_steps": [int(s) for s in steps["step"]],
                "syncs_per_step": round(count, 2), "call_sites": site_list,
                "device_in_trace": has_cuda,
                "line_note": "torch.profiler names a function by its first line (or, for one "
                             "already running when the window opened, the line it stood on); "
                             "torch.cuda.set_sync_debug_mode('warn') prints the exact line on a GPU"}
    blocked = _ledger_sync(run, rank)
    if blocked is not None:
        # the host's side, every step of the run (the shim times syncs on CUDA tensors): how long
        # the training thread waited in them; mostly the GPU finishing queued work, so not the cost
        evidence["host_blocked_in_syncs_s_per_step"] = round(blocked, 6)
    if has_cuda:
        summary = (f"{count:.0f} syncs per step leave the GPU idle {lost * 1000:.1f} ms per step "
                   f"({share:.0%}) until the CPU queues the next kernel; the most costly in {where}.")
    else:
        summary = (f"{count:.0f} host reads of tensor values per step ({SCALAR_READ}, i.e. "
                   f".item()/float()/bool()), the most in {where}. On a GPU each one waits for "
                   "every queued kernel; this run has no GPU, so the cost is not measured.")
    prescriptions = (Prescription(
        kind="code",
        summary=f"remove the host read in {where}: keep the value on the device (torch.where, "
                "masks, torch.nan_to_num) or read it once per step / every N steps",
        expected_gain_s_per_step=lost),)
    return [Finding(
        id="sync.host_device",
        title=f"{count:.0f} host-device syncs per step on rank {rank}, most in "
              f"{top[2] if top else '?'}",
        severity=severity, analyzer="host_sync", summary=summary,
        steps_affected=tuple(int(s) for s in steps["step"]), seconds_lost_per_step=lost,
        share_of_step=share, evidence=evidence, prescriptions=prescriptions, ranks=(rank,))]


def _ledger_sync(run, rank):
    """Seconds per steady step the training thread spent in syncs (the ledger's sync line), or
    None without the shim's sync spans (CPU runs, older runs)."""
    from traindx import ledger

    spans = run.rank_rows("spans", rank)
    if not len(spans) or not (spans["cat"] == "sync").any():
        return None
    led = ledger.steady_rows(run, rank)
    return float(led["sync_s"].mean()) if len(led) else None


def analyze(run):
    trace = run.torch_trace
    if not len(trace):
        return []
    findings = []
    for rank in sorted(set(trace["rank"])):
        findings.extend(_analyze_rank(run, rank, trace))
    return findings
