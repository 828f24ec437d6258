"""Launch-bound steps (GPU): the GPU idles between many short kernels because the CPU cannot
launch them fast enough. From the torch.profiler window (kernel events, cudaLaunchKernel calls),
with NVML utilisation as a second witness."""
from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from traindx.findings import Finding, Prescription

from . import evidence as ev
from .frameworks import runs_megatron

if TYPE_CHECKING:  # annotations only
    from traindx.record import RunRecord

MIN_IDLE_SHARE = 0.30
MAX_MEDIAN_KERNEL_S = 20e-6
MIN_KERNELS_PER_STEP = 200
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaGraphLaunch")
GRAPH_LAUNCH = "cudaGraphLaunch"  # one call replays a whole graph's kernels: not the host's pace


def _analyze_rank(run, rank, trace):
    rows = trace[trace["rank"] == rank]
    kernels = rows[rows["cat"] == "kernel"]
    steps = ev.trace_steps(run, rank)
    if not len(kernels) or not len(steps):
        return []
    per_step = []
    for step in steps.itertuples():
        k = kernels[(kernels["start_ns"] >= step.start_ns) & (kernels["start_ns"] <= step.end_ns)]
        launches = rows[(rows["cat"].isin(("cuda_runtime", "cuda_driver")))
                        & rows["name"].isin(LAUNCH_CALLS)
                        & (rows["start_ns"] >= step.start_ns) & (rows["end_ns"] <= step.end_ns)]
        busy = ev.union_seconds(zip(k["start_ns"], k["end_ns"]))
        per_step.append({"step": int(step.step), "duration_s": float(step.duration_s),
                         "kernels": len(k), "gpu_busy_s": busy, "launch_calls": len(launches),
                         "kernel_launches": int((launches["name"] != GRAPH_LAUNCH).sum()),
                         "median_kernel_s": float(k["dur_s"].median()) if len(k) else None})
    table = pd.DataFrame(per_step)
    window_step_s = float(table["duration_s"].mean())
    busy_s = float(table["gpu_busy_s"].mean())
    # the profiler slows the host in its window, never the kernels: the steady step (the
    # whole run's) less the window's GPU busy time is what a step would save once the GPU,
    # not the launches, set the pace
    steady_s = ev.median_step_s(run, rank) or window_step_s
    step_s = min(steady_s, window_step_s) if steady_s >= busy_s else window_step_s
    idle_share = 1 - busy_s / step_s if step_s else 0.0
    kernels_per_step = float(table["kernels"].mean())
    launches_per_step = float(table["kernel_launches"].mean())
    median_kernel = float(kernels["dur_s"].median())
    # the host's pace is its launches: kernels a CUDA graph replays (one cudaGraphLaunch) are
    # not launched one by one, so they do not count
    if (idle_share < MIN_IDLE_SHARE or median_kernel > MAX_MEDIAN_KERNEL_S
            or kernels_per_step < MIN_KERNELS_PER_STEP
            or launches_per_step < MIN_KERNELS_PER_STEP):
        return []
    lost = step_s - busy_s
    evidence = {"rank": rank, "profiled_steps": per_step, "gpu_busy_share": round(1 - idle_share, 3),
                "kernels_per_step": round(kernels_per_step), "median_kernel_us": round(median_kernel * 1e6, 1),
                "launch_calls_per_step": round(float(table["launch_calls"].mean())),
                "kernel_launches_per_step": round(launches_per_step),
                "window_step_s": round(window_step_s, 6), "steady_step_s": round(step_s, 6)}
    gpu = run.gpu
    if len(gpu):
        span = (int(steps["start_ns"].min()), int(steps["end_ns"].max()))
        util = pd.to_numeric(gpu[(gpu["t"] >= span[0]) & (gpu["t"] <= span[1])]["util"], errors="coerce")
        if len(util.dropna()):
            evidence["nvml_util_mean"] = round(float(util.mean()), 1)
    prescriptions = [
        Prescription(kind="code",
                     summary="capture the step (or its forward/backward) in a CUDA graph: "
                             "torch.compile(model, mode=\"reduce-overhead\") or "
                             "torch.cuda.make_graphed_callables; one launch replaces hundreds",
                     command='model = torch.compile(model, mode="reduce-overhead")',
                     expected_gain_s_per_step=lost),
        Prescription(kind="code",
                     summary="a larger micro-batch per launch (fewer, longer kernels), memory "
                             "permitting; fuse elementwise ops (torch.compile)",
                     expected_gain_s_per_step=lost),
    ]
    if runs_megatron(run.command):
        prescriptions.insert(0, Prescription(
            kind="arg",
            summary="Megatron: enable its CUDA graphs (--cuda-graph-impl local in recent "
                    "releases, --enable-cuda-graph in older ones) and the fused kernels "
                    "(--bias-swiglu-fusion, --cross-entropy-loss-fusion); or raise "
                    "--micro-batch-size",
            expected_gain_s_per_step=lost))
    return [Finding(
        id="gpu.launch_bound",
        title=f"Launch-bound: the GPU is busy {1 - idle_share:.0%} of the step on rank {rank} "
              f"({kernels_per_step:.0f} kernels of median {median_kernel * 1e6:.0f} µs)",
        severity=ev.severity_for_share(idle_share), analyzer="launch_bound",
        summary=(f"In the profiled steps the GPU ran kernels {busy_s * 1000:.1f} ms a step, of a "
                 f"{step_s * 1000:.1f} ms step; {kernels_per_step:.0f} kernels per step with a median of "
                 f"{median_kernel * 1e6:.0f} µs: the CPU's launches, not the GPU, set the pace."),
        steps_affected=tuple(int(s) for s in table["step"]), seconds_lost_per_step=lost,
        share_of_step=idle_share, evidence=evidence, prescriptions=tuple(prescriptions),
        ranks=(rank,))]


def analyze(run: RunRecord) -> list[Finding]:
    trace = run.torch_trace
    if not len(trace) or not (trace["cat"] == "kernel").any():
        return []
    findings = []
    for rank, rows in sorted(trace.groupby("rank", sort=False), key=lambda item: item[0]):
        findings.extend(_analyze_rank(run, rank, rows))  # one pass, not one scan per rank
    return findings
