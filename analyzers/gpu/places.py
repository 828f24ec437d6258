"""Where the step's GPU time goes in the model's own structure, set against what that work needs
(derive/places.py), and the mechanisms that explain a place whatever the cause is called:

- `gpu.places` (a note): the top places of a step (module path × phase: GPU and host time,
  roofline time, line), in findings.json, the terminal and the report;
- `gpu.recompute`: forward work re-run inside backward (module calls or forward ops inside
  autograd nodes: activation checkpointing) ≥ 5 % of the step; its price is that GPU time, the
  fix is checkpointing off where the device's memory headroom allows it;
- `gpu.layout_nchw`: cuDNN's layout transposes (`nchwToNhwc`/`nhwcToNchw`) and normalisation
  kernels of the NCHW layout beside convolutions ≥ 10 % of the step: channels_last;
- `gpu.cast_in_autocast`: fp32 matmul/conv at a place while the rest of the step multiplies in
  bf16/fp16 (a cast or a region that undoes autocast) ≥ 5 % of the step;
- `gpu.place_slow`: any place that takes ≥ 10 % of the step and ≥ 3× what its FLOPs and bytes
  need at the device's roofline, at its module and line with its dominant kernels, whether or
  not a mechanism above knows why; or a place (module, phase, line) whose host time is ≥ 10 %
  of the step and ≥ 3× the GPU time its launches make while the GPU idles (evidence
  `bound: host`: a loop of small ops per tensor or per sample).

Every saving is GPU time removed less the GPU's idle in the step (a GPU second is a step second
only where the GPU sets the pace), as gpu_math prices its own.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import pandas as pd

from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import NOTE, Finding, Prescription

# the place tests' thresholds: a place ≥ MIN_PLACE_SHARE of the step and ≥ MIN_NEED_RATIO × its
# roofline time (GPU or host); REACHABLE of the roofline a well-made kernel reaches
from traindx.analyzers.gpu.place_dense import dense_places
from traindx.analyzers.gpu.place_host import MIN_NEED_RATIO, MIN_PLACE_SHARE, REACHABLE, host_places
from traindx.analyzers.gpu.place_passes import passes_places
from traindx.common.units import fmt_s
from traindx.derive import device_peaks
from traindx.derive import places as P
from traindx.derive.memory import host_headroom, memory_table

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="gpu_places",
    order=96,
    ids=("gpu.places", "gpu.recompute", "gpu.layout_nchw", "gpu.cast_in_autocast", "gpu.place_slow"),
    not_causes=("gpu.places",),
)

MIN_RECOMPUTE_SHARE = 0.05  # of the step: forward work re-run inside backward
MIN_LAYOUT_SHARE = 0.10  # of the step: transposes and NCHW normalisation around convolutions
MIN_CAST_SHARE = 0.05  # of the step: fp32 math in a step that otherwise multiplies in 16 bits
TOP_PLACES = 8
_TRANSPOSE = re.compile(r"nchwtonhwc|nhwctonchw", re.I)
_NORM = re.compile(r"batch_norm|batchnorm|bn_fw|bn_bw|instance_norm|group_norm|layer_norm", re.I)
_CHANNELS_LAST = re.compile(r"channels_last|nhwc", re.I)
_INDEX = re.compile(r"_\d+$")


def _step_saving(view: P.RankPlaces, gpu_saved_s: float) -> float:
    return max(0.0, gpu_saved_s - max(0.0, view.wall_s - view.busy_s))


def _severity(share: float) -> str:
    sev = ev.severity_for_share(share)
    return "low" if sev == NOTE else sev


def _class_of(module: str) -> str:
    """'GPT_0.Block_3' -> 'Block' (the module's class, as the tracer names its instances)."""
    return _INDEX.sub("", module.split(".")[-1]) if module else module


def _slowest(views: dict[str, P.RankPlaces]) -> P.RankPlaces | None:
    return max(views.values(), key=lambda v: v.wall_s, default=None)


def _place_rows(view: P.RankPlaces, limit: int = TOP_PLACES) -> list[dict[str, Any]]:
    out = []
    for r in view.table.head(limit).to_dict("records"):
        need = r["need_s"]
        out.append(
            {
                "module": r["module"],
                "phase": r["phase"],
                "line": r["line"] if isinstance(r["line"], str) else None,
                "gpu_s": r["gpu_s"],
                "host_s": r["host_s"],
                "wait_s": r["wait_s"],
                "share": r["gpu_s"] / view.wall_s if view.wall_s else None,
                "kernels": r["kernels"],
                "flops": r["flops"],
                "bytes": r["bytes"],
                "need_s": None if need is None or not math.isfinite(need) else need,
                "top_kernel": (r["top_kernels"][0]["label"] if r["top_kernels"] else None),
            }
        )
    return out


def places_text(rows: list[dict[str, Any]], limit: int = 6) -> str:
    """A few lines: 'Block_3 backward  12.0 ms GPU (31%) · needs 2.1 ms · model.py:45 forward'."""
    lines = []
    for r in rows[:limit]:
        need = f" · needs {fmt_s(r['need_s'])}" if r.get("need_s") else ""
        share = f" ({r['share']:.0%})" if r.get("share") is not None else ""
        where = f" · {r['line']}" if r.get("line") else ""
        lines.append(
            f"{r['module']} {r['phase']}: {fmt_s(r['gpu_s'])} GPU{share}, "
            f"{fmt_s(r['host_s'])} host{need}{where}"
        )
    return "\n".join(lines)


def _short(module: str, root: str | None) -> str:
    """A module path less the model's own root call (every place shares it)."""
    return module[len(root) + 1 :] if root and module.startswith(root + ".") else module


def _note(view: P.RankPlaces) -> Finding:
    rows = _place_rows(view)
    gpu = bool(len(view.events))
    column = "gpu_s" if gpu else "host_s"
    waited = float(view.table["wait_s"].sum())
    phases = view.table.groupby("phase")[column].sum().sort_values(ascending=False)
    split = ", ".join(f"{p} {fmt_s(s)}" for p, s in phases.items() if s > 0)
    roots = {str(r["module"]).split(".")[0] for r in rows if r["module"] != P.NO_MODULE}
    root = next(iter(roots)) if len(roots) == 1 else None
    ranked = sorted(rows, key=lambda r: r[column], reverse=True)[:3]
    top = " · ".join(
        f"{_short(str(r['module']), root)} {r['phase']} {fmt_s(r[column])}"
        + (f" ({r[column] / view.wall_s:.0%})" if view.wall_s else "")
        for r in ranked
    )
    title = (
        f"where the {'GPU' if gpu else 'host'} time of a step goes: {top}"
        + (f"; by phase {split}" if split else "")
        if ranked
        else "where the time goes: nothing in the window"
    )
    return Finding(
        id="gpu.places",
        title=title,
        severity=NOTE,
        analyzer="gpu_places",
        summary=(
            "The profiled steps' GPU and host time by module and phase (forward, backward, "
            "forward recomputed in backward, optimizer, evaluation), with what the work needs at "
            "the device's roofline:\n"
            + places_text(rows)
            + (
                f"\nThe host waited {fmt_s(waited)} a step for the GPU (syncs, a full launch queue): "
                "GPU time, not host work."
                if waited
                else ""
            )
            + ("" if view.modules else "\n(the window had no Python stacks: no module paths)")
        ),
        ranks=(view.rank,),
        evidence={
            "places": rows,
            "steps": view.steps,
            "wall_s": view.wall_s,
            "busy_s": view.busy_s,
            "host_waiting_for_gpu_s": waited,
        },
    )


def _headroom(run: RunRecord, rank: str) -> tuple[float, float] | None:
    """(peak reserved bytes, total bytes) of the device (the shim's memory events)."""
    try:
        table = memory_table(run)
    except Exception:  # an older record: no headroom to quote
        return None
    mine = table[(table["rank"] == str(rank)).to_numpy()] if len(table) else table
    if not len(mine):
        return None
    peak = pd.to_numeric(mine["dev_reserved_bytes"], errors="coerce").max()
    total = pd.to_numeric(mine["dev_total_bytes"], errors="coerce").max()
    if not (peak == peak and total == total and total > 0):
        return None
    return float(peak), float(total)


def _host_room(run: RunRecord, rank: str) -> tuple[float, float] | None:
    """(peak resident bytes, that peak plus the least the host had free) of a CPU job."""
    try:
        table = memory_table(run)
    except Exception:  # an older record
        return None
    mine = table[(table["rank"] == str(rank)).to_numpy()] if len(table) else table
    if not len(mine):
        return None
    peak = pd.to_numeric(mine["rss_bytes"], errors="coerce").max()
    free = [host_headroom(row)[0] for _, row in mine.iterrows()]
    known = [f for f in free if f is not None]
    if not (peak == peak and peak > 0 and known):
        return None
    return float(peak), float(peak) + min(known)


def _recompute(run: RunRecord, view: P.RankPlaces) -> Finding | None:
    rows = view.table[(view.table["phase"] == "recompute").to_numpy()]
    gpu = bool(len(view.events))  # a CPU job's window: the host's time is its price
    column = "gpu_s" if gpu else "host_s"
    gpu_s = float(rows[column].sum()) if len(rows) else 0.0
    if not view.wall_s or gpu_s / view.wall_s < MIN_RECOMPUTE_SHARE:
        return None
    rows = rows.sort_values(column, ascending=False)
    roots = rows.assign(root=[m.split(".")[0] for m in rows["module"]]).groupby("root")[column].sum()
    classes = sorted({_class_of(r) for r in roots.index if r != P.NO_MODULE})
    where = ", ".join(classes) or "forward ops"
    top = rows.iloc[0]
    share = gpu_s / view.wall_s
    saving = _step_saving(view, gpu_s) if gpu else gpu_s
    room = _headroom(run, view.rank) if gpu else _host_room(run, view.rank)
    room_text = (
        f"; the {'device' if gpu else 'host'}'s memory peaked at {room[0] / 2**30:.1f} of "
        f"{room[1] / 2**30:.1f} GiB "
        f"({(room[1] - room[0]) / 2**30:.1f} GiB free)"
        if room
        else ""
    )
    return Finding(
        id="gpu.recompute",
        title=(
            f"the forward of {where} ({len(roots)} call{'s' if len(roots) != 1 else ''}) runs again inside "
            f"backward: {fmt_s(gpu_s)} of {'GPU' if gpu else 'host'} time a step ({share:.0%} of the step), "
            "activation checkpointing"
        ),
        severity=_severity(saving / view.wall_s),
        analyzer="gpu_places",
        summary=(
            "Module calls (or forward ops) run inside autograd's backward nodes: the forward is "
            "recomputed to rebuild activations that were not kept (torch.utils.checkpoint and "
            "the frameworks' gradient/activation checkpointing). It trades memory for time; "
            f"where the memory allows, keep the activations instead{room_text}. Saving: the "
            "recomputed GPU time, less the GPU's idle in the step."
        ),
        seconds_lost_per_step=saving,
        share_of_step=share,
        ranks=(view.rank,),
        evidence={
            "recompute_gpu_s_per_step": gpu_s,
            "modules": [str(m) for m in roots.sort_values(ascending=False).index[:8]],
            "line": top["line"],
            "top_kernels": top["top_kernels"],
            "memory_peak_bytes": room[0] if room else None,
            "memory_total_bytes": room[1] if room else None,
            "memory_space": "device" if gpu else "host",
            "device_kind": "cuda" if gpu else "cpu",
            "wall_s_per_step": view.wall_s,
        },
        prescriptions=(
            Prescription(
                kind="code",
                summary=(
                    f"turn activation checkpointing off for {where} (call the module directly "
                    "instead of through torch.utils.checkpoint, or the framework's "
                    "gradient_checkpointing flag off)"
                    + (", or only for as many blocks as the free memory holds" if room else "")
                ),
                change={},
                expected_gain_s_per_step=saving,
                automatic=False,
            ),
        ),
        removes={"gpu_work": True},
    )


def _where(events: pd.DataFrame) -> tuple[str, str | None]:
    """(module, line) that holds most of these GPU events' time."""
    g = events.groupby(["module", events["line"].fillna("")])["seconds"].sum().sort_values(ascending=False)
    module, line = g.index[0]
    return str(module), P.frame_text(str(line)) if line else None


def _layout(view: P.RankPlaces, device: str | None) -> Finding | None:
    e = view.events
    if not len(e) or not (e["family"] == "conv").any():
        return None
    names = e["name"].astype(str)
    transposes = e[names.str.contains(_TRANSPOSE).to_numpy()]
    norms = e[(names.str.contains(_NORM) & ~names.str.contains(_CHANNELS_LAST)).to_numpy()]
    t_s, n_s = float(transposes["seconds"].sum()), float(norms["seconds"].sum())
    total = (t_s + n_s) / view.steps
    if not view.wall_s or total / view.wall_s < MIN_LAYOUT_SHARE:
        return None
    # the norm kernels kept, at the rate a well-made kernel moves their bytes
    need = norms["need_s"].to_numpy(float)
    kept = float(pd.Series(need).sum()) / REACHABLE if len(need) and (need == need).all() else n_s / 2.0
    gpu_saved = (t_s + max(0.0, n_s - kept)) / view.steps
    saving = _step_saving(view, gpu_saved)
    module, line = _where(pd.concat([transposes, norms]))
    share = total / view.wall_s
    return Finding(
        id="gpu.layout_nchw",
        title=(
            f"convolutions in the NCHW layout: cuDNN's layout transposes {fmt_s(t_s / view.steps)} and "
            f"NCHW normalisation kernels {fmt_s(n_s / view.steps)} a step ({share:.0%} of the step), "
            f"most at {module}"
        ),
        severity=_severity(saving / view.wall_s),
        analyzer="gpu_places",
        summary=(
            "The tensor-core convolution engines work in NHWC: on NCHW tensors cuDNN transposes "
            "each input and output (nchwToNhwc/nhwcToNchw kernels), and the normalisation layers "
            "run their NCHW kernels, which read memory with strides. torch.channels_last keeps "
            "activations in NHWC end to end. Saving: the transposes, and the normalisation time "
            f"above {REACHABLE:.0%} of the memory bandwidth its bytes need, less the GPU's idle."
        ),
        seconds_lost_per_step=saving,
        share_of_step=share,
        ranks=(view.rank,),
        evidence={
            "transpose_s_per_step": t_s / view.steps,
            "nchw_norm_s_per_step": n_s / view.steps,
            "module": module,
            "line": line,
            "top_kernels": P._top_kernels(pd.concat([transposes, norms])),
            "wall_s_per_step": view.wall_s,
            "device": device,
        },
        prescriptions=(
            Prescription(
                kind="code",
                summary=(
                    "keep the activations in NHWC: model = model.to(memory_format=torch.channels_last) "
                    "and each input batch x = x.to(memory_format=torch.channels_last)"
                ),
                change={},
                expected_gain_s_per_step=saving,
                automatic=False,
                command="model = model.to(memory_format=torch.channels_last)",
            ),
        ),
        removes={"gpu_work": True},
    )


def _cast(view: P.RankPlaces, device: str | None) -> Finding | None:
    e = view.events
    math_rows = e[e["family"].isin(("matmul", "conv")).to_numpy()] if len(e) else e
    if not len(math_rows):
        return None
    fp32 = math_rows[(math_rows["precision"] == "fp32").to_numpy()]
    low = math_rows[math_rows["precision"].isin(("bf16", "fp16")).to_numpy()]
    fp32_s = float(fp32["seconds"].sum()) / view.steps
    if not len(low) or not view.wall_s or fp32_s / view.wall_s < MIN_CAST_SHARE:
        return None
    # a cast is local: fewer modules multiply in fp32 than in 16 bits (a job whose math is fp32
    # throughout, with a few 16-bit kernels, is gpu_math's fp32 finding: autocast is off)
    fp32_modules = set(fp32["module"]) - {P.NO_MODULE}
    low_modules = set(low["module"]) - {P.NO_MODULE}
    if not fp32_modules or len(fp32_modules) >= len(low_modules):
        return None
    peak = device_peaks.match_device(device)
    target = str(low.groupby("precision")["seconds"].sum().idxmax())
    ratio = (peak.tflops["fp32"] / peak.tflops[target]) if peak and target in peak.tflops else 0.0
    saving = _step_saving(view, fp32_s * (1.0 - ratio))
    module, line = _where(fp32)
    share = fp32_s / view.wall_s
    return Finding(
        id="gpu.cast_in_autocast",
        title=(
            f"{fmt_s(fp32_s)} of fp32 matmul a step at {module} ({share:.0%} of the step) while the rest of "
            f"the step multiplies in {target}: a cast to float32 (or a region with autocast off) there"
        ),
        severity=_severity(saving / view.wall_s),
        analyzer="gpu_places",
        summary=(
            f"Most matrix math of the step runs in {target} (autocast), but at this place it runs in "
            "fp32 on the CUDA cores: an input cast with .float() / .to(torch.float32), a dtype= "
            "argument, or autocast(enabled=False) around it. Unless the place needs fp32 for its "
            "accuracy, leave the cast to autocast. Saving: that math at the "
            f"{target} rate (device peaks), less the GPU's idle."
        ),
        seconds_lost_per_step=saving,
        share_of_step=share,
        ranks=(view.rank,),
        evidence={
            "fp32_math_s_per_step": fp32_s,
            "module": module,
            "line": line,
            "phases": sorted(set(fp32["phase"])),
            "top_kernels": P._top_kernels(fp32),
            "target_precision": target,
        },
        prescriptions=(
            Prescription(
                kind="code",
                summary=(
                    f"remove the float32 cast at {line or module} (let autocast pick {target}), "
                    "or keep fp32 only for the reduction that needs it"
                ),
                change={},
                expected_gain_s_per_step=saving,
                automatic=False,
            ),
        ),
        removes={"gpu_work": True},
    )


def _explained(view: P.RankPlaces, ids: set[str]) -> pd.Series:
    """The GPU events a mechanism found has named (the generic place finding leaves them out)."""
    e = view.events
    names = e["name"].astype(str)
    mask = pd.Series(False, index=e.index)
    if "gpu.recompute" in ids:
        mask |= e["phase"] == "recompute"
    if "gpu.layout_nchw" in ids:
        mask |= names.str.contains(_TRANSPOSE) | (
            names.str.contains(_NORM) & ~names.str.contains(_CHANNELS_LAST)
        )
    if "gpu.cast_in_autocast" in ids:
        mask |= e["family"].isin(("matmul", "conv")) & (e["precision"] == "fp32")
    return mask


def _slow_places(
    view: P.RankPlaces, explained: pd.Series, room: tuple[float, float] | None = None
) -> list[Finding]:
    """Places ≥ MIN_PLACE_SHARE of the step and ≥ MIN_NEED_RATIO × their roofline time, the
    deepest such module of each branch, per phase (kernels a mechanism named left out)."""
    e = view.events
    if not len(e) or not view.wall_s:
        return []
    # copies and collectives move bytes over a link, not through the SMs: their own analyzers
    # judge them (pageable copies, device-to-host copies, exposed communication)
    e = e[~explained.to_numpy() & ~e["family"].isin(("copy", "memset", "communication")).to_numpy()]
    depth = max((len(str(m).split(".")) for m in e["module"]), default=1)
    hits: list[tuple[int, str, str, pd.DataFrame]] = []
    for d in range(depth, 0, -1):
        cut = e.assign(place=[".".join(str(m).split(".")[:d]) for m in e["module"]])
        for (place, phase), g in cut.groupby(["place", "phase"], sort=False):
            gpu_s = float(g["seconds"].sum()) / view.steps
            need_s = _need_of(g) / view.steps
            if gpu_s / view.wall_s < MIN_PLACE_SHARE or not need_s > 0:
                continue  # unknown, or no work the sizes could price (a fill, an index)
            if gpu_s < MIN_NEED_RATIO * need_s:
                continue
            if any(p.startswith(place + ".") or p == place for _, p, ph, _ in hits if ph == phase):
                continue  # a deeper place of this branch is already named
            hits.append((d, str(place), str(phase), g))
    return [_slow_place(view, place, phase, g, room) for _, place, phase, g in hits[:3]]


def _need_of(g: pd.DataFrame) -> float:
    """Roofline seconds of a place's events; the events of ops without recorded sizes are taken
    to need what the others need per second of theirs (NaN when they are over a fifth of it)."""
    need = g["need_s"].to_numpy(float)
    seconds = g["seconds"].to_numpy(float)
    known = need == need
    total, covered = float(seconds.sum()), float(seconds[known].sum())
    if not total or covered < 0.8 * total:
        return math.nan
    return float(need[known].sum()) * total / covered


def _slow_place(
    view: P.RankPlaces, place: str, phase: str, g: pd.DataFrame, room: tuple[float, float] | None = None
) -> Finding:
    gpu_s = float(g["seconds"].sum()) / view.steps
    need_s = _need_of(g) / view.steps
    kernels = P._top_kernels(g)
    _, line = _where(g)
    saving = _step_saving(view, max(0.0, gpu_s - need_s / REACHABLE))
    share = gpu_s / view.wall_s
    dominant = kernels[0] if kernels else {"label": "?", "family": "?"}
    return Finding(
        id="gpu.place_slow",
        title=(
            # outside any module the line is the place's only name (a window without stacks)
            f"{place} {phase}{f' at {line}' if line and place == P.NO_MODULE else ''}: "
            f"{fmt_s(gpu_s)} of GPU a step ({share:.0%} of the step), "
            f"{gpu_s / need_s:.0f}× what its work needs ({fmt_s(need_s)} at the roofline); "
            f"mostly {dominant['label']}"
        ),
        severity=_severity(saving / view.wall_s),
        analyzer="gpu_places",
        summary=(
            "This place's kernels take far longer than its FLOPs and bytes need at the device's "
            "peak rates (the op sizes torch.profiler recorded): small or oddly shaped kernels, "
            "many launches, a slow kernel choice, or work the model did not mean to do. "
            f"At {line or place}; its dominant kernels are listed. Saving, if it ran at "
            f"{REACHABLE:.0%} of the roofline: less the GPU's idle."
        ),
        seconds_lost_per_step=saving,
        share_of_step=share,
        ranks=(view.rank,),
        evidence={
            "module": place,
            "phase": phase,
            "line": line,
            "gpu_s_per_step": gpu_s,
            "need_s_per_step": need_s,
            "flops_per_step": float(g["flops"].sum()) / view.steps,
            "bytes_per_step": float(g["bytes"].sum()) / view.steps,
            "top_kernels": kernels,
            # what --fix's ladder of global switches reads (fixing/plan/ladder.py)
            "families": _seconds_by(g, "family", view.steps),
            "precisions": _seconds_by(g, "precision", view.steps),
            "device_kind": "cuda",
            "memory_space": "device",
            "memory_peak_bytes": room[0] if room else None,
            "memory_total_bytes": room[1] if room else None,
        },
    )


def _seconds_by(g: pd.DataFrame, column: str, steps: int) -> dict[str, float]:
    """GPU seconds a step of a place's events by a column's value (kernel family, precision)."""
    sums = g.groupby(g[column].fillna("?").astype(str))["seconds"].sum().sort_values(ascending=False)
    return {str(k): float(v) / max(steps, 1) for k, v in sums.items()}


def analyze(run: RunRecord) -> list[Finding]:
    views = P.cached_places(run)
    device = device_peaks.device_name(run.manifest)
    out: list[Finding] = []
    for view in views.values():
        if not len(view.table):
            continue
        gpu = bool(len(view.events))
        made = (
            _recompute(run, view),
            _layout(view, device) if gpu else None,
            _cast(view, device) if gpu else None,
        )
        mechanisms = [f for f in made if f]
        out.extend(mechanisms)
        explained = _explained(view, {f.id for f in mechanisms}) if gpu else None
        if explained is not None:
            out.extend(_slow_places(view, explained, _headroom(run, view.rank)))
            saving_of = lambda gpu_saved, v=view: _step_saving(v, gpu_saved)  # noqa: E731
            out.extend(passes_places(view, explained, saving_of, _severity))
            out.extend(dense_places(view, saving_of, _severity))
        out.extend(host_places(view, _severity))
    slowest = _slowest(views)
    if slowest is not None and len(slowest.table):
        out.append(_note(slowest))
    return out
