"""The savings model: what a finding's fix is expected to save, from the time ledger.

Judge layer: it prices findings (their `removes`: the ledger lines the fix takes away) against
the derived ledger (traindx.derive.ledger) and the shim's CPU evidence (traindx.derive.ledger.cpu_evidence).
`predicted_step_time` is what the --fix loop writes beside the measured candidate (the ledger,
a derive-layer module, does not import it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike, NDArray

from traindx.analyzers.core import gpu_window
from traindx.analyzers.core.savings_workers import (
    core_share_seen,
    loader_time_split,
    workers_prediction,
    workers_step_capped,
    workers_step_measured,
    workers_step_model,
)
from traindx.derive.ledger import CATEGORIES, SPAN_CATEGORY, rows, steady_rows

# the names read here by other modules (some defined in the modules imported above)
__all__ = [
    "workers_prediction",
    "core_share_seen",
    "fresh_graph_calls",
    "gc_freeze_residual",
    "gpu_work_per_step",
    "io_after_effect",
    "loader_time_split",
    "predicted_step_time",
    "removed_seconds",
    "workers_step_capped",
    "workers_step_measured",
    "workers_step_model",
]

if TYPE_CHECKING:  # annotations only
    from traindx.analyzers.core.findings import Finding
    from traindx.derive.run import RunRecord


def _freezes_the_heap(finding: Finding) -> bool:
    """True when the finding's first prescription is gc.freeze() (not Megatron's manual GC,
    which moves every collection out of the steps and so does remove the whole gc line)."""
    p = finding.prescriptions[0] if getattr(finding, "prescriptions", ()) else None
    return p is not None and "gc.freeze" in f"{p.command or ''} {p.summary}"


def gc_freeze_residual(run: RunRecord, rank: str, steps: Iterable[int]) -> float | None:
    """Seconds per step of the gc line that gc.freeze() leaves, from the baseline's own GC records on
    `rank` over `steps`; None when they cannot tell.

    Freeze takes the objects alive at the freeze out of the collector's view; what stays (measured:
    bench/ledger_predictions.py case gc) is the young collections and the garbage only a full
    collection frees. A full collection costs a + b * collected (a: walking the heap, which freeze
    removes; b: per object freed, which stays); b is the slope of the shortest pause (contention only
    lengthens one) against the objects freed over each haul size, so it needs collections that freed
    different numbers of objects. The residual is b * (objects freed by full collections per step)."""
    steps = {int(s) for s in steps}
    g = run.gc
    if not steps or not len(g) or "collected" not in g or "generation" not in g:
        return None
    g = g[(g["rank"].astype(str) == str(rank)) & g["step"].isin(steps)]
    full = g[(g["generation"] == 2) & (g["count"] > 0)]
    young = 0.0
    sp = run.of_type("span")
    if len(sp) and "cat" in sp and "generation" in sp:
        sp = sp[(sp["rank"].astype(str) == str(rank)) & (sp["cat"] == "gc") & (sp["generation"] < 2)]
        led = rows(run, rank, steps).sort_values("start_ns")
        begin = led["start_ns"].astype("int64").to_numpy()
        end = led["end_ns"].astype("int64").to_numpy()
        s = sp["start"].astype("int64").to_numpy()
        e = sp["t"].astype("int64").to_numpy()
        if len(begin) and len(s):  # each young pause inside a step, clipped at its end
            i = np.clip(np.searchsorted(begin, s, side="right") - 1, 0, None)
            inside = (s >= begin[i]) & (s < end[i])
            young = float((np.minimum(e, end[i]) - s)[inside].sum()) / 1e9
    n = len(steps)
    if not len(full):
        return young / n
    count = full["count"].to_numpy(float)
    pause = pd.Series(full["total_s"].to_numpy(float) / count)  # per collection
    freed = full["collected"].to_numpy(float) / count
    # the lower envelope: the shortest pause of each haul size (a loaded machine preempts the
    # collector mid-pause, which only ever adds time), then the least-squares slope over them
    low = pause.groupby(freed).min()
    if len(low) < 2:
        return None
    x, y = low.index.to_numpy(float), low.to_numpy(float)
    slope = float(np.sum((x - x.mean()) * (y - y.mean())) / np.sum((x - x.mean()) ** 2))
    # a slope above the dearest collection's own pause per object would make the heap walk
    # negative; below zero is noise
    slope = min(max(0.0, slope), float(np.max(y / np.maximum(x, 1.0))))
    # objects freed per step: what the collections after the first freed, over the steps since
    # it (the first one's haul piled up before the window); one collection: its haul per step
    by_step = full.sort_values("step")
    if len(by_step) > 1:
        first, last = int(by_step["step"].iloc[0]), int(by_step["step"].iloc[-1])
        rate = float(by_step["collected"].iloc[1:].sum()) / max(1, last - first)
    else:
        rate = float(by_step["collected"].sum()) / n
    return young / n + slope * rate


def _gc_freeze_removed(run: RunRecord, led: pd.DataFrame) -> float | None:
    """The gc line per step less what gc.freeze leaves (gc_freeze_residual), for the slowest
    rank; None when a rank's records cannot tell."""
    out = []
    for rank, rl in led.groupby("rank"):
        residual = gc_freeze_residual(run, rank, rl["step"])
        if residual is None:
            return None
        out.append(max(0.0, float(rl["gc_s"].mean()) - residual))
    return max(out) if out else None


