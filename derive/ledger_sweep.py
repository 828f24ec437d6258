"""The ledger's computation: every rank-step's wall time split into exclusive categories by one
priority sweep over the measured intervals (the rules: traindx.derive.ledger's docstring).

Pure and vectorised: one sort and a cumulative sum per category over every rank, O(n log n).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

Array = npt.NDArray[Any]
# {sweep category index: (starts, ends)}
Intervals = dict[int, tuple[Array, Array]]

# highest priority first; `unexplained` is what none of them covers
CATEGORIES = (
    "compile",
    "autotune",
    "gc",
    "traindx",
    "io",
    "sync",
    "collective",
    "data",
    "eval",
    "forward_backward",
    "optimizer",
    "gpu",
    "host",
)
# the sweep's own order: an optimizer step's closure is host time, and beats the optimizer line;
# the job's hooks inside forward and backward (the shim's `hook` spans) are host time too
_SWEEP = (
    "compile",
    "autotune",
    "gc",
    "traindx",
    "io",
    "sync",
    "collective",
    "data",
    "hook",
    "eval",
    "forward_backward",
    "closure",
    "optimizer",
    "gpu",
    "host",
)
COLUMNS = (
    ["rank", "step", "start_ns", "end_ns", "wall_s"] + [f"{c}_s" for c in CATEGORIES] + ["unexplained_s"]
)
LABELS = {
    "compile": "compile",
    "autotune": "autotune",
    "gc": "gc",
    "traindx": "traindx",
    "io": "checkpoint/io",
    "sync": "host sync",
    "collective": "collective",
    "data": "data",
    "optimizer": "optimizer",
    "forward_backward": "fwd/bwd",
    "eval": "eval/inference",
    "gpu": "waits for GPU",
    "host": "host",
    "unexplained": "unexplained",
}
# spans that count only on the thread(s) that drive the steps; compiles and GC pause every thread
TRAINING_THREAD_ONLY = (
    "data",
    "backward",
    "forward",
    "eval",
    "closure",
    "optimizer",
    "io",
    "sync",
    "collective",
    "traindx",
)
# the shim's span category -> the ledger's
SPAN_CATEGORY = {"backward": "forward_backward", "forward": "forward_backward"}
STARTUP_STEP = -1
LEDGER_CHUNK_RANKS = 128  # ranks swept together: bounds the sweep's memory on large jobs


def spans_table(events: pd.DataFrame) -> pd.DataFrame:
    """The shim's span events: rank, cat, start_ns, end_ns, tid; caller (the job's frame) and
    call (e.g. "torch.save") for the rare ones, None for the others."""
    cols = ["rank", "cat", "start_ns", "end_ns", "tid", "caller", "call"]
    if not len(events) or "type" not in events:
        return pd.DataFrame(columns=cols)
    df = events[events["type"] == "span"]
    if not len(df):
        return pd.DataFrame(columns=cols)

    def objects(col: str) -> pd.Series:  # plain object columns (pandas would make Arrow-backed str of them)
        return pd.Series(df[col].to_numpy(object) if col in df else np.full(len(df), None), dtype=object)

    out = pd.DataFrame(
        {
            "rank": objects("rank"),
            "cat": objects("cat"),
            "start_ns": df["start"].astype("int64").to_numpy(),
            "end_ns": df["t"].astype("int64").to_numpy(),
            "tid": df["tid"].to_numpy(),
            "caller": objects("caller"),
            "call": objects("call"),
        }
    )
    if "grad" in df:
        # a forward without grad (no_grad, inference_mode: an evaluation, a generate() loop) is
        # no part of the training step's forward and backward: the `eval` line
        no_grad = (out["cat"].to_numpy(object) == "forward") & (df["grad"].to_numpy(object) == False)  # noqa: E712
        out.loc[no_grad, "cat"] = "eval"
    if "via" in df:  # a rare call a framework made: the job's frame and the objects between
        out["via"] = objects("via")
    for col in ("cpu", "runq"):  # the calling thread's CPU and run-queue wait in a rare span
        if col in df:
            out[col] = pd.to_numeric(pd.Series(df[col].to_numpy(object)), errors="coerce")
    order = np.argsort(out["start_ns"].to_numpy(), kind="stable")
    return out.take(order).reset_index(drop=True)


def _sweep(
    win_start: Array, win_end: Array, intervals: Intervals, busy: tuple[Array, Array] | None = None
) -> Array:
    """ns per (window, category) with priority resolution; the last column is unexplained.
    win_*: sorted, non-overlapping windows; intervals: {category index: (starts, ends)};
    busy: (starts, ends) where the GPU still runs work queued before them (see _gpu_owned).

    One argsort of every boundary gives each boundary its index among the distinct points
    (no binary search per boundary: millions of random look-ups cost more than the sort)."""
    k = len(_SWEEP)
    out = np.zeros((len(win_start), k + 1), dtype=np.int64)
    if not len(win_start):
        return out
    lo, hi = int(win_start.min()), int(win_end.max())
    bounds = [win_start, win_end]
    cats = []
    busy_i = len(_SWEEP) + 1  # the busy intervals' place among the interval lists
    for c, (s, e) in [*intervals.items(), *([(busy_i, busy)] if busy is not None else [])]:
        s = np.clip(np.asarray(s, np.int64), lo, hi)
        e = np.clip(np.asarray(e, np.int64), lo, hi)
        keep = e > s
        if keep.any():
            cats.append(c)
            bounds += [s[keep], e[keep]]
    sizes = [len(b) for b in bounds]
    allb = np.concatenate(bounds)
    del bounds
    order = np.argsort(allb, kind="stable")
    sorted_b = allb[order]
    del allb
    new = np.r_[True, sorted_b[1:] != sorted_b[:-1]]
    points = sorted_b[new]
    if len(points) < 2:
        return out
    where = np.empty(len(order), np.int64)  # each boundary's index in points
    where[order] = np.cumsum(new) - 1
    del order, sorted_b, new
    offs = np.cumsum([0] + sizes)
    seg_len = np.diff(points)
    n = len(points)
    winner = np.full(n - 1, k, dtype=np.int64)
    pieces = {
        c: (where[offs[2 + 2 * i] : offs[3 + 2 * i]], where[offs[3 + 2 * i] : offs[4 + 2 * i]])
        for i, c in enumerate(cats)
    }

    def active(c: int) -> Array:
        si, ei = pieces[c]
        delta = np.bincount(si, minlength=n + 1) - np.bincount(ei, minlength=n + 1)
        on: Array = np.cumsum(delta)[:-2] > 0
        return on

    for c in sorted((c for c in pieces if c != busy_i), reverse=True):  # lowest first, higher overwrite
        winner[active(c)] = c
    if busy_i in pieces:
        winner[active(busy_i) & np.isin(winner, _GPU_OWNED)] = _SWEEP.index("gpu")
    # the window a segment starts in: the last window start at or before it
    ws_i, we_i = where[offs[0] : offs[1]], where[offs[1] : offs[2]]
    mark = np.full(n, -1, np.int64)
    mark[ws_i] = np.arange(len(ws_i))
    w = np.maximum.accumulate(mark)[:-1]
    end_at = np.full(len(ws_i), -1, np.int64)
    end_at[:] = we_i
    valid = (w >= 0) & (np.arange(n - 1) < end_at[np.maximum(w, 0)])
    # integer ns sums below 2**53 per cell: exact in bincount's float64
    cell = np.bincount(
        w[valid] * (k + 1) + winner[valid], weights=seg_len[valid], minlength=len(win_start) * (k + 1)
    )
    return np.rint(cell).astype(np.int64).reshape(len(win_start), k + 1)


SWEEP_CLOSURE, SWEEP_HOST = _SWEEP.index("closure"), _SWEEP.index("host")
# the lines whose time is the GPU's where the GPU still runs work queued before it: the host's
# own loop time and its sync waits (a blocking copy, an .item(), a synchronize) wait for that
# work to finish, or hide behind it; the step's time there is the GPU's. The measured calls
# (forward, backward, optimizer, data, ...) keep theirs: they are work the host does.
_GPU_OWNED = np.array([_SWEEP.index("sync"), SWEEP_HOST], np.int64)
SWEEP_HOOK = _SWEEP.index("hook")
_TO_PUBLIC = [i for i, c in enumerate(_SWEEP) if c not in ("closure", "hook")] + [len(_SWEEP)]


def _fold(ns: Array) -> Array:
    """The sweep's columns (_SWEEP + unexplained) as the ledger's (CATEGORIES + unexplained):
    a closure's own time and the job's hooks are host time."""
    ns = ns.copy()
    ns[:, SWEEP_HOST] += ns[:, SWEEP_CLOSURE] + ns[:, SWEEP_HOOK]
    return ns[:, _TO_PUBLIC]


def _training_pairs(cat: Array, tid: Array, rid: Array) -> pd.MultiIndex:
    """(rank id, tid) of each rank's training thread(s): the threads of its optimizer spans,
    else its backward spans, else its data spans."""
    prio = pd.Index(["optimizer", "backward", "data"]).get_indexer(cat)
    has = prio >= 0
    if not has.any():
        return pd.MultiIndex.from_arrays([[], []])
    first = pd.Series(prio[has]).groupby(rid[has]).transform("min").to_numpy()
    chosen = prio[has] == first
    return pd.MultiIndex.from_arrays([rid[has][chosen], tid[has][chosen]]).unique()


def _intervals(
    spans: tuple[Array, Array, Array, Array] | None,
    srid: Array,
    compiles: tuple[Array, Array, Array] | None,
    win_start: Array,
    win_end: Array,
    win_rid: Array,
    win_host: Array | None = None,
    residual: bool = False,
) -> Intervals:
    """{sweep category index: (starts, ends)} of every rank at once, on the ranks' shifted time
    axis (see compute): spans of the training thread(s) (compiles and GC pause every thread),
    compiles and autotunes, and `host`: the windows (win_host: which of them) of the ranks
    whose training thread the spans show - what no measured call covers there.
    spans: (cat, tid, start, end) arrays; compiles: (is autotune, start, end) arrays.
    residual: a run recorded before forward spans: the stretch before each backward is fwd/bwd."""
    index = {c: i for i, c in enumerate(_SWEEP)}
    parts = {}

    def add(cat: str, s: Array, e: Array) -> None:
        parts.setdefault(index[cat], []).append((np.asarray(s, np.int64), np.asarray(e, np.int64)))

    if spans is not None and len(spans[0]):
        cat, tid, s, e = spans
        train = _training_pairs(cat, tid, srid)
        mine = pd.MultiIndex.from_arrays([srid, tid]).isin(train)
        keep = mine | ~np.isin(cat, TRAINING_THREAD_ONLY)
        cat, s, e, r = cat[keep], s[keep], e[keep], srid[keep]
        codes, names = pd.factorize(cat)
        for code, name in enumerate(names):
            target = SPAN_CATEGORY.get(name, name)
            if target in index and target != "host":
                sel = codes == code
                add(target, s[sel], e[sel])
        # the ranks with a training thread: their windows' untimed rest is that thread's host time
        trained = np.unique(r[np.isin(cat, TRAINING_THREAD_ONLY)])
        if len(win_start):
            sel = np.isin(win_rid, trained)
            if win_host is not None:
                sel &= win_host
            add("host", win_start[sel], win_end[sel])
        bwd = cat == "backward"
        if residual and bwd.any():
            anchors = np.isin(cat, ["data", "backward", "optimizer", "io", "sync", "collective"])
            a_order = np.argsort(e[anchors], kind="stable")
            a_end, a_rid = e[anchors][a_order], r[anchors][a_order]
            fe, f_rid = s[bwd], r[bwd]
            i = np.searchsorted(a_end, fe, side="right") - 1
            ok = (i >= 0) & (a_rid[np.maximum(i, 0)] == f_rid)
            anchor = np.where(ok, a_end[np.maximum(i, 0)], np.iinfo(np.int64).min)
            # a forward never reaches back before the step (or start-up) its backward belongs to
            w = np.searchsorted(win_start, fe, side="right") - 1
            in_rank = (w >= 0) & (win_rid[np.maximum(w, 0)] == f_rid)
            floor = np.where(in_rank, win_start[np.maximum(w, 0)], fe)
            add("forward_backward", np.maximum(anchor, floor), fe)
    if compiles is not None and len(compiles[0]):
        tune, cs, ce = compiles
        add("autotune", cs[tune], ce[tune])
        add("compile", cs[~tune], ce[~tune])
    return {
        c: (np.concatenate([p[0] for p in ps]), np.concatenate([p[1] for p in ps])) for c, ps in parts.items()
    }


def split_windows(spans: pd.DataFrame, compiles: pd.DataFrame, win_start: Array, win_end: Array) -> Array:
    """ns per (window, category) of ONE rank's sorted, non-overlapping windows (not steps:
    e.g. the stretch before each arrival at a collective), with the step ledger's intervals and
    priorities; the last column is unexplained. spans/compiles: that rank's run.spans/compiles."""
    win_start = np.asarray(win_start, np.int64)
    win_end = np.asarray(win_end, np.int64)
    residual = not len(spans) or not spans["cat"].isin(("forward", "eval")).any()
    return _fold(_sweep(win_start, win_end, _rank_intervals(spans, compiles, win_start, win_end, residual)))


