"""What this run cost the job: traindx's own line, stated by every run.

Three parts, each measured (profiler/shim/_traindx_shim/selfcost.py, the launcher's helper
accounting in profiler/helpercpu.py):
  in the job     the shim's own time on the job's threads (its step-end work: the thread's CPU
                 time, mean; its wrappers: wall time, the median step's, see _in_job_s) and its
                 threads' CPU (they take the GIL): the `cpu` events' shim_end_ns, shim_ns and
                 shim_threads_cpu_s over the steady steps, per step
  helpers        py-spy's recorders and snapshots, the output relay, NVML and diagnose's live
                 judge run beside the job: they cost it only where it waited for a core, and
                 only with the CPU the machine had no idle core for (their CPU less its idle
                 core-seconds meanwhile): that part is priced at the training thread's
                 run-queue wait, in proportion to its share of the CPU that other tasks took
                 meanwhile (sys busy - the job's own): on a host with idle cores it is 0
  on purpose     the steps traindx perturbed to look closer (a torch.profiler window's excess
                 over the median step): once, not per step

pct = per-step cost / (step - per-step cost): what the job's step would shrink by without
traindx, as a share of the bare step (the bench's ratio minus one).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from traindx.derive.runview import RunView
from traindx.derive.steady import perturbed_steps
from traindx.profiler.shim._traindx_shim import schema

FIRST_STEP = 1  # step 0 carries start-up work (first allocations, discovery): not the steady cost


def _cpu_rows(run: RunView) -> pd.DataFrame:
    cpu = run.of_type(schema.CPU)
    if not len(cpu) or "shim_ns" not in cpu:
        return cpu.iloc[0:0]
    cpu = cpu[cpu["shim_ns"].notna() & (pd.to_numeric(cpu["step"], errors="coerce") >= FIRST_STEP)]
    skip = perturbed_steps(run)
    if skip:
        keep = [int(s) not in skip.get(str(r), ()) for r, s in zip(cpu["rank"], cpu["step"])]
        cpu = cpu[np.asarray(keep, bool)]
    return cpu


def _num(df: pd.DataFrame, col: str) -> pd.Series:
    if col not in df:
        return pd.Series(np.zeros(len(df)), index=df.index)
    return pd.to_numeric(df[col], errors="coerce").fillna(0.0)


def _helpers(run: RunView, cpu: pd.DataFrame, steps: int) -> dict[str, Any]:
    """The helpers' CPU (manifest) and what it cost the job per step (see the docstring)."""
    cost = run.manifest.get("self_cost") or {}
    helpers = {k: float(v) for k, v in (cost.get("helpers_cpu_s") or {}).items() if v is not None}
    total = sum(helpers.values())
    out: dict[str, Any] = {"helpers_cpu_s": helpers, "helpers_s_per_step": 0.0}
    wall = cost.get("wall_s")
    if not total or not steps or not wall:
        return out
    runq = float(_num(cpu, "thread_runq_s").sum())
    idle = float(_num(cpu, "sys_idle_s").sum())
    span = float(_num(cpu, "sys_total_s").sum())
    busy = span - idle
    own = float(_num(cpu, "proc_cpu_s").sum())
    # the helpers' CPU in the judged steps (their CPU over the run, spread evenly over its wall)
    judged = total * min(1.0, (span / max(1, _cores(cpu))) / wall) if span else 0.0
    # they compete with the job for cores only with the CPU the machine had no idle core for:
    # on a host with idle cores (a 16-core GPU host, a job on 1-2) they cost it nothing, on a
    # saturated 2-core box all of it
    competing = max(0.0, judged - idle)
    others = max(busy - own, competing, 1e-9)
    out["helpers_s_per_step"] = runq * min(1.0, competing / others) / steps
    out["helpers_competing_cpu_s"] = competing
    out["helpers_cpu_pct_of_core"] = 100.0 * total / wall
    return out


def _cores(cpu: pd.DataFrame) -> int:
    cores = _num(cpu, "cores")
    return int(cores.max()) if len(cores) and cores.max() > 0 else 1


def _on_purpose(run: RunView) -> dict[str, Any]:
    """The steps perturbed on purpose: a torch.profiler window's excess, the step after it."""
    windows = run.of_type(schema.TORCH_PROFILE)
    after = run.of_type(schema.TORCH_PROFILE_AFTER)
    excess = float(_num(windows, "excess_s").sum()) + float(_num(after, "excess_s").sum())
    steps = {
        int(s)
        for first, last in zip(_num(windows, "first_step"), _num(windows, "last_step"))
        for s in range(int(first), int(last) + 1)
    }
    # the profiler's start, stop and export, and a memory hunt's censuses: the shim's work at
    # the step ends they ran at (its `cpu` events' shim_purpose_ns)
    cpu = run.of_type(schema.CPU)
    work = float(_num(cpu, "shim_purpose_ns").sum()) / 1e9
    hunts = run.of_type(schema.MEM_HUNT)
    steps.update(int(s) for s in _num(hunts, "step"))
    return {
        "perturbed_steps": sorted(steps),
        "perturbed_s": excess + work,
        "hunts": len(hunts),
        "profiler_windows": len(windows),
    }