def io_after_effect(led: pd.DataFrame) -> float | None:
    """Seconds per step that the steps holding an I/O span (a save) and the step right after each
    lose beyond the span itself, against the other steps; None when every step or none holds I/O.

    Why (measured: bench/ledger_predictions.py case checkpoint): a large torch.save leaves dirty
    pages to write back and has pushed the model out of the CPU caches, so removing the save removes
    that too (on a loaded 2-core machine the saving exceeded the io line by 30-35 %)."""
    out = []
    for _, rl in led.sort_values("step").groupby("rank"):
        io = rl["io_s"].to_numpy() > 0
        if not io.any() or io.all():
            return None
        steps = rl["step"].to_numpy()
        after = np.isin(steps, steps[io] + 1) & ~io
        rest = (rl["wall_s"] - rl["io_s"]).to_numpy()
        clean = ~io & ~after
        if not clean.any():
            return None
        excess = float((rest[io | after] - rest[clean].mean()).sum()) / len(rl)
        out.append(max(0.0, excess))
    return max(out) if out else None


# a training step's forward does about a third of its model work, the backward two thirds (two
# gradient products per forward product): the usual 2N : 4N FLOPs per token
_FORWARD_PER_BACKWARD = 0.5
# the model calls: the spans the ledger books as fwd/bwd
_MODEL_CALLS = tuple(sorted(c for c, line in SPAN_CATEGORY.items() if line == "forward_backward"))


def _covered(start: ArrayLike, end: ArrayLike, s: ArrayLike, e: ArrayLike) -> NDArray[np.int64]:
    """Nanoseconds of each [start, end) (arrays) covered by the union of the intervals [s, e):
    the union merged once, then a prefix sum of its lengths read at both ends."""
    start, end = np.asarray(start, dtype=np.int64), np.asarray(end, dtype=np.int64)
    s, e = np.asarray(s, dtype=np.int64), np.asarray(e, dtype=np.int64)
    keep = e > s
    if not keep.any():
        return np.zeros(len(start), dtype=np.int64)
    order = np.argsort(s[keep], kind="stable")
    s, e = s[keep][order], e[keep][order]
    reach = np.maximum.accumulate(e)
    # a new run of the union begins where an interval starts after every earlier one ended
    begins = np.concatenate([[True], s[1:] > reach[:-1]])
    first = np.flatnonzero(begins)
    us, ue = s[first], np.maximum.reduceat(reach, first)
    cum = np.concatenate([[0], np.cumsum(ue - us)])

    def below(x: NDArray[np.int64]) -> NDArray[np.int64]:  # length of the union before x
        i = np.searchsorted(us, x, side="right") - 1
        inside = np.where(
            i >= 0, np.clip(x - us[np.maximum(i, 0)], 0, ue[np.maximum(i, 0)] - us[np.maximum(i, 0)]), 0
        )
        return np.asarray(cum[np.maximum(i, 0)] * (i >= 0) + inside, dtype=np.int64)

    return below(end) - below(start)


