"""Launch-bound steps (GPU): the GPU idles between many short kernels because the CPU cannot
launch them fast enough. From the torch.profiler window (kernel events, cudaLaunchKernel calls),
with NVML utilisation as a second witness."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding, Prescription
from traindx.analyzers.core.frameworks import runs_megatron
from traindx.derive.ledger import steady_rows
from traindx.derive.steady import events_of_type

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

# a place whose host time is the GPU's wait (gpu_places, evidence bound: host) is where a
# launch-bound step's time goes: the same seconds, located
DECLARATION = Declaration(
    name="launch_bound", order=70, ids=("gpu.launch_bound",), explains=("gpu.place_slow",)
)

MIN_IDLE_SHARE = 0.30
MAX_MEDIAN_KERNEL_S = 20e-6
MIN_KERNELS_PER_STEP = 200
LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
)
GRAPH_LAUNCH = "cudaGraphLaunch"  # one call replays a whole graph's kernels: not the host's pace
# torch.optim's Optimizer.step runs inside the record_function "Optimizer.step#<Class>.step"
OPTIMIZER_STEP = "Optimizer.step#"
# an optimizer whose step range is at least this share of the profiled step is a cause of its
# own: a per-parameter loop (foreach=False, or fused=False, which turns the foreach default off)
MIN_OPTIMIZER_SHARE = 0.25


def _optimizer_ranges(rows: pd.DataFrame) -> Any:
    """[(start_ns, end_ns, class name)] of torch.optim's step ranges in the trace."""
    marks = rows[(rows["cat"] == "user_annotation") & rows["name"].astype(str).str.startswith(OPTIMIZER_STEP)]
    return [
        (int(m.start_ns), int(m.end_ns), str(m.name)[len(OPTIMIZER_STEP) :].split(".")[0])
        for m in marks.itertuples()
    ]


def _inside(frame: pd.DataFrame, ranges: Any) -> Any:
    hit = pd.Series(False, index=frame.index)
    for start, end, _ in ranges:
        hit |= (frame["start_ns"] >= start) & (frame["end_ns"] <= end)
    return hit


def _steady_spans(run: RunRecord, rank: str) -> Any:
    """(forward/backward s, optimizer s, step s): the time ledger's means over the steady steps,
    or None where the ledger has no optimizer span (no shim hooks on an optimizer)."""
    try:
        rows = steady_rows(run, rank)
    except Exception:  # the derive layer cannot build it: the window's share prices it
        return None
    if not len(rows) or not {"forward_backward_s", "optimizer_s", "wall_s"} <= set(rows.columns):
        return None
    fb, opt, wall = (float(rows[c].mean()) for c in ("forward_backward_s", "optimizer_s", "wall_s"))
    return (fb, opt, wall) if opt > 0 and wall > 0 else None


def _profiled_steps(
    rows: pd.DataFrame, kernels: pd.DataFrame, steps: pd.DataFrame, ranges: list[tuple[int, int, str]]
) -> list[dict[str, Any]]:
    """Per profiled step: its kernels, the GPU's busy time, the launch calls (one by one, and
    the optimizer's) and the optimizer's time."""
    per_step = []
    for step in steps.itertuples():
        k = kernels[(kernels["start_ns"] >= step.start_ns) & (kernels["start_ns"] <= step.end_ns)]
        launches = rows[
            (rows["cat"].isin(("cuda_runtime", "cuda_driver")))
            & rows["name"].isin(LAUNCH_CALLS)
            & (rows["start_ns"] >= step.start_ns)
            & (rows["end_ns"] <= step.end_ns)
        ]
        busy = ev.union_seconds(zip(k["start_ns"], k["end_ns"]))
        one_by_one = launches[launches["name"] != GRAPH_LAUNCH]
        per_step.append(
            {
                "step": int(step.step),
                "duration_s": float(step.duration_s),
                "kernels": len(k),
                "gpu_busy_s": busy,
                "launch_calls": len(launches),
                "kernel_launches": len(one_by_one),
                "optimizer_launches": int(_inside(one_by_one, ranges).sum()) if ranges else 0,
                "optimizer_s": sum(max(0, min(e, step.end_ns) - max(b, step.start_ns)) for b, e, _ in ranges)
                / 1e9,
                "median_kernel_s": float(k["dur_s"].median()) if len(k) else None,
            }
        )
    return per_step


