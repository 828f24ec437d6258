"""Replay the op table over its dependency model, vectorised over steps, DP ranks and what-ifs.

`cube` lays the table out as dense arrays indexed [node, step, dp] (TP ranks of a worker fold
into it: an op lasts as long as its slowest TP rank). An op's *work* is its duration for a
compute op and its transfer time for a communication op: its end less the latest start among
the ranks it talks to (the time it would take had nobody been late). `replay` runs the model
on any work array of shape [node, what-if, step, dp] and returns every op's start and end.

Pure computation: no judgement.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from traindx.derive.depmodel import DepModel
from traindx.derive.optable import is_comm


@dataclass
class Cube:
    steps: np.ndarray  # the step numbers, axis 1
    duration: np.ndarray  # [node, step, dp] recorded durations
    start: np.ndarray  # [node, step, dp] recorded starts (step-relative)
    work: np.ndarray  # [node, step, dp] duration (compute) or transfer time (communication)
    present: np.ndarray  # [node, step, dp] the op was recorded there
    dropped_rows: int  # rows the model has no node for (an op that only some steps have)


def _node_ids(table: pd.DataFrame, model: DepModel) -> np.ndarray:
    """Each row's node (-1: none), through a dense lookup on (stage, optype, seq)."""
    optypes = pd.Categorical(table["optype"])
    cats = {str(c): k for k, c in enumerate(optypes.categories)}
    n_seq = int(max(table["seq"].max(), model.nodes["seq"].max())) + 1
    n_pp = int(max(table["pp"].max(), model.nodes["pp"].max())) + 1
    lut = np.full(n_pp * len(cats) * n_seq, -1, dtype=np.int64)
    for i, (p, o, s) in enumerate(
        zip(model.nodes["pp"], model.nodes["optype"], model.nodes["seq"], strict=True)
    ):
        if str(o) in cats:
            lut[(int(p) * len(cats) + cats[str(o)]) * n_seq + int(s)] = i
    codes = np.asarray(optypes.codes, dtype=np.int64)
    key = (table["pp"].to_numpy(np.int64) * len(cats) + codes) * n_seq + table["seq"].to_numpy(np.int64)
    ids: np.ndarray = lut[key]
    return ids


def cube(table: pd.DataFrame, model: DepModel, dp: int) -> Cube:
    node = _node_ids(table, model)
    keep = node >= 0
    steps = np.unique(table["step"].to_numpy())
    n, s = model.size, len(steps)
    tp = int(table["tp"].max()) + 1
    step_ix = np.searchsorted(steps, table["step"].to_numpy()[keep])
    flat = ((node[keep] * s + step_ix) * dp + table["dp"].to_numpy(np.int64)[keep]) * tp + table[
        "tp"
    ].to_numpy(np.int64)[keep]
    dur = np.full(n * s * dp * tp, np.nan)
    dur[flat] = table["duration"].to_numpy(np.float64)[keep]
    st = np.full(n * s * dp * tp, np.nan)
    st[flat] = table["start"].to_numpy(np.float64)[keep]
    dur4 = dur.reshape(n, s, dp, tp)
    st4 = st.reshape(n, s, dp, tp)
    if tp == 1:
        duration, start = dur4[..., 0], st4[..., 0]
    else:  # a worker's op lasts from its first TP rank's start to its last one's end
        end = np.nanmax(st4 + dur4, axis=-1)
        start = np.nanmin(st4, axis=-1)
        duration = end - start
    present = ~np.isnan(duration)
    # an op missing somewhere: its node's median elsewhere, placed after the previous op
    med = np.nanmedian(np.where(present, duration, np.nan).reshape(n, -1), axis=1) if present.any() else None
    if med is not None and not present.all():
        med = np.nan_to_num(med)
        duration = np.where(present, duration, med[:, None, None])
        start = np.where(present, start, 0.0)
    work = transfer_times(model, start, duration)
    return Cube(steps, duration, start, work, present, int((~keep).sum()))