def fresh_graph_calls(run: RunRecord, rank: str, steps: Iterable[int]) -> dict[int, float]:
    """{step: seconds} the recompiling steps of `rank` lose in their model calls beyond the compile
    events; {} without forward spans.

    Why (measured: docs/fix.md, the steady-recompile rows): a model call that holds a compile is the
    first call of a fresh graph and pays, outside the compile event, for the failed guard, the cache
    lookup and the graph's lazy first call (5-40 ms against a steady 0.5-1 ms on a tiny model). What
    stays is the call's steady cost: its mean where it holds no compile, else half a backward for a
    forward (1 : 2 work) or twice a forward for a backward; nothing where every call compiles."""
    calls_df = run.cached(
        f"model_calls_outside_compile:{rank}", lambda: _model_calls_outside_compile(run, rank)
    )
    if not len(calls_df):
        return {}
    steady = {int(s) for s in steady_rows(run, rank)["step"]}
    clean = calls_df[~calls_df["compiles"] & calls_df["step"].isin(steady)]
    # the mean, as measured (a loaded machine's waits included): the prediction is a mean step
    steady_cost = {
        cat: float(clean[clean["cat"] == cat]["outside_s"].mean())
        for cat in _MODEL_CALLS
        if (clean["cat"] == cat).any()
    }
    if "forward" not in steady_cost and "backward" in steady_cost:
        steady_cost["forward"] = steady_cost["backward"] * _FORWARD_PER_BACKWARD
    elif "backward" not in steady_cost and "forward" in steady_cost:
        steady_cost["backward"] = steady_cost["forward"] / _FORWARD_PER_BACKWARD
    chosen = {int(s) for s in steps}
    first = calls_df[calls_df["compiles"] & calls_df["step"].isin(chosen)]
    if not len(first):
        return {}
    steady_of_call = first["cat"].map(steady_cost).fillna(0.0).astype(float)
    excess = (first["outside_s"].astype(float) - steady_of_call).clip(lower=0.0)
    per_step = excess.groupby(first["step"]).sum()
    # never more than the step's fwd/bwd line: the time is taken from it
    fb = rows(run, rank).drop_duplicates("step").set_index("step")["forward_backward_s"]
    per_step = np.minimum(per_step, fb.reindex(per_step.index).fillna(np.inf))
    return {int(k): float(v) for k, v in per_step.items()}


def _model_calls_outside_compile(run: RunRecord, rank: str) -> pd.DataFrame:
    """One row per model call (forward/backward span) of `rank` inside a step: step, cat,
    outside_s (its seconds outside compile events and GC pauses), compiles (it holds a compile);
    empty without forward spans or compile events."""
    empty = pd.DataFrame(columns=["step", "cat", "outside_s", "compiles"])
    sp = run.spans
    if not len(sp) or "cat" not in sp or not (sp["cat"] == "forward").any():
        return empty
    sp = sp[(sp["rank"].astype(str) == str(rank)) & sp["cat"].isin(_MODEL_CALLS + ("gc",))]
    comp = run.compiles
    if len(comp):
        comp = comp[comp["rank"].astype(str) == str(rank)].dropna(subset=["start_ns", "end_ns"])
    led = rows(run, rank).sort_values("start_ns")
    if not len(comp) or not len(led):
        return empty
    cs = comp["start_ns"].astype("int64").to_numpy()
    ce = comp["end_ns"].astype("int64").to_numpy()
    gc = sp[sp["cat"] == "gc"]
    both_s = np.concatenate([cs, gc["start_ns"].astype("int64").to_numpy()])
    both_e = np.concatenate([ce, gc["end_ns"].astype("int64").to_numpy()])
    calls = sp[sp["cat"].isin(_MODEL_CALLS)]
    begin = led["start_ns"].astype("int64").to_numpy()
    end = led["end_ns"].astype("int64").to_numpy()
    s0 = calls["start_ns"].astype("int64").to_numpy()
    e0 = calls["end_ns"].astype("int64").to_numpy()
    i = np.clip(np.searchsorted(begin, s0, side="right") - 1, 0, None)
    inside = (s0 >= begin[i]) & (e0 <= end[i])
    if not inside.any():
        return empty
    a, b = s0[inside], e0[inside]
    return pd.DataFrame(
        {
            "step": led["step"].to_numpy().astype(np.int64)[i[inside]],
            "cat": calls["cat"].to_numpy()[inside],
            "outside_s": (b - a - _covered(a, b, both_s, both_e)) / 1e9,
            "compiles": _covered(a, b, cs, ce) > 0,
        }
    )


