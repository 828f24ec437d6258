"""The time ledger: every rank-step's wall time split into exclusive, measured categories.

Inputs (all on the shim's time.time_ns() axis): the steps, the shim's `span` events (the
outermost nn.Module call of the training thread, DataLoader __next__, backward, optimizer step,
the closure an optimizer step runs, torch.save/DCP saves, CUDA syncs, blocking collectives, long
GC pauses), and the compile/autotune events. Where intervals overlap, one category wins by
PRIORITY (a compile on the autograd thread while the training thread sits in backward counts as
compile; a GC inside a data wait counts once, as GC; a forward and backward inside an optimizer
step's closure - Lightning's training_step - count as fwd/bwd, not optimizer).

`forward_backward` (fwd/bwd) is the measured forward (outermost module calls) plus backward and
nothing else. `host` is the training thread's time between its measured calls (and the parts
of an optimizer step's closure outside forward and backward): the job's own loop code,
`host_code(run)` splits it by the code that ran there. `unexplained` is what no interval covers:
a rank whose training thread the spans never show (no span at all). Each row sums to its wall
time exactly (integer nanoseconds).

Runs recorded before forward spans existed (no `forward` span and no `host_samples` event in the
whole run) keep the old reading: the stretch before each backward is booked as fwd/bwd.

Start-up - from the shim's `process_start` to the first step's begin - is split the same way,
without a host line; there, `unexplained` is imports, model build and data set-up.

Pure and vectorised: one sort and a cumulative sum per category over every rank, O(n log n).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.derive.steady import steady_steps

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

# highest priority first; `unexplained` is what none of them covers
CATEGORIES = (
    "compile",
    "autotune",
    "gc",
    "io",
    "sync",
    "collective",
    "data",
    "forward_backward",
    "optimizer",
    "host",
)
# the sweep's own order: an optimizer step's closure is host time, and beats the optimizer line
_SWEEP = (
    "compile",
    "autotune",
    "gc",
    "io",
    "sync",
    "collective",
    "data",
    "forward_backward",
    "closure",
    "optimizer",
    "host",
)
COLUMNS = (
    ["rank", "step", "start_ns", "end_ns", "wall_s"] + [f"{c}_s" for c in CATEGORIES] + ["unexplained_s"]
)
LABELS = {
    "compile": "compile",
    "autotune": "autotune",
    "gc": "gc",
    "io": "checkpoint/io",
    "sync": "host sync",
    "collective": "collective",
    "data": "data",
    "optimizer": "optimizer",
    "forward_backward": "fwd/bwd",
    "host": "host",
    "unexplained": "unexplained",
}
# spans that count only on the thread(s) that drive the steps; compiles and GC pause every thread
TRAINING_THREAD_ONLY = ("data", "backward", "forward", "closure", "optimizer", "io", "sync", "collective")
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

    def objects(col):  # plain object columns (pandas would make Arrow-backed str of them)
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
    for col in ("cpu", "runq"):  # the calling thread's CPU and run-queue wait in a rare span
        if col in df:
            out[col] = pd.to_numeric(pd.Series(df[col].to_numpy(object)), errors="coerce")
    order = np.argsort(out["start_ns"].to_numpy(), kind="stable")
    return out.take(order).reset_index(drop=True)


def has_spans(run: RunRecord) -> bool:
    """True when the run carries the shim's spans (older runs and `attach` do not)."""
    return len(run.spans) > 0


def _sweep(win_start, win_end, intervals):
    """ns per (window, category) with priority resolution; the last column is unexplained.
    win_*: sorted, non-overlapping windows; intervals: {category index: (starts, ends)}.

    One argsort of every boundary gives each boundary its index among the distinct points
    (no binary search per boundary: millions of random look-ups cost more than the sort)."""
    k = len(_SWEEP)
    out = np.zeros((len(win_start), k + 1), dtype=np.int64)
    if not len(win_start):
        return out
    lo, hi = int(win_start.min()), int(win_end.max())
    bounds = [win_start, win_end]
    cats = []
    for c, (s, e) in intervals.items():
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
    for c in sorted(pieces, reverse=True):  # lowest priority first, higher overwrite
        si, ei = pieces[c]
        delta = np.bincount(si, minlength=n + 1) - np.bincount(ei, minlength=n + 1)
        active = np.cumsum(delta)[:-2] > 0
        winner[active] = c
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