def _analyze_rank(run: RunRecord, rank: str, trace: pd.DataFrame) -> list[Finding]:
    rows = trace[trace["rank"] == rank]
    kernels = rows[rows["cat"] == "kernel"]
    steps = ev.trace_steps(run, rank)
    if not len(kernels) or not len(steps):
        return []
    ranges = _optimizer_ranges(rows)
    per_step = _profiled_steps(rows, kernels, steps, ranges)
    table = pd.DataFrame(per_step)
    if (table["kernels"] > 0).any():
        # a step the trace only touches (its window's last boundary) is no profiled step
        table = table[table["kernels"] > 0]
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
    if (
        idle_share < MIN_IDLE_SHARE
        or median_kernel > MAX_MEDIAN_KERNEL_S
        or kernels_per_step < MIN_KERNELS_PER_STEP
        or launches_per_step < MIN_KERNELS_PER_STEP
    ):
        return []
    lost = step_s - busy_s
    evidence: dict[str, Any] = {
        "rank": rank,
        "profiled_steps": per_step,
        "gpu_busy_share": round(1 - idle_share, 3),
        "kernels_per_step": round(kernels_per_step),
        "median_kernel_us": round(median_kernel * 1e6, 1),
        "launch_calls_per_step": round(float(table["launch_calls"].mean())),
        "kernel_launches_per_step": round(launches_per_step),
        "window_step_s": round(window_step_s, 6),
        "steady_step_s": round(step_s, 6),
    }
    optimizer_class = ranges[0][2] if ranges else None
    optimizer_share, graph_saving = _price_fixes(run, rank, table, optimizer_class, lost, evidence)
    util = _nvml_util(run, steps)
    if util is not None:
        evidence["nvml_util_mean"] = util
    optimizer_named = bool(optimizer_class) and optimizer_share >= MIN_OPTIMIZER_SHARE
    return [
        Finding(
            id="gpu.launch_bound",
            title=f"Launch-bound: the GPU is busy {1 - idle_share:.0%} of the step on rank {rank} "
            f"({kernels_per_step:.0f} kernels of median {median_kernel * 1e6:.0f} µs)",
            severity=ev.severity_for_share(idle_share),
            analyzer="launch_bound",
            summary=(
                f"In the profiled steps the GPU ran kernels {busy_s * 1000:.1f} ms a step, of a "
                f"{step_s * 1000:.1f} ms step; {kernels_per_step:.0f} kernels per step with a median of "
                f"{median_kernel * 1e6:.0f} µs: the CPU's launches, not the GPU, set the pace."
                + (
                    f" {optimizer_class}.step was {optimizer_share:.0%} of the step, launching "
                    f"{evidence['optimizer']['share_of_launches']:.0%} of the kernels."
                    if optimizer_named
                    else ""
                )
            ),
            steps_affected=tuple(int(s) for s in table["step"]),
            seconds_lost_per_step=lost,
            share_of_step=idle_share,
            evidence=evidence,
            prescriptions=_launch_prescriptions(
                run, optimizer_class, optimizer_share, graph_saving, lost, evidence
            ),
            ranks=(rank,),
        )
    ]