def self_cost(run: RunView) -> dict[str, Any] | None:
    """What traindx cost this run's job (keys in the module docstring), or None for a run
    recorded without the shim's own accounting (an older shim, `attach`, --no-shim)."""
    return run.cached("self_cost", lambda: _build(run))


def _build(run: RunView) -> dict[str, Any] | None:
    cpu = _cpu_rows(run)
    if not len(cpu):
        return None
    steps = len(cpu)
    step_s = _period(run)
    shim = _in_job_s(run, cpu)
    threads = float(_num(cpu, "shim_threads_cpu_s").sum()) / steps
    out: dict[str, Any] = {
        "steps": steps,
        "step_s": step_s,
        "shim_s_per_step": shim,
        "threads_s_per_step": threads,
    }
    out.update(_helpers(run, cpu, steps))
    out.update(_on_purpose(run))
    # what looking closer on purpose cost, as a share of the whole run's steps (windows that
    # recur, on a job whose steps vary, add up)
    n_steps = int(run.steps["step"].max()) + 1 if len(run.steps) else 0
    if n_steps and math.isfinite(step_s):
        out["perturbed_pct"] = 100.0 * out["perturbed_s"] / (n_steps * step_s)
    per_step = shim + threads + out["helpers_s_per_step"]
    out["per_step_s"] = per_step
    bare = step_s - per_step
    out["pct"] = 100.0 * per_step / bare if bare > 0 else math.nan
    out.update(_shed(run))
    return out


def _in_job_s(run: RunView, cpu: pd.DataFrame) -> float:
    """The shim's own seconds a step on the job's thread. The step end's is the thread's CPU
    time (a shim that says so: its `self_cost` events' end_clock) and its mean counts (the
    machine read every 100 ms is part of it). The wrappers' is wall time, less the wrapped
    calls': a step that was preempted inside a wrapper carries the wait for a core as well, so
    their typical step counts (the median: the same calls run every step). An older shim's
    step end was wall time too: its median."""
    end = _num(cpu, "shim_end_ns")
    wrap = (_num(cpu, "shim_ns") - end).clip(lower=0)
    summary = run.of_type(schema.SELF_COST)
    on_cpu = len(summary) and "end_clock" in summary and (summary["end_clock"] == "thread").any()
    return (float(end.mean() if on_cpu else end.median()) + float(wrap.median())) / 1e9


def _period(run: RunView) -> float:
    """The median step as the job's own clock sees it: begin to next begin (the shim's step-end
    work falls between the two), over the steady steps."""
    st = run.steps.dropna(subset=["start_ns"])
    st = st[st["step"] >= FIRST_STEP].sort_values(["rank", "step"])
    if len(st) < 2:
        return math.nan
    gaps = st.groupby("rank", sort=False)["start_ns"].diff().dropna() / 1e9
    return float(gaps.median()) if len(gaps) else math.nan


def _shed(run: RunView) -> dict[str, Any]:
    shed = run.of_type(schema.SHED)
    summary = run.of_type(schema.SELF_COST)
    out: dict[str, Any] = {"shed": []}
    if len(shed):
        out["shed"] = [
            {"step": int(r.step), "what": str(r.what), "cost_pct": float(r.cost_pct)}
            for r in shed.itertuples()
        ]
    if len(summary):
        last = summary.iloc[-1]
        out["budget_pct"] = float(last["budget_pct"]) if "budget_pct" in last else None
        parts = last.get("parts") if hasattr(last, "get") else None
        if isinstance(parts, dict):
            out["parts_s"] = {k: float(v) / 1e9 for k, v in parts.items()}
    return out


def cost_line(cost: dict[str, Any] | None) -> str | None:
    """One sentence: what this run cost the job (the terminal's, the report's, the finding's)."""
    if not cost or not math.isfinite(cost.get("pct", math.nan)):
        return None
    ms = cost["per_step_s"] * 1e3
    parts = [f"traindx cost this job ~{cost['pct']:.1f} % of step time ({ms:.2f} ms a step:"]
    parts.append(
        f"in the job {(cost['shim_s_per_step'] + cost['threads_s_per_step']) * 1e3:.2f} ms, "
        f"helpers {cost['helpers_s_per_step'] * 1e3:.2f} ms)"
    )
    line = " ".join(parts)
    if cost.get("perturbed_s"):
        steps = cost["perturbed_steps"]
        where = (
            f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}" if steps else "a window"
        )
        what = [
            f"{cost[n]} {w}{'s' if cost[n] > 1 else ''}"
            for w, n in (("torch.profiler window", "profiler_windows"), ("memory hunt", "hunts"))
            if cost.get(n)
        ]
        line += (
            f"; {cost['perturbed_s']:.2f} s on purpose for {' and '.join(what) or 'a closer look'} ({where}"
        )
        share = cost.get("perturbed_pct")
        line += (
            f": {share:.1f} % of the time this run's steps took)"
            if share is not None and math.isfinite(share)
            else ")"
        )
    if cost.get("shed"):
        line += "; over its budget it shed: " + ", ".join(s["what"] for s in cost["shed"])
    return line