_CLOSURE, _HOST = _SWEEP.index("closure"), _SWEEP.index("host")
_TO_PUBLIC = [i for i, c in enumerate(_SWEEP) if c != "closure"] + [len(_SWEEP)]


def _fold(ns):
    """The sweep's columns (_SWEEP + unexplained) as the ledger's (CATEGORIES + unexplained):
    a closure's own time is host time."""
    ns = ns.copy()
    ns[:, _HOST] += ns[:, _CLOSURE]
    return ns[:, _TO_PUBLIC]


def _training_pairs(cat, tid, rid):
    """(rank id, tid) of each rank's training thread(s): the threads of its optimizer spans,
    else its backward spans, else its data spans."""
    prio = pd.Index(["optimizer", "backward", "data"]).get_indexer(cat)
    has = prio >= 0
    if not has.any():
        return pd.MultiIndex.from_arrays([[], []])
    first = pd.Series(prio[has]).groupby(rid[has]).transform("min").to_numpy()
    chosen = prio[has] == first
    return pd.MultiIndex.from_arrays([rid[has][chosen], tid[has][chosen]]).unique()


def _intervals(spans, srid, compiles, win_start, win_end, win_rid, win_host=None, residual=False):
    """{sweep category index: (starts, ends)} of every rank at once, on the ranks' shifted time
    axis (see compute): spans of the training thread(s) (compiles and GC pause every thread),
    compiles and autotunes, and `host`: the windows (win_host: which of them) of the ranks
    whose training thread the spans show - what no measured call covers there.
    spans: (cat, tid, start, end) arrays; compiles: (is autotune, start, end) arrays.
    residual: a run recorded before forward spans: the stretch before each backward is fwd/bwd."""
    index = {c: i for i, c in enumerate(_SWEEP)}
    parts = {}

    def add(cat, s, e):
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


def split_windows(
    spans: pd.DataFrame, compiles: pd.DataFrame, win_start: np.ndarray, win_end: np.ndarray
) -> np.ndarray:
    """ns per (window, category) of ONE rank's sorted, non-overlapping windows (not steps:
    e.g. the stretch before each arrival at a collective), with the step ledger's intervals and
    priorities; the last column is unexplained. spans/compiles: that rank's run.spans/compiles."""
    win_start = np.asarray(win_start, np.int64)
    win_end = np.asarray(win_end, np.int64)
    residual = not len(spans) or not (spans["cat"] == "forward").any()
    return _fold(_sweep(win_start, win_end, _rank_intervals(spans, compiles, win_start, win_end, residual)))


def _rank_intervals(spans, compiles, win_start, win_end, residual):
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


def measured_forward(spans, host_samples=None):
    """Whether the run's shim measured the forward (forward spans, or host samples: a job
    whose model is no nn.Module has none of the first); False: an older run, read the old way."""
    if len(spans) and (spans["cat"].to_numpy(object) == "forward").any():
        return True
    return host_samples is not None and len(host_samples) > 0


def _process_starts(events):
    if not len(events) or "type" not in events:
        return {}
    ps = events[events["type"] == "process_start"]
    return {str(r): int(t) for r, t in zip(ps["rank"], ps["t"])}