def _price_fixes(
    run: RunRecord,
    rank: str,
    table: pd.DataFrame,
    optimizer_class: str | None,
    lost: float,
    evidence: dict[str, Any],
) -> tuple[float, float]:
    """(the optimizer's share of the step, what a CUDA graph saves); the prices and the
    optimizer's launches go into `evidence`."""
    # a CUDA graph of the model's forward/backward removes the host's launching there; an
    # optimizer stepping each parameter by itself launches outside any such graph, and a
    # multi-tensor optimizer removes that. Each fix is priced by the host's time in its part of
    # the step: the time ledger's steady forward/backward and optimizer spans (the shim's hooks,
    # every steady step, no profiler), else the optimizer's share of the profiled steps. H200,
    # 400 layers, AdamW(fused=False): ledger 54 ms forward/backward and 74 ms optimizer of a
    # 136 ms step; the graph alone saved 58 ms, the fused optimizer alone 74 ms. The profiled
    # step's share (the optimizer's range 45 % of it) under-priced the optimizer by 26 %.
    window_share = min(1.0, float(table["optimizer_s"].sum()) / max(1e-9, float(table["duration_s"].sum())))
    spans = _steady_spans(run, rank)
    if spans is not None:
        forward_backward_s, optimizer_s, wall_s = spans
        optimizer_share = min(1.0, optimizer_s / wall_s)
        graph_saving, optimizer_saving = min(forward_backward_s, lost), min(optimizer_s, lost)
        evidence["priced_by"] = "the time ledger's steady forward/backward and optimizer spans"
    else:
        optimizer_share = window_share
        graph_saving, optimizer_saving = lost * (1 - window_share), lost * window_share
        evidence["priced_by"] = "the optimizer's share of the profiled steps"
    graph_saving, optimizer_saving = round(graph_saving, 6), round(optimizer_saving, 6)
    evidence["cuda_graph_saving_s"] = graph_saving
    if optimizer_class:
        evidence["optimizer"] = {
            "class": optimizer_class,
            "launches_per_step": round(float(table["optimizer_launches"].mean())),
            "share_of_launches": round(
                float(table["optimizer_launches"].sum()) / max(1, int(table["kernel_launches"].sum())), 3
            ),
            "share_of_profiled_step": round(window_share, 3),
            "share_of_step": round(optimizer_share, 3),
            "saving_s": optimizer_saving,
        }
    return optimizer_share, graph_saving


def _nvml_util(run: RunRecord, steps: pd.DataFrame) -> float | None:
    """NVML's mean GPU utilisation over the profiled steps, or None without samples there."""
    gpu = run.gpu
    if not len(gpu):
        return None
    span = (int(steps["start_ns"].min()), int(steps["end_ns"].max()))
    util = pd.to_numeric(gpu[(gpu["t"] >= span[0]) & (gpu["t"] <= span[1])]["util"], errors="coerce")
    return round(float(util.mean()), 1) if len(util.dropna()) else None


def _launch_prescriptions(
    run: RunRecord,
    optimizer_class: str | None,
    optimizer_share: float,
    graph_saving: float,
    lost: float,
    evidence: dict[str, Any],
) -> tuple[Prescription, ...]:
    prescriptions = [
        Prescription(
            kind="code",
            summary="capture the step (or its forward/backward) in a CUDA graph: "
            'torch.compile(model, mode="reduce-overhead") or '
            "torch.cuda.make_graphed_callables; one launch replaces hundreds",
            command='model = torch.compile(model, mode="reduce-overhead")',
            expected_gain_s_per_step=graph_saving,
        ),
        Prescription(
            kind="code",
            summary="a larger micro-batch per launch (fewer, longer kernels), memory "
            "permitting; fuse elementwise ops (torch.compile)",
            expected_gain_s_per_step=graph_saving,
        ),
    ]
    if optimizer_class and optimizer_share >= MIN_OPTIMIZER_SHARE:
        # ranked by gain: before the graph where the optimizer launches most
        prescriptions.insert(
            0 if optimizer_share >= 0.5 else 1,
            Prescription(
                kind="code",
                summary=f"a multi-tensor optimizer: {optimizer_class}(..., fused=True) where it "
                f"has a fused kernel (Adam, AdamW, SGD, Adagrad), else foreach=True; its "
                f"step is {optimizer_share:.0%} of the step, launching kernels one parameter "
                f"at a time (fused=False or foreach=False turns the multi-tensor default off)",
                expected_gain_s_per_step=evidence["optimizer"]["saving_s"],
            ),
        )
    if runs_megatron(run.command):
        prescriptions.insert(
            0,
            Prescription(
                kind="arg",
                summary="Megatron: enable its CUDA graphs (--cuda-graph-impl local in recent "
                "releases, --enable-cuda-graph in older ones) and the fused kernels "
                "(--bias-swiglu-fusion, --cross-entropy-loss-fusion); or raise "
                "--micro-batch-size",
                expected_gain_s_per_step=lost,
            ),
        )
    return tuple(prescriptions)