def _rank_intervals(
    spans: pd.DataFrame, compiles: pd.DataFrame, win_start: Array, win_end: Array, residual: bool
) -> Intervals:
    """_intervals of ONE rank's spans and compiles over its windows (each window of rank id 0)."""
    sp = cs = None
    srid = np.empty(0, np.int64)
    if len(spans):
        sp = (
            spans["cat"].to_numpy(object),
            spans["tid"].to_numpy(),
            spans["start_ns"].to_numpy(np.int64),
            spans["end_ns"].to_numpy(np.int64),
        )
        srid = np.zeros(len(spans), np.int64)
    if len(compiles):
        comp = compiles.dropna(subset=["start_ns", "end_ns"])
        if len(comp):
            cs = (
                comp["kind"].to_numpy(object) == "triton_autotune",
                comp["start_ns"].astype("int64").to_numpy(),
                comp["end_ns"].astype("int64").to_numpy(),
            )
    return _intervals(sp, srid, cs, win_start, win_end, np.zeros(len(win_start), np.int64), residual=residual)


def measured_forward(spans: pd.DataFrame, host_samples: pd.DataFrame | None = None) -> bool:
    """Whether the run's shim measured the forward (forward spans, or host samples: a job
    whose model is no nn.Module has none of the first); False: an older run, read the old way."""
    if len(spans) and np.isin(spans["cat"].to_numpy(object), ("forward", "eval")).any():
        return True
    return host_samples is not None and len(host_samples) > 0