def _fresh_graph_removed(run: RunRecord, led: pd.DataFrame, chosen: set[int]) -> pd.Series | None:
    """Per ledger row of `led`: the fresh-graph seconds of fresh_graph_calls on the rows of the
    `chosen` steps (0 elsewhere); None when no rank's record can tell."""
    out = pd.Series(0.0, index=led.index)
    told = False
    for rank, rl in led.groupby("rank"):
        excess = fresh_graph_calls(run, rank, [s for s in rl["step"] if int(s) in chosen])
        if excess:
            told = True
            out.loc[rl.index] = [excess.get(int(s), 0.0) for s in rl["step"]]
    return out if told else None


def removed_seconds(run: RunRecord, finding: Finding) -> float | None:
    """Seconds per steady step the finding's fix removes: the ledger lines of finding.removes over its
    ranks' steady steps (the slowest rank's mean); None when it names no ledger line. Lines that move
    into N worker processes take workers_prediction where the shim recorded CPU evidence (a step can
    then get slower: a negative saving), else the overlap bound below."""
    removes = getattr(finding, "removes", None) or {}
    cats = [c for c in removes.get("categories", ()) if c in CATEGORIES]
    if not cats or not len(run.ledger):
        return None
    led = steady_rows(run)
    ranks = [r for r in (finding.ranks or ()) if r in set(led["rank"])]
    if ranks:
        led = led[led["rank"].isin(ranks)]
    if not len(led):
        return None
    workers = removes.get("workers")
    if workers and cats == ["data"] and not removes.get("steps"):
        model = workers_prediction(run, finding, removes)
        if model is not None:
            baseline = float(led.groupby("rank")["wall_s"].mean().max())
            return (baseline - model[0]) * float(removes.get("fraction", 1.0))
    if cats == ["gc"] and not removes.get("steps") and _freezes_the_heap(finding):
        removed = _gc_freeze_removed(run, led)
        if removed is not None:
            return removed * float(removes.get("fraction", 1.0))
    after = io_after_effect(led) if cats == ["io"] and not workers and not removes.get("steps") else None
    per_row = led[[f"{c}_s" for c in cats]].sum(axis=1)
    if after is not None:
        per_row = per_row + after
    if workers:
        # the lines move to `workers` processes that run beside the step: what stays is the
        # part of the work that a step's remaining time cannot hide, max(0, L / w - rest)
        rest = led["wall_s"] - per_row
        cpus = removes.get("cpus")
        parallel = min(float(workers), max(1.0, float(cpus) - 1)) if cpus else float(workers)
        per_row = per_row - (per_row / parallel - rest).clip(lower=0.0)
        if cpus:
            # the workers' CPU work competes with the step's on the same cores: a step cannot get
            # shorter than all of it spread over them
            per_row = per_row.clip(upper=led["wall_s"] * (1.0 - 1.0 / float(cpus)))
    if removes.get("steps"):
        chosen = {int(s) for s in removes["steps"]}
        per_row = per_row.where(led["step"].isin(chosen), 0.0)
        if removes.get("fresh_graph_calls"):
            fresh = _fresh_graph_removed(run, led, chosen)
            if fresh is not None:
                per_row = per_row + fresh
    fraction = float(removes.get("fraction", 1.0))
    return float(per_row.groupby(led["rank"]).mean().max()) * fraction


def gpu_work_per_step(run: RunRecord, ranks: Sequence[str] = ()) -> float | None:
    """Seconds the GPU is busy (kernels, copies, memsets) in a mean profiled step, the largest
    over the ranks named (all when none): no change on the host shortens a step below it. None
    without a torch.profiler window holding GPU work."""
    trace = run.torch_trace
    if not len(trace) or not trace["cat"].isin(gpu_window.GPU_WORK).any():
        return None
    busy = []
    for rank in ranks or sorted(set(trace["rank"])):
        measured = gpu_window.busy_per_step(run, rank, trace[(trace["rank"] == rank).to_numpy()])
        if measured is not None and measured[1] > 0:
            busy.append(measured[1])
    return max(busy) if busy else None