def compute(
    steps: pd.DataFrame,
    spans: pd.DataFrame,
    compiles: pd.DataFrame,
    events: pd.DataFrame,
    forward_measured: bool | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(ledger of the steps, start-up ledger): one row per rank-step / per rank, COLUMNS.

    Every rank at once: each rank's times move to a block of their own on one axis (rank id x
    the run's time span), so one sort and sweep serves all ranks and no interval can reach
    another rank's windows; the split is the per-rank one, exactly. forward_measured: see
    measured_forward (None: from the spans alone)."""
    steps = steps.dropna(subset=["start_ns", "end_ns"])
    empty = pd.DataFrame(columns=COLUMNS)
    if not len(steps):
        return empty, empty.copy()
    starts = _process_starts(events)
    ranks = pd.unique(steps["rank"])  # the order of the output's ranks
    rank_index = pd.Index(ranks)
    rid = rank_index.get_indexer(steps["rank"].to_numpy(object)).astype(np.int64)
    ws = steps["start_ns"].to_numpy(np.int64)
    we = steps["end_ns"].to_numpy(np.int64)
    ids = steps["step"].to_numpy(np.int64)
    order = np.lexsort((ws, rid))
    rid, ws, we, ids = rid[order], ws[order], we[order], ids[order]
    first_pos = np.flatnonzero(np.r_[True, rid[1:] != rid[:-1]])
    # start-up: process start -> first step begin, where the process started before it
    first_start = np.array([starts.get(str(r), np.iinfo(np.int64).max) for r in ranks], np.int64)
    has_startup = first_start[rid[first_pos]] < ws[first_pos]
    su_rid = rid[first_pos][has_startup]
    su_s, su_e = first_start[su_rid], ws[first_pos][has_startup]
    w_rid = np.concatenate([rid, su_rid])
    w_s, w_e = np.concatenate([ws, su_s]), np.concatenate([we, su_e])
    w_id = np.concatenate([ids, np.full(len(su_rid), STARTUP_STEP)])
    w_order = np.lexsort((w_s, w_rid))
    w_rid, w_s, w_e, w_id = w_rid[w_order], w_s[w_order], w_e[w_order], w_id[w_order]

    def of_ranks(df):
        if not len(df):
            return df, np.empty(0, np.int64)
        r = rank_index.get_indexer(df["rank"].to_numpy(object))
        return df[r >= 0], r[r >= 0].astype(np.int64)

    spans, srid = of_ranks(spans)
    comp = compiles.dropna(subset=["start_ns", "end_ns"]) if len(compiles) else compiles
    comp, crid = of_ranks(comp)
    # one axis for all ranks: t -> (t - base) + rank id * span
    lows = (
        [w_s.min()]
        + (
            [spans["start_ns"].astype("int64").min(), spans["end_ns"].astype("int64").min()]
            if len(spans)
            else []
        )
        + (
            [comp["start_ns"].astype("int64").min(), comp["end_ns"].astype("int64").min()]
            if len(comp)
            else []
        )
    )
    highs = (
        [w_e.max()]
        + (
            [spans["start_ns"].astype("int64").max(), spans["end_ns"].astype("int64").max()]
            if len(spans)
            else []
        )
        + (
            [comp["start_ns"].astype("int64").max(), comp["end_ns"].astype("int64").max()]
            if len(comp)
            else []
        )
    )
    base, width = int(min(lows)), int(max(highs)) - int(min(lows)) + 1
    # ranks whose blocks fit in int64, and few enough that the sweep's arrays stay small
    per_chunk = max(1, min((1 << 62) // width, LEDGER_CHUNK_RANKS))
    span_cat = spans["cat"].to_numpy(object) if len(spans) else None
    span_tid = spans["tid"].to_numpy() if len(spans) else None
    ns = np.zeros((len(w_s), len(CATEGORIES) + 1), np.int64)
    residual = not (measured_forward(spans) if forward_measured is None else forward_measured)
    w_host = w_id != STARTUP_STEP
    for lo in range(0, len(ranks), per_chunk):
        hi = lo + per_chunk
        wsel = (w_rid >= lo) & (w_rid < hi)
        ssel = (srid >= lo) & (srid < hi)
        csel = (crid >= lo) & (crid < hi)

        def shift(t, r):
            return (np.asarray(t, np.int64) - base) + (r - lo) * width  # noqa: B023 (used in this iteration)

        cs = sp = None
        if len(comp):
            cs = (
                comp["kind"].to_numpy(object)[csel] == "triton_autotune",
                shift(comp["start_ns"].astype("int64").to_numpy()[csel], crid[csel]),
                shift(comp["end_ns"].astype("int64").to_numpy()[csel], crid[csel]),
            )
        if len(spans):
            sp = (
                span_cat[ssel],
                span_tid[ssel],  # type: ignore[index]
                shift(spans["start_ns"].to_numpy(np.int64)[ssel], srid[ssel]),
                shift(spans["end_ns"].to_numpy(np.int64)[ssel], srid[ssel]),
            )
        win_s, win_e = shift(w_s[wsel], w_rid[wsel]), shift(w_e[wsel], w_rid[wsel])
        intervals = _intervals(sp, srid[ssel], cs, win_s, win_e, w_rid[wsel], w_host[wsel], residual=residual)
        ns[wsel] = _fold(_sweep(win_s, win_e, intervals))
    table = pd.DataFrame(ns / 1e9, columns=[f"{c}_s" for c in CATEGORIES] + ["unexplained_s"])
    table.insert(0, "wall_s", (w_e - w_s) / 1e9)
    table.insert(0, "end_ns", w_e)
    table.insert(0, "start_ns", w_s)
    table.insert(0, "step", w_id)
    table.insert(0, "rank", pd.Series(np.asarray(ranks, dtype=object)[w_rid], dtype=object))
    is_startup = w_id == STARTUP_STEP
    first_of_rank = np.r_[True, w_rid[1:] != w_rid[:-1]]
    startup_rows = is_startup & first_of_rank
    ledger = table[~startup_rows].reset_index(drop=True)
    startup = table[startup_rows].reset_index(drop=True)
    return ledger[COLUMNS], startup[COLUMNS]


# -- what ran inside the host line --------------------------------------------------------------
HOST_CODE_COLUMNS = ["rank", "step", "function", "file", "line", "call", "seconds", "samples", "runq_s"]


def host_samples(run):
    """The shim's samples of the training thread (hostsample.py), one row each: rank, pid, tid,
    t_ns, function, file, line, call, runq_frac (the share of the time since the thread's
    previous sample that it spent runnable but waiting for a core; NaN where the shim could not
    read the kernel's run-queue delay, or for a thread's first sample)."""
    cols = ["rank", "pid", "tid", "t_ns", "function", "file", "line", "call", "runq_frac"]
    ev = run.of_type("host_samples")
    frames = run.of_type("host_frame")
    if not len(ev) or not len(frames) or "dt_us" not in ev:
        return pd.DataFrame(columns=cols)
    lens = np.array([len(v) if isinstance(v, list) else 0 for v in ev["dt_us"]], np.int64)
    ok = lens == np.array([len(v) if isinstance(v, list) else -1 for v in ev["k"]], np.int64)
    ev, lens = ev[ok], lens[ok]
    if not lens.sum():
        return pd.DataFrame(columns=cols)
    rep = np.repeat(np.arange(len(ev)), lens)
    pid = ev["pid"].to_numpy(object) if "pid" in ev else np.full(len(ev), None, object)
    out = pd.DataFrame(
        {
            "rank": pd.Series(ev["rank"].to_numpy(object)[rep], dtype=object),
            "pid": pd.Series(pid[rep], dtype=object),
            "tid": ev["tid"].to_numpy(object)[rep],
            "t_ns": ev["t0"].astype("int64").to_numpy()[rep]
            + np.concatenate([np.asarray(v, np.int64) for v in ev["dt_us"]]) * 1000,
            "k": np.concatenate([np.asarray(v, np.int64) for v in ev["k"]]),
            "runq_ns": _runq_ns(ev, lens),
        }
    )
    fpid = frames["pid"].to_numpy(object) if "pid" in frames else np.full(len(frames), None, object)
    keys = pd.DataFrame(
        {
            "rank": frames["rank"].to_numpy(object),
            "pid": fpid,
            "k": frames["id"].astype("int64").to_numpy(),
            "function": frames["function"].to_numpy(object),
            "file": frames["file"].to_numpy(object),
            "line": frames["line"].to_numpy(object),
            "call": frames["call"].to_numpy(object) if "call" in frames else None,
        }
    )
    keys = keys.drop_duplicates(["rank", "pid", "k"], keep="last")
    out["_pid"], keys["_pid"] = out["pid"].astype(str), keys["pid"].astype(str)
    merged = out.merge(keys.drop(columns=["pid"]), on=["rank", "_pid", "k"], how="inner")
    merged = merged.sort_values(["rank", "_pid", "tid", "t_ns"], kind="stable")
    # the run-queue wait between a thread's consecutive samples over the wall time between them
    same = merged[["rank", "_pid", "tid"]].astype(str).agg("|".join, axis=1)
    first = (same != same.shift()).to_numpy()
    dwait = merged["runq_ns"].diff().to_numpy(float)
    dt = merged["t_ns"].diff().to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        frac = np.where(first | (dt <= 0), np.nan, np.clip(dwait / dt, 0.0, 1.0))
    merged["runq_frac"] = frac
    return merged.sort_values(["rank", "t_ns"], kind="stable").reset_index(drop=True)[cols]


def _runq_ns(ev, lens):
    """Each sample's cumulative run-queue wait (ns) of its thread, NaN where the event has none."""
    if "runq_us" not in ev:
        return np.full(int(lens.sum()), np.nan)
    parts = []
    for v, n in zip(ev["runq_us"], lens):
        ok = isinstance(v, list) and len(v) == n
        parts.append(np.asarray(v, float) * 1000 if ok else np.full(n, np.nan))
    return np.concatenate(parts)


def _covered(times, starts, ends):
    """Whether each of the sorted `times` lies in the union of the intervals [starts, ends)."""
    if not len(starts):
        return np.zeros(len(times), bool)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], np.maximum.accumulate(ends[order])
    i = np.searchsorted(s, times, side="right") - 1
    return (i >= 0) & (times < e[np.maximum(i, 0)])