def _process_starts(events: pd.DataFrame) -> dict[str, int]:
    if not len(events) or "type" not in events:
        return {}
    ps = events[events["type"] == "process_start"]
    return {str(r): int(t) for r, t in zip(ps["rank"], ps["t"])}


@dataclass(frozen=True)
class _Windows:
    """The windows to split, every rank's, sorted by (rank id, start): its steps, and the
    start-up (process start -> first step begin) of each rank whose process started before it."""

    rid: Array  # rank id: the index of the window's rank in the output's rank order
    start: Array
    end: Array
    step: Array  # STARTUP_STEP for a start-up window


def _windows(steps: pd.DataFrame, rank_index: pd.Index, process_starts: dict[str, int]) -> _Windows:
    rid = rank_index.get_indexer(steps["rank"].to_numpy(object)).astype(np.int64)
    ws = steps["start_ns"].to_numpy(np.int64)
    we = steps["end_ns"].to_numpy(np.int64)
    ids = steps["step"].to_numpy(np.int64)
    order = np.lexsort((ws, rid))
    rid, ws, we, ids = rid[order], ws[order], we[order], ids[order]
    first_pos = np.flatnonzero(np.r_[True, rid[1:] != rid[:-1]])
    # start-up: process start -> first step begin, where the process started before it
    first_start = np.array([process_starts.get(str(r), np.iinfo(np.int64).max) for r in rank_index], np.int64)
    has_startup = first_start[rid[first_pos]] < ws[first_pos]
    su_rid = rid[first_pos][has_startup]
    su_s, su_e = first_start[su_rid], ws[first_pos][has_startup]
    w_rid = np.concatenate([rid, su_rid])
    w_s, w_e = np.concatenate([ws, su_s]), np.concatenate([we, su_e])
    w_id = np.concatenate([ids, np.full(len(su_rid), STARTUP_STEP)])
    w_order = np.lexsort((w_s, w_rid))
    return _Windows(w_rid[w_order], w_s[w_order], w_e[w_order], w_id[w_order])


