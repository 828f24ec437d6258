"""Places whose memory-bound kernels make many passes over the same data (gpu_places' second
test of a place against its need): a chain of elementwise and reduction ops written one by one
(a norm, an activation or an attention spelled out in tensor ops) reads and writes each
intermediate in full, where one fused kernel reads its inputs and writes its outputs once.

Per module call and phase, each run of consecutive GPU kernels that are memory-bound (launched
by that call's own ops: a child module's kernel or a matmul between them ends the run) could be
one kernel: its floor is the bytes of its largest op. A place (the module's class path, all its
instances summed, and a phase) whose memory-bound kernels take ≥ MIN_SHARE of the step and move
≥ MIN_PASSES × their runs' floors is named, priced at the time of the bytes above the floor.
Nothing here knows what the chain computes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pandas as pd

from traindx.analyzers.core.findings import Finding
from traindx.common.units import fmt_s
from traindx.derive import places as P

MEMORY_FAMILIES = ("elementwise", "reduction", "other")
DEVICE_COPY = "copy DtoD"  # kernel_classes' label of a copy within the device's memory
MIN_SHARE = 0.10  # of the step: the place's memory-bound kernels
MIN_PASSES = 3.0  # bytes moved over the runs' floors
MODULE_PHASES = ("forward", "backward", "recompute")  # the phases a module's own code runs in
_INDEX = re.compile(r"_\d+$")


def class_path(module: str) -> str:
    """'LM_0.Block_3.RMSNorm_7' -> 'LM.Block.RMSNorm' (every instance of a repeated module)."""
    return ".".join(_INDEX.sub("", part) for part in str(module).split("."))


def runs(events: pd.DataFrame) -> pd.DataFrame:
    """The memory-bound kernels of module calls, each with its run (`run`) and the run's floor
    (`floor`: the bytes of the run's largest op)."""
    if not len(events) or "call" not in events:
        return events.iloc[0:0].assign(run=[], floor=[])
    e = events.sort_values("start_ns", kind="stable").reset_index(drop=True)
    # a kernel of an op without recorded sizes (a scalar's) stays in the run, its bytes unknown;
    # a memset (a reduction's zero fill, part of its op) and a device-to-device copy move bytes
    # through the same memory as an elementwise kernel: they are passes of the chain, not its ends
    through_memory = e["family"].isin(MEMORY_FAMILIES) | (e["family"] == "memset")
    mem = pd.Series(through_memory.to_numpy() & (e["call"].to_numpy() >= 0))
    key = e["call"].astype(str) + "\0" + e["phase"].astype(str)
    start = ~mem | ~mem.shift(fill_value=False) | (key != key.shift())
    m = e[mem.to_numpy()].assign(run=start.cumsum()[mem].to_numpy())
    m = m.assign(bytes=m["bytes"].fillna(0.0))
    floor = m.groupby(["run", "op"])["bytes"].sum().groupby("run").max()
    return m.assign(floor=m["run"].map(floor).to_numpy(float))


def passes_places(
    view: P.RankPlaces,
    explained: pd.Series,
    saving_of: Callable[[float], float],
    severity_of: Callable[[float], str],
) -> list[Finding]:
    """The places whose memory-bound kernels make ≥ MIN_PASSES passes over their data."""
    if not len(view.events) or not view.wall_s:
        return []
    m = runs(view.events[~explained.to_numpy()])
    if not len(m):
        return []
    out = []
    m = m.assign(place=[class_path(x) for x in m["module"]])
    above: dict[str, dict[str, float]] = {}  # per place, per phase: GPU seconds above one pass
    judged = []
    for (place, phase), g in m.groupby(["place", "phase"], sort=False):
        gpu_s = float(g["seconds"].sum()) / view.steps
        moved = float(g["bytes"].sum())
        floor = float(g.drop_duplicates("run")["floor"].sum())
        passes = moved / floor if floor > 0 else 1.0
        above.setdefault(str(place), {})[str(phase)] = gpu_s * max(0.0, 1.0 - 1.0 / passes)
        if gpu_s / view.wall_s >= MIN_SHARE and floor > 0 and moved >= MIN_PASSES * floor:
            judged.append((str(place), str(phase), g, gpu_s, passes))
    named: set[str] = set()
    for place, phase, g, gpu_s, passes in sorted(judged, key=lambda j: -j[3]):
        if place in named:
            continue  # its larger phase's finding holds this phase's bytes above one pass
        named.add(place)
        # the fused op that replaces the module's chain replaces it in each phase (a fused
        # forward has a fused backward): the other phases' bytes above one pass go too
        others = {p: s for p, s in above[place].items() if p != phase and p in MODULE_PHASES and s > 0}
        out.append(_finding(view, place, phase, g, gpu_s, passes, others, saving_of, severity_of))
    return sorted(out, key=lambda f: -(f.seconds_lost_per_step or 0.0))[:3]


def _finding(
    view: P.RankPlaces,
    place: str,
    phase: str,
    g: pd.DataFrame,
    gpu_s: float,
    passes: float,
    others: dict[str, float],
    saving_of: Callable[[float], float],
    severity_of: Callable[[float], str],
) -> Finding:
    by = g.groupby(["module", g["line"].fillna("")])["seconds"].sum().sort_values(ascending=False)
    module, line = by.index[0]
    line_text = P.frame_text(str(line)) if line else None
    calls = g["call"].nunique() / view.steps
    ops = g["op"].nunique() / max(g["run"].nunique(), 1)
    saving = saving_of(gpu_s * (1.0 - 1.0 / passes) + sum(others.values()))
    also = "".join(f", and {fmt_s(s)} of its {p}'s" for p, s in others.items())
    share = gpu_s / view.wall_s
    kernels: list[dict[str, Any]] = P._top_kernels(g)
    dominant = kernels[0]["label"] if kernels else "?"
    return Finding(
        id="gpu.place_slow",
        title=(
            f"{place} {phase} ({calls:.0f} call{'s' if calls != 1 else ''} a step): {fmt_s(gpu_s)} of "
            f"memory-bound kernels a step ({share:.0%} of the step) moving {passes:.1f}× the bytes one "
            f"fused kernel would ({ops:.1f} separate ops per chain); mostly {dominant}"
        ),
        severity=severity_of(saving / view.wall_s),
        analyzer="gpu_places",
        summary=(
            f"At {line_text or module} a chain of {ops:.1f} elementwise/reduction ops runs one kernel "
            "each, back to back on the GPU: every op reads and writes its whole tensor, so the chain "
            f"moves {passes:.1f}× the bytes of its largest op, where one fused kernel reads the inputs "
            "and writes the outputs once. A fused op for what the chain computes (an attention, norm or "
            "loss function of torch or of a kernel library) or torch.compile over the module makes it "
            f"one pass. Saving: the time of the bytes above one pass{also}, less the GPU's idle."
        ),
        seconds_lost_per_step=saving,
        share_of_step=share,
        ranks=(view.rank,),
        evidence={
            "bound": "passes",
            "module": str(module),
            "place": place,
            "phase": phase,
            "line": line_text,
            "gpu_s_per_step": gpu_s,
            "passes": passes,
            "ops_per_chain": ops,
            "calls_per_step": calls,
            "other_phases_above_one_pass_s": others,
            "bytes_per_step": float(g["bytes"].sum()) / view.steps,
            "top_kernels": kernels,
        },
    )


__all__ = ["class_path", "passes_places", "runs"]