def host_code(run):
    """What code ran inside the `host` line, per rank-step (HOST_CODE_COLUMNS): the shim's samples
    of the training thread that fall where the ledger books host time, grouped by the job's
    function and file:line and the call the stack ended in; `seconds` splits the step's host_s
    by the samples' shares (the ledger's exact total, the samples' split) and `samples` counts
    them; `runq_s` is the part
    of those seconds the thread spent waiting for a core (the samples' run-queue shares; NaN
    where the record has none): on a loaded machine a time slice that ends inside a line
    leaves the thread at that line while other tasks run. Steps whose host time no sample saw
    have no rows."""

    def build():
        samples = host_samples(run)
        led = run.ledger
        if not len(samples) or not len(led) or not (led["host_s"] > 0).any():
            return pd.DataFrame(columns=HOST_CODE_COLUMNS)
        kept = []
        forward = not _legacy(run)
        for rank, mine in samples.groupby("rank", sort=False):
            rows_ = run.rank_rows("ledger", rank).sort_values("start_ns")
            if not len(rows_):
                continue
            spans = run.rank_rows("spans", rank)
            comp = run.rank_rows("compiles", rank) if len(run.compiles) else run.compiles
            ws = rows_["start_ns"].to_numpy(np.int64)
            we = rows_["end_ns"].to_numpy(np.int64)
            t = mine["t_ns"].to_numpy(np.int64)
            w = np.searchsorted(ws, t, side="right") - 1
            inside = (w >= 0) & (t < we[np.maximum(w, 0)])
            mine, t, w = mine[inside], t[inside], w[inside]
            if not len(mine):
                continue
            cat = _categories_at(spans, comp, ws, we, t, residual=not forward)
            host = (cat == _HOST) | (cat == _CLOSURE)
            kept.append(
                mine[host].assign(
                    step=rows_["step"].to_numpy(np.int64)[w[host]],
                    host_s=rows_["host_s"].to_numpy(float)[w[host]],
                )
            )
        if not kept:
            return pd.DataFrame(columns=HOST_CODE_COLUMNS)
        df = pd.concat(kept, ignore_index=True)
        for col in ("function", "file", "call"):
            df[col] = df[col].astype(object).where(df[col].notna(), "")
        keys = ["rank", "step", "function", "file", "line", "call"]
        # a thread's first sample has no interval before it: its rank's mean share
        df["runq_frac"] = df["runq_frac"].fillna(df.groupby("rank")["runq_frac"].transform("mean"))
        g = df.groupby(keys, sort=False, dropna=False).agg(
            n=("t_ns", "size"), host_s=("host_s", "first"), runq=("runq_frac", "sum")
        )
        g = g.reset_index()
        if df["runq_frac"].isna().all():  # recorded without the run-queue delay
            g["runq"] = np.nan
        total = g.groupby(["rank", "step"])["n"].transform("sum")
        g["seconds"] = g["host_s"] * g["n"] / total
        g["samples"] = g["n"].astype("int64")
        g["runq_s"] = g["host_s"] * g["runq"] / total
        g["call"] = g["call"].where(g["call"] != "", None)
        g = g.sort_values(["rank", "step", "seconds"], ascending=[True, True, False], kind="stable")
        return g.reset_index(drop=True)[HOST_CODE_COLUMNS]

    return run.cached("host_code", build).copy(deep=False)


