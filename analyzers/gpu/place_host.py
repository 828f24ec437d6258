"""Places where the host, not the GPU, takes the time (gpu_places' test of a place's host time):
per (module, phase, line), each run of consecutive ops of the place on a thread counts from its
first op's start to its last op's end (the Python between the ops of a loop is the place's
too), less the time its ops waited for the GPU. A loop of small ops per tensor or per sample
shows as many ops whose launches cost more than their kernels while the GPU idles; nothing here
knows what the loop is for.
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

from traindx.analyzers.core.findings import Finding
from traindx.common.units import fmt_s
from traindx.derive import places as P

MIN_PLACE_SHARE = 0.10  # of the step: a place worth judging against its need
MIN_NEED_RATIO = 3.0  # a place this many times slower than its roofline time
REACHABLE = 0.6  # of the roofline a well-made kernel reaches (gpu_math.REACHABLE, FACTS.md §6)
MIN_LOOP_OPS = 32  # ops a step at one host place: a loop (a lone slow op is host work, not launches)
HOST_BOUND = 2.0  # host time this many times the place's GPU time: the GPU idles at least half of it


def host_runs(view: P.RankPlaces) -> pd.DataFrame:
    """Per (module, phase, line): the host's seconds a step there (each run of consecutive ops
    of the place on a thread, from its first op's start to its last op's end, less their time
    waiting for the GPU: the Python between them is the place's too), ops a step, and the GPU
    seconds its launches made and their work needs at the roofline."""
    h = view.host
    if not len(h):
        return pd.DataFrame(columns=["module", "phase", "line", "span_s", "ops", "events", "gpu_s", "need_s"])
    h = h.assign(line=h["line"].fillna(""), events=h.get("events", 1))
    h = h.sort_values(["tid", "start_ns"], kind="stable")
    key = h["module"].astype(str) + "\0" + h["phase"].astype(str) + "\0" + h["line"].astype(str)
    run = (key != key.shift()) | (h["tid"] != h["tid"].shift())
    g = h.assign(run=run.cumsum()).groupby(["module", "phase", "line", "run"], sort=False)
    runs = g.agg(
        start=("start_ns", "min"),
        end=("end_ns", "max"),
        ops=("host_s", "size"),
        wait=("wait_s", "sum"),
        events=("events", "sum"),
    ).reset_index()
    # time blocked on the GPU inside the run (a sync, a full launch queue) is the GPU's
    runs["span_s"] = ((runs["end"] - runs["start"]) / 1e9 - runs["wait"]).clip(lower=0.0)
    out = (
        runs.groupby(["module", "phase", "line"], sort=False)[["span_s", "ops", "events"]].sum() / view.steps
    )
    e = view.events
    gpu = (
        e.assign(line=e["line"].fillna("")).groupby(["module", "phase", "line"])["seconds"].sum() / view.steps
        if len(e)
        else pd.Series(dtype=float)
    )
    out["gpu_s"] = gpu.reindex(out.index).fillna(0.0).to_numpy(float)
    need = (
        e.assign(line=e["line"].fillna(""), need_s=e["need_s"].fillna(0.0))
        .groupby(["module", "phase", "line"])["need_s"]
        .sum()
        / view.steps
        if len(e)
        else pd.Series(dtype=float)
    )
    out["need_s"] = need.reindex(out.index).fillna(0.0).to_numpy(float)
    return out.reset_index().sort_values("span_s", ascending=False)


def host_places(view: P.RankPlaces, severity_of: Callable[[float], str]) -> list[Finding]:
    """Places where the host, not the GPU, takes the time: ≥ MIN_LOOP_OPS ops a step taking
    ≥ MIN_PLACE_SHARE of the step on the host, ≥ HOST_BOUND × the GPU time their launches make
    and ≥ MIN_NEED_RATIO × what their work needs at the roofline, in a step whose GPU idles at
    least MIN_PLACE_SHARE (a loop of small ops per tensor or per sample: each op's launch and
    the Python around it cost more than its kernel). Priced at the host time above what the work
    needs, at most the GPU's idle and the place's own kernels."""
    idle = max(0.0, view.wall_s - view.busy_s)
    if not len(view.events) or not view.wall_s or idle / view.wall_s < MIN_PLACE_SHARE:
        return []
    out = []
    runs = host_runs(view)
    for r in runs.itertuples(index=False):
        span, gpu_s, ops, need = float(r.span_s), float(r.gpu_s), float(r.ops), float(r.need_s)
        # autograd's own nodes (AccumulateGrad per parameter) run at no line of the job's: no
        # loop of the user's to name
        if (
            not r.line
            or ops < MIN_LOOP_OPS
            or span / view.wall_s < MIN_PLACE_SHARE
            or span < HOST_BOUND * gpu_s
            or span < MIN_NEED_RATIO * need
        ):
            continue
        # priced on a steady step: the profiled step's host time less the profiler's cost of
        # recording its events (place_cost)
        steady = max(0.0, span - view.profiler_s_per_event * float(r.events))
        saving = max(0.0, min(steady - need / REACHABLE, idle + gpu_s))
        line = P.frame_text(str(r.line))
        place = f"{r.module} {r.phase} at {line}"
        out.append(
            Finding(
                id="gpu.place_slow",
                title=(
                    f"{place}: {fmt_s(span)} of host time a step ({span / view.wall_s:.0%} of the step) "
                    f"for {ops:.0f} ops whose kernels take {fmt_s(gpu_s)}; the GPU waits for the host there"
                ),
                severity=severity_of(saving / view.wall_s),
                analyzer="gpu_places",
                summary=(
                    f"At {line or r.module} the host issues {ops:.0f} ops a step, "
                    f"{fmt_s(span / max(ops, 1.0))} each with the Python around them, while their kernels "
                    f"take {fmt_s(gpu_s)} in all: the GPU idles until the next launch. One op over all "
                    "the tensors (torch._foreach_* ops, a batched or vectorised call instead of a loop "
                    "per tensor or per sample) or a captured graph (torch.compile, CUDA graphs) does the "
                    "same work in a few launches. Saving: the host time above what the work needs at "
                    "the roofline, at most the GPU's idle in the step and the place's own kernels."
                ),
                seconds_lost_per_step=saving,
                share_of_step=span / view.wall_s,
                ranks=(view.rank,),
                evidence={
                    "bound": "host",
                    "module": str(r.module),
                    "phase": str(r.phase),
                    "line": line,
                    "host_s_per_step": span,
                    "gpu_s_per_step": gpu_s,
                    "need_s_per_step": need,
                    "ops_per_step": ops,
                    "gpu_idle_s_per_step": idle,
                    "host_s_per_steady_step": steady,
                    "profiler_s_per_event": view.profiler_s_per_event,
                },
            )
        )
        if len(out) == 3:
            break
    return out