@dataclass(frozen=True)
class _Measured:
    """The spans and compiles of the ledger's ranks as arrays, each with its rank id."""

    span_cat: Array
    span_tid: Array
    span_start: Array
    span_end: Array
    span_rid: Array
    autotune: Array  # per compile: a Triton autotune (else a compile)
    comp_start: Array
    comp_end: Array
    comp_rid: Array

    @classmethod
    def of(cls, spans: pd.DataFrame, compiles: pd.DataFrame, rank_index: pd.Index) -> _Measured:
        spans, srid = _of_ranks(spans, rank_index)
        comp = compiles.dropna(subset=["start_ns", "end_ns"]) if len(compiles) else compiles
        comp, crid = _of_ranks(comp, rank_index)
        none = np.empty(0, np.int64)
        has_spans, has_comp = bool(len(spans)), bool(len(comp))
        return cls(
            span_cat=spans["cat"].to_numpy(object) if has_spans else np.empty(0, object),
            span_tid=spans["tid"].to_numpy() if has_spans else none,
            span_start=spans["start_ns"].to_numpy(np.int64) if has_spans else none,
            span_end=spans["end_ns"].to_numpy(np.int64) if has_spans else none,
            span_rid=srid,
            autotune=comp["kind"].to_numpy(object) == "triton_autotune" if has_comp else np.empty(0, bool),
            comp_start=comp["start_ns"].astype("int64").to_numpy() if has_comp else none,
            comp_end=comp["end_ns"].astype("int64").to_numpy() if has_comp else none,
            comp_rid=crid,
        )

    def time_range(self, w: _Windows) -> tuple[int, int]:
        """(base, width): the earliest time of the windows, spans and compiles, and the span
        of time they cover (+1 ns): one rank's block on the shared axis."""
        low, high = int(w.start.min()), int(w.end.max())
        for times in (self.span_start, self.span_end, self.comp_start, self.comp_end):
            if len(times):
                low, high = min(low, int(times.min())), max(high, int(times.max()))
        return low, high - low + 1