def _legacy(run):
    return not measured_forward(run.spans, run.of_type("host_samples"))


def _categories_at(spans, compiles, win_start, win_end, times, residual=False):
    """The sweep category (_SWEEP index; len(_SWEEP): unexplained) that wins at each sorted time
    of ONE rank, with the ledger's intervals and priorities."""
    intervals = _rank_intervals(spans, compiles, win_start, win_end, residual)
    out = np.full(len(times), len(_SWEEP), np.int64)
    open_ = np.ones(len(times), bool)
    for c in sorted(intervals):  # highest priority first
        s, e = intervals[c]
        hit = open_ & _covered(times, np.asarray(s, np.int64), np.asarray(e, np.int64))
        out[hit] = c
        open_ &= ~hit
    return out


# -- reading the ledger ----------------------------------------------------------------------------
def rows(run: RunRecord, rank: str | None = None, steps: Iterable[int] | None = None) -> pd.DataFrame:
    led = run.ledger if rank is None else run.rank_rows("ledger", rank)
    if steps is not None:
        led = led[led["step"].isin({int(s) for s in steps})]
    return led


def share(
    run: RunRecord, categories: Iterable[str], rank: str | None = None, steps: Iterable[int] | None = None
) -> tuple[float, float]:
    """(share of wall time, seconds per step) of the categories over the given rank-steps."""
    led = rows(run, rank, steps)
    if not len(led):
        return 0.0, 0.0
    secs = float(led[[f"{c}_s" for c in categories]].to_numpy().sum())
    wall = float(led["wall_s"].sum())
    return (secs / wall if wall else 0.0), secs / len(led)