def _ledger_method(run: RunRecord, finding: Finding, led: pd.DataFrame) -> tuple[str, dict[str, Any] | None]:
    """(how the removed seconds were priced, the workers model's range and evidence or None)
    for a finding that names its ledger lines."""
    method = "ledger lines the fix removes, mean per steady step"
    removes = getattr(finding, "removes", None) or {}
    model = (
        workers_prediction(run, finding, removes)
        if removes.get("workers")
        and list(removes.get("categories", ())) == ["data"]
        and not removes.get("steps")
        else None
    )
    if (
        list(removes.get("categories", ())) == ["gc"]
        and _freezes_the_heap(finding)
        and not removes.get("steps")
        and _gc_freeze_removed(run, led) is not None
    ):
        method = (
            "gc line less what gc.freeze leaves: young collections and the cost of "
            "freeing each step's cyclic garbage (traindx.analyzers.core.savings.gc_freeze_residual)"
        )
    if (
        removes.get("fresh_graph_calls")
        and removes.get("steps")
        and _fresh_graph_removed(run, led, {int(s) for s in removes["steps"]}) is not None
    ):
        method = (
            "compile line plus the recompiling model calls' time outside it, down to "
            "their steady cost (traindx.analyzers.core.savings.fresh_graph_calls)"
        )
    if model is None:
        return method, None
    method = (
        "CPU model of the DataLoader workers (traindx.analyzers.core.savings."
        "workers_step_measured, workers_step_model) from the shim's CPU evidence"
    )
    return method, {"low_s": model[1][0], "high_s": model[1][1], "cpu_evidence": dict(model[2])}


def predicted_step_time(run: RunRecord, finding: Finding, gain: float | None = None) -> dict[str, Any]:
    """What the --fix loop writes beside the measured candidate: baseline, removed and predicted step
    seconds (None without a ledger line: `gain`, the prescription's own saving, stands in). A fix
    moving the data line into workers adds "predicted_range_s" and its "cpu_evidence": one baseline
    bounds, but does not fix, the cores the job gets beside the machine's other work."""
    led = steady_rows(run)
    ranks = [r for r in (finding.ranks or ()) if r in set(led["rank"])]
    if ranks:
        led = led[led["rank"].isin(ranks)]
    baseline = float(led.groupby("rank")["wall_s"].mean().max()) if len(led) else None
    removed = removed_seconds(run, finding)
    spread = None
    if removed is None:
        # the candidate's own prescription where it says (a finding with several fixes, each
        # an arm: the launch-bound model's graph, its optimizer, both), else the first
        gains = [
            p.expected_gain_s_per_step
            for p in finding.prescriptions
            if p.expected_gain_s_per_step is not None
        ]
        removed = gain if gain is not None else gains[0] if gains else None
        method = "the prescription's expected gain (the finding names no ledger line)"
    else:
        method, spread = _ledger_method(run, finding, led)
    predicted = None if baseline is None or removed is None else max(0.0, baseline - removed)
    # a fix that takes GPU work away (a faster precision, a copy not made) lowers the floor too
    floor = (
        None if (getattr(finding, "removes", None) or {}).get("gpu_work") else gpu_work_per_step(run, ranks)
    )
    if predicted is not None and floor is not None and floor > predicted:
        # host time removed from a step the GPU was busy through part of: the step cannot end
        # before the GPU's own work in it (the H200 seed job: 10.3 s of compile removed from a
        # 10.4 s step left 41 ms predicted against 76 ms of kernels per step)
        predicted = floor
        method += "; no shorter than the GPU's busy time per profiled step"
    out = {
        "baseline_step_s": baseline,
        "removed_s": removed,
        "predicted_step_s": predicted,
        "categories": list((getattr(finding, "removes", None) or {}).get("categories", ())),
        "method": method,
    }
    if floor is not None:
        out["gpu_busy_floor_s"] = floor
    if spread:
        out["predicted_range_s"] = [spread["low_s"], spread["high_s"]]
        out["cpu_evidence"] = spread["cpu_evidence"]
    return out