def _of_ranks(df: pd.DataFrame, rank_index: pd.Index) -> tuple[pd.DataFrame, Array]:
    """The rows of `df` whose rank is one of the ledger's, and their rank ids."""
    if not len(df):
        return df, np.empty(0, np.int64)
    r = rank_index.get_indexer(df["rank"].to_numpy(object))
    return df[r >= 0], r[r >= 0].astype(np.int64)


@dataclass(frozen=True)
class _Axis:
    """One chunk of ranks on the shared axis: t -> (t - base) + (rank id - first) * width."""

    base: int
    width: int
    first: int

    def shift(self, t: Array, rid: Array) -> Array:
        shifted: Array = (np.asarray(t, np.int64) - self.base) + (rid - self.first) * self.width
        return shifted


def _chunk_ns(
    w: _Windows, m: _Measured, axis: _Axis, end: int, residual: bool, busy: tuple[Array, Array, Array] | None
) -> tuple[Array, Array]:
    """(which windows, their ns per category) of the ranks axis.first <= rank id < end."""
    lo = axis.first
    wsel = (w.rid >= lo) & (w.rid < end)
    ssel = (m.span_rid >= lo) & (m.span_rid < end)
    csel = (m.comp_rid >= lo) & (m.comp_rid < end)
    compiles = (
        m.autotune[csel],
        axis.shift(m.comp_start[csel], m.comp_rid[csel]),
        axis.shift(m.comp_end[csel], m.comp_rid[csel]),
    )
    spans = (
        m.span_cat[ssel],
        m.span_tid[ssel],
        axis.shift(m.span_start[ssel], m.span_rid[ssel]),
        axis.shift(m.span_end[ssel], m.span_rid[ssel]),
    )
    win_s, win_e = axis.shift(w.start[wsel], w.rid[wsel]), axis.shift(w.end[wsel], w.rid[wsel])
    w_host = w.step[wsel] != STARTUP_STEP
    intervals = _intervals(
        spans, m.span_rid[ssel], compiles, win_s, win_e, w.rid[wsel], w_host, residual=residual
    )
    owned = None
    if busy is not None:
        bsel = (busy[0] >= lo) & (busy[0] < end)
        owned = (axis.shift(busy[1][bsel], busy[0][bsel]), axis.shift(busy[2][bsel], busy[0][bsel]))
    return wsel, _fold(_sweep(win_s, win_e, intervals, owned))