def breakdown(led: pd.DataFrame) -> dict[str, float]:
    """{category: mean seconds per row} of a ledger slice, unexplained last; zero lines left out."""
    if not len(led):
        return {}
    out = {}
    for c in CATEGORIES + ("unexplained",):
        v = float(led[f"{c}_s"].mean())
        if v > 0:
            out[c] = v
    return out


def breakdown_text(led: pd.DataFrame, limit: int = 6) -> str | None:
    """'step 1.23 s = data 0.85 · fwd/bwd 0.30 · gc 0.02 · unexplained 0.06' (means per step)."""
    if not len(led):
        return None
    parts = breakdown(led)
    wall = float(led["wall_s"].mean())
    shown = sorted(((c, v) for c, v in parts.items() if c != "unexplained"), key=lambda kv: -kv[1])
    head, rest = shown[:limit], shown[limit:]
    items = [f"{LABELS[c]} {_num(v)}" for c, v in head]
    if rest:
        items.append(f"other {_num(sum(v for _, v in rest))}")
    items.append(f"unexplained {_num(parts.get('unexplained', 0.0))}")
    return f"step {_num(wall)} s = " + " · ".join(items)


def startup_text(row: Mapping[str, Any]) -> str:
    """'start-up 7.43 s = gc 1.58 · imports, model build, data set-up 5.85' for one start-up row."""
    parts = [(c, float(row[f"{c}_s"])) for c in CATEGORIES if float(row[f"{c}_s"]) > 0]
    items = [f"{LABELS[c]} {_num(v)}" for c, v in sorted(parts, key=lambda kv: -kv[1])]
    items.append(f"imports, model build, data set-up {_num(float(row['unexplained_s']))}")
    return f"start-up {_num(float(row['wall_s']))} s = " + " · ".join(items)


def _num(seconds):
    return f"{seconds:.3f}" if seconds < 0.1 else f"{seconds:.2f}"