# a per-parameter optimizer step judged without a profiled window (it stood down: tens of
# thousands of launches cost more to trace than its budget): tensors it loops over, and the share
# of its step the multi-tensor path removes (the H200's 2,000-tensor AdamW: 272 of 277 ms)
MIN_LOOPED_TENSORS = 100
MULTI_TENSOR_SAVING = 0.9


def _looped_optimizer(run: RunRecord) -> list[Finding]:
    """A GPU run whose optimizer was told foreach=False (one parameter's kernels at a time) and
    whose optimizer line is a large share of the step: named from the shim's record of how the
    optimizer was made and the ledger, where no torch.profiler window could be traced."""
    if not len(run.gpu):
        return []
    made = events_of_type(run, "optimizer_created")
    if not len(made) or "foreach" not in made.columns:
        return []
    first = made.iloc[0]
    tensors = pd.to_numeric(pd.Series([first.get("tensors")]), errors="coerce").iloc[0]
    foreach = first.get("foreach")
    told_off = isinstance(foreach, (bool, np.bool_)) and not foreach  # None/NaN: torch's default
    if not told_off or not tensors or tensors < MIN_LOOPED_TENSORS:
        return []
    rank = str(first.get("rank", "0"))
    rows = steady_rows(run)
    rows = rows[rows["rank"].astype(str) == rank] if len(rows) else rows
    if not len(rows) or "optimizer_s" not in rows:
        return []
    optimizer_s, step_s = float(rows["optimizer_s"].median()), float(rows["wall_s"].median())
    share = optimizer_s / step_s if step_s else 0.0
    if share < MIN_OPTIMIZER_SHARE:
        return []
    name = str(first.get("optimizer") or "the optimizer")
    saving = optimizer_s * MULTI_TENSOR_SAVING
    evidence: dict[str, Any] = {
        "rank": rank,
        "optimizer": {"class": name, "share": round(share, 3), "saving_s": saving},
        "tensors": int(tensors),
        "foreach": False,
        "optimizer_s_per_step": optimizer_s,
        "steady_step_s": step_s,
        "profiled": False,
    }
    return [
        Finding(
            id="gpu.launch_bound",
            title=f"{name} steps {int(tensors)} parameter tensors one at a time "
            f"({share:.0%} of the step on rank {rank})",
            severity=ev.severity_for_share(saving / step_s if step_s else 0.0),
            analyzer="launch_bound",
            summary=(
                f"The optimizer was made with foreach=False: its step launches each parameter's "
                f"kernels on its own, {optimizer_s * 1000:.1f} ms of a {step_s * 1000:.1f} ms step. "
                "The multi-tensor path does the same math in a few launches per group. (No "
                "torch.profiler window was traced: this step's launches cost more to trace than "
                "its budget.)"
            ),
            seconds_lost_per_step=saving,
            share_of_step=share,
            ranks=(rank,),
            evidence=evidence,
            prescriptions=(
                Prescription(
                    kind="code",
                    summary=f"a multi-tensor optimizer: {name}(..., fused=True) where it has a fused "
                    "kernel (Adam, AdamW, SGD, Adagrad), else foreach=True, instead of foreach=False",
                    expected_gain_s_per_step=saving,
                ),
            ),
        )
    ]


def analyze(run: RunRecord) -> list[Finding]:
    trace = run.torch_trace
    if not len(trace) or not (trace["cat"] == "kernel").any():
        return _looped_optimizer(run)
    findings = []
    for rank, rows in sorted(trace.groupby("rank", sort=False), key=lambda item: item[0]):
        findings.extend(_analyze_rank(run, rank, rows))  # one pass, not one scan per rank
    return findings