def transfer_times(model: DepModel, start: np.ndarray, duration: np.ndarray) -> np.ndarray:
    """Each op's work: the duration of a compute op; for a communication op, its end less the
    latest start among its group (clipped at zero); for the receive of a non-blocking send, its
    end less its own start or the send's end, whichever is later."""
    work: np.ndarray = duration.copy()
    end = start + duration
    for grp in model.groups:
        if not grp.comm:
            continue
        members = list(grp.members)
        latest = start[members].max(axis=0)
        if grp.dp_sync:
            latest = latest.max(axis=-1, keepdims=True)
        work[members] = np.clip(end[members] - latest, 0.0, None)
    for recv, send in model.after:
        work[recv] = np.clip(end[recv] - np.maximum(start[recv], end[send]), 0.0, None)
    return work


def ideal_work(table_optypes: pd.Series, cube_: Cube, median: bool = False) -> np.ndarray:
    """Every op at the typical work of its type: the mean for compute, the median for
    communication (a few long waits should not set a transfer's typical time); with median,
    the median for compute too."""
    ideal = np.empty_like(cube_.work)
    for optype in pd.unique(table_optypes):
        nodes = np.flatnonzero(table_optypes.to_numpy() == optype)
        values = cube_.work[nodes][cube_.present[nodes]]
        if values.size == 0:
            typical = 0.0
        elif median or is_comm(str(optype)):
            typical = float(np.median(values))
        else:
            typical = float(values.mean())
        ideal[nodes] = typical
    return ideal


@dataclass
class Replayed:
    start: np.ndarray | None  # [node, what-if, step, dp], when asked for
    end: np.ndarray | None
    step_time: np.ndarray  # [what-if, step]: last end of the step (every step starts at 0)


def replay(model: DepModel, work: np.ndarray, keep: bool = False) -> Replayed:
    """Run the model on `work` [node, what-if, step, dp]: each op starts when what it waits on
    has ended; a communication group ends at its latest member's start plus each member's own
    work (over every DP rank for a data-parallel collective)."""
    end = np.empty_like(work)
    start = np.empty_like(work) if keep else None
    zero = np.zeros(work.shape[1:], dtype=work.dtype)
    parents = model.parents

    def ready(i: int) -> np.ndarray:
        ps = parents[i]
        if not ps:
            return zero
        if len(ps) == 1:
            one: np.ndarray = end[ps[0]]
            return one
        out: np.ndarray = np.maximum(end[ps[0]], end[ps[1]])
        for p in ps[2:]:
            np.maximum(out, end[p], out=out)
        return out

    for g in model.order:
        grp = model.groups[g]
        if not grp.comm or len(grp.members) == 1 and not grp.dp_sync:
            i = grp.members[0]
            st = ready(i)
            np.add(st, work[i], out=end[i])
            if start is not None:
                start[i] = st
            continue
        starts = [ready(m) for m in grp.members]
        latest = starts[0] if len(starts) == 1 else np.maximum.reduce(starts)
        if grp.dp_sync:
            latest = latest.max(axis=-1, keepdims=True)
        for m, st in zip(grp.members, starts, strict=True):
            np.add(latest, work[m], out=end[m])
            if start is not None:
                start[m] = st
    step_time = end.max(axis=(0, -1)) if end.size else np.zeros(work.shape[1:-1])
    return Replayed(start=start, end=end if keep else None, step_time=step_time)


def replay_mixed(
    model: DepModel, base: np.ndarray, other: np.ndarray, masks: list[np.ndarray], budget: int = 1 << 24
) -> np.ndarray:
    """Mean step time of each what-if: `other`'s work where masks[k] is true, `base`'s elsewhere.
    Each mask broadcasts to [node, step, dp]; what-ifs run together in batches of `budget` cells."""
    n, s, p = base.shape
    per = max(1, budget // max(1, n * s * p))
    out = np.empty(len(masks))
    for lo in range(0, len(masks), per):
        chunk = masks[lo : lo + per]
        work = np.stack([np.where(np.broadcast_to(m, base.shape), other, base) for m in chunk], axis=1)
        out[lo : lo + len(chunk)] = replay(model, work).step_time.mean(axis=1)
    return out