def steady_rows(run: RunRecord, rank: str | None = None) -> pd.DataFrame:
    """The ledger over the steady window (no warm-up, no torch.profiler window)."""

    def build():
        steady = steady_steps(run)
        led = rows(run)
        if not len(steady) or not len(led):
            return led.iloc[0:0]
        keys = pd.MultiIndex.from_arrays([steady["rank"], steady["step"].astype(np.int64)])
        mine = pd.MultiIndex.from_arrays([led["rank"], led["step"].astype(np.int64)])
        return led[mine.isin(keys)]

    table = run.cached("steady_ledger", build)
    if rank is None:
        return table.copy(deep=False)
    return run.rank_rows("steady_ledger", rank, table)


# -- CPU evidence (derived; the savings model that prices findings is traindx.analyzers.savings) ---
def cpu_evidence(run: RunRecord, ranks: Iterable[str] | None = None) -> dict[str, Any] | None:
    """What the shim measured about CPU over the steady steps (the slowest rank of `ranks`), or
    None when the run has no `cpu` events (an older shim, `attach`): per step, in seconds,
    wall, data (the ledger's data line), data_cpu (the training thread's CPU seconds inside the
    DataLoader's __next__: the loading work itself when num_workers=0), data_runq (its run-queue
    wait there; None from a shim that did not record it), proc_cpu (all threads of the process),
    thread_cpu and thread_runq (the training thread's CPU and run-queue wait); cores (the process's CPU affinity), running
    (mean runnable tasks on the machine at a step end, the training thread included) and idle
    (mean idle cores of the machine)."""
    if not len(run.ledger):
        return None
    cpu = run.of_type("cpu")  # per-type tables: never the wide frame of every event
    if not len(cpu) or "proc_cpu_s" not in cpu:
        return None
    led = steady_rows(run)
    if ranks:
        led = led[led["rank"].isin(list(ranks))]
    if not len(led):
        return None
    rank = led.groupby("rank")["wall_s"].mean().idxmax()
    led = led[led["rank"] == rank]
    steps = set(led["step"].astype(int))
    cpu = cpu[(cpu["rank"] == rank) & cpu["step"].isin(steps)]
    if not len(cpu):
        return None
    spans = run.of_type("span")
    spans = spans[spans["rank"] == rank] if len(spans) else spans
    data_cpu, data_runq = 0.0, None
    if "cat" in spans and "cpu" in spans:
        data = spans[(spans["cat"] == "data") & spans["cpu"].notna()]
        ordered = led.sort_values("start_ns")
        begin = ordered["start_ns"].astype("int64").to_numpy()
        end = ordered["end_ns"].astype("int64").to_numpy()
        starts = data["start"].astype("int64").to_numpy()
        i = np.searchsorted(begin, starts, side="right") - 1
        inside = (i >= 0) & (starts < end[np.clip(i, 0, None)])
        data_cpu = float(data["cpu"].to_numpy(dtype=float)[inside].sum()) / len(led)
        if "runq" in data and data["runq"].notna().any():
            data_runq = float(data["runq"].fillna(0.0).to_numpy(dtype=float)[inside].sum()) / len(led)
    wall = float(led["wall_s"].mean())
    out = {
        "rank": rank,
        "steps": len(led),
        "wall": wall,
        "data": float(led["data_s"].mean()),
        "data_cpu": data_cpu,
        "proc_cpu": float(cpu["proc_cpu_s"].mean()),
        "thread_cpu": float(cpu["thread_cpu_s"].mean()) if "thread_cpu_s" in cpu else None,
        "data_runq": data_runq,
        "thread_runq": None,
        "running": None,
        "idle": None,
    }
    if "thread_runq_s" in cpu and cpu["thread_runq_s"].notna().any():
        out["thread_runq"] = float(cpu["thread_runq_s"].mean())
    cores = cpu["cores"].dropna() if "cores" in cpu else pd.Series(dtype=float)
    out["cores"] = int(cores.iloc[0]) if len(cores) else (run.manifest.get("host") or {}).get("cpus")
    if "running" in cpu and cpu["running"].notna().any():
        out["running"] = float(cpu["running"].mean())
    if "sys_idle_s" in cpu and cpu["sys_idle_s"].notna().any() and wall > 0:
        out["idle"] = float(cpu["sys_idle_s"].mean()) / wall
    return out