def _tables(ns: Array, w: _Windows, ranks: Array) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(ledger, start-up ledger) of the windows' ns per category, COLUMNS."""
    table = pd.DataFrame(ns / 1e9, columns=[f"{c}_s" for c in CATEGORIES] + ["unexplained_s"])
    table.insert(0, "wall_s", (w.end - w.start) / 1e9)
    table.insert(0, "end_ns", w.end)
    table.insert(0, "start_ns", w.start)
    table.insert(0, "step", w.step)
    table.insert(0, "rank", pd.Series(np.asarray(ranks, dtype=object)[w.rid], dtype=object))
    is_startup = w.step == STARTUP_STEP
    first_of_rank = np.r_[True, w.rid[1:] != w.rid[:-1]]
    startup_rows = is_startup & first_of_rank
    ledger = table[~startup_rows].reset_index(drop=True)
    startup = table[startup_rows].reset_index(drop=True)
    return ledger[COLUMNS], startup[COLUMNS]


def compute(
    steps: pd.DataFrame,
    spans: pd.DataFrame,
    compiles: pd.DataFrame,
    events: pd.DataFrame,
    forward_measured: bool | None = None,
    cpu: pd.DataFrame | None = None,
    gpu_busy: pd.DataFrame | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(ledger of the steps, start-up ledger): one row per rank-step / per rank, COLUMNS.
    gpu_busy (rank, start_ns, end_ns): where each rank's GPU still ran work queued before
    (traindx.profiler.gputime.busy_before); the host and sync lines there are the `gpu` line.

    Every rank at once: each rank's times move to a block of their own on one axis (rank id x
    the run's time span), so one sort and sweep serves all ranks and no interval can reach
    another rank's windows; the split is the per-rank one, exactly. forward_measured: see
    measured_forward (None: from the spans alone). cpu: the shim's `cpu` events (its own time
    per step: _own_wrappers)."""
    steps = steps.dropna(subset=["start_ns", "end_ns"])
    empty = pd.DataFrame(columns=COLUMNS)
    if not len(steps):
        return empty, empty.copy()
    ranks = pd.unique(steps["rank"])  # the order of the output's ranks
    rank_index = pd.Index(ranks)
    w = _windows(steps, rank_index, _process_starts(events))
    measured = _Measured.of(spans, compiles, rank_index)
    base, width = measured.time_range(w)
    # ranks whose blocks fit in int64, and few enough that the sweep's arrays stay small
    per_chunk = max(1, min((1 << 62) // width, LEDGER_CHUNK_RANKS))
    ns = np.zeros((len(w.start), len(CATEGORIES) + 1), np.int64)
    if forward_measured is None:  # from the spans of the ledger's ranks
        forward_measured = bool(np.isin(measured.span_cat, ("forward", "eval")).any())
    residual = not forward_measured
    busy = _busy_of(gpu_busy, rank_index, base, base + width)
    for lo in range(0, len(ranks), per_chunk):
        wsel, chunk = _chunk_ns(w, measured, _Axis(base, width, lo), lo + per_chunk, residual, busy)
        ns[wsel] = chunk
    ledger, startup = _tables(ns, w, ranks)
    return _own_wrappers(ledger, cpu), startup


def _own_wrappers(ledger: pd.DataFrame, cpu: pd.DataFrame | None) -> pd.DataFrame:
    """The shim's wrappers' own time in each step (its `cpu` event: shim_ns less the step end's
    work, which is a `traindx` span already) moves from the host line to traindx's: it ran
    between the job's measured calls, where the host line would book it as the job's."""
    if cpu is None or not len(ledger) or not len(cpu) or "shim_ns" not in cpu:
        return ledger
    cpu = cpu[cpu["shim_ns"].notna()]
    if not len(cpu):
        return ledger
    end = pd.to_numeric(cpu["shim_end_ns"], errors="coerce").fillna(0) if "shim_end_ns" in cpu else 0
    wrap = (pd.to_numeric(cpu["shim_ns"], errors="coerce").fillna(0) - end).clip(lower=0) / 1e9
    key = pd.MultiIndex.from_arrays([cpu["rank"].astype(str), cpu["step"].astype("int64")])
    per = pd.Series(wrap.to_numpy(float), index=key).groupby(level=[0, 1]).sum()
    rows = pd.MultiIndex.from_arrays([ledger["rank"].astype(str), ledger["step"].astype("int64")])
    moved = np.minimum(per.reindex(rows).fillna(0.0).to_numpy(float), ledger["host_s"].to_numpy(float))
    if not moved.any():
        return ledger
    out = ledger.copy()
    out["host_s"] = out["host_s"] - moved
    out["traindx_s"] = out["traindx_s"] + moved
    return out


def _busy_of(
    gpu_busy: pd.DataFrame | None, rank_index: pd.Index, low: int, high: int
) -> tuple[Array, Array, Array] | None:
    """(rank id, start, end) of the GPU-busy intervals of the ledger's ranks, clipped to the
    time the ledger covers; None without any."""
    if gpu_busy is None or not len(gpu_busy):
        return None
    df, rid = _of_ranks(gpu_busy, rank_index)
    s = np.clip(df["start_ns"].to_numpy(np.int64), low, high - 1)
    e = np.clip(df["end_ns"].to_numpy(np.int64), low, high - 1)
    keep = e > s
    return (rid[keep], s[keep], e[keep]) if keep.any() else None


def _covered(times: Array, starts: Array, ends: Array) -> Array:
    """Whether each of the sorted `times` lies in the union of the intervals [starts, ends)."""
    if not len(starts):
        return np.zeros(len(times), bool)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], np.maximum.accumulate(ends[order])
    i = np.searchsorted(s, times, side="right") - 1
    return (i >= 0) & (times < e[np.maximum(i, 0)])


def categories_at(
    spans: pd.DataFrame,
    compiles: pd.DataFrame,
    win_start: Array,
    win_end: Array,
    times: Array,
    residual: bool = False,
    busy: tuple[Array, Array] | None = None,
) -> Array:
    """The sweep category (_SWEEP index; len(_SWEEP): unexplained) that wins at each sorted time
    of ONE rank, with the ledger's intervals and priorities (busy: that rank's GPU-busy
    (starts, ends), as compute's gpu_busy)."""
    intervals = _rank_intervals(spans, compiles, win_start, win_end, residual)
    out = np.full(len(times), len(_SWEEP), np.int64)
    open_ = np.ones(len(times), bool)
    for c in sorted(intervals):  # highest priority first
        s, e = intervals[c]
        hit = open_ & _covered(times, np.asarray(s, np.int64), np.asarray(e, np.int64))
        out[hit] = c
        open_ &= ~hit
    if busy is not None and len(busy[0]):
        gpu = _covered(times, np.asarray(busy[0], np.int64), np.asarray(busy[1], np.int64))
        out[gpu & np.isin(out, _GPU_OWNED)] = _SWEEP.index("gpu")
    return out
