"""The time ledger: every rank-step's wall time split into exclusive, measured categories.

Inputs (all on the shim's time.time_ns() axis): the steps, the shim's `span` events (DataLoader
__next__, backward, optimizer step, torch.save/DCP saves, CUDA syncs, blocking collectives, long
GC pauses), and the compile/autotune events. Where intervals overlap, one category wins by
PRIORITY (a compile on the autograd thread while the training thread sits in backward counts as
compile; a GC inside a data wait counts once, as GC). The forward pass is not hooked (module
hooks would cost every call): it is the stretch of the training thread between the end of its
previous measured call (data, backward, optimizer, io, sync, collective) and the start of each backward, and is booked
with backward as `forward_backward`. What no interval covers is `unexplained` - shown, never
spread over the other lines. Each row sums to its wall time exactly (integer nanoseconds).

Start-up - from the shim's `process_start` to the first step's begin - is split the same way;
there, `unexplained` is imports, model build and data set-up.

Pure and vectorised: one sort and a cumulative sum per category and rank, O(n log n).
"""
import numpy as np
import pandas as pd

# highest priority first; `unexplained` is what none of them covers
CATEGORIES = ("compile", "autotune", "gc", "io", "sync", "collective", "data", "optimizer",
              "forward_backward")
COLUMNS = ["rank", "step", "start_ns", "end_ns", "wall_s"] + [f"{c}_s" for c in CATEGORIES] + [
    "unexplained_s"]
LABELS = {"compile": "compile", "autotune": "autotune", "gc": "gc", "io": "checkpoint/io",
          "sync": "host sync", "collective": "collective", "data": "data",
          "optimizer": "optimizer", "forward_backward": "fwd/bwd", "unexplained": "unexplained"}
# spans that count only on the thread(s) that drive the steps; compiles and GC pause every thread
TRAINING_THREAD_ONLY = ("data", "backward", "optimizer", "io", "sync", "collective")
STARTUP_STEP = -1


def spans_table(events):
    """The shim's span events: rank, cat, start_ns, end_ns, tid; caller (the job's frame) and
    call (e.g. "torch.save") for the rare ones, None for the others."""
    cols = ["rank", "cat", "start_ns", "end_ns", "tid", "caller", "call"]
    if not len(events) or "type" not in events:
        return pd.DataFrame(columns=cols)
    df = events[events["type"] == "span"]
    if not len(df):
        return pd.DataFrame(columns=cols)
    out = pd.DataFrame({"rank": df["rank"].values, "cat": df["cat"].values,
                        "start_ns": df["start"].astype("int64").values,
                        "end_ns": df["t"].astype("int64").values,
                        "tid": df["tid"].values,
                        "caller": df["caller"].values if "caller" in df else None,
                        "call": df["call"].values if "call" in df else None})
    return out.sort_values("start_ns", kind="stable").reset_index(drop=True)


def has_spans(run):
    """True when the run carries the shim's spans (older runs and `attach` do not)."""
    return len(run.spans) > 0


def _training_threads(spans):
    for cat in ("optimizer", "backward", "data"):
        tids = set(spans.loc[spans["cat"] == cat, "tid"])
        if tids:
            return tids
    return set()


def _forward_intervals(spans):
    """[anchor, backward start) for each backward on a training thread: the forward pass and
    whatever the loop does between its previous measured call (a data wait, a backward, an
    optimizer step, a save, a sync, a collective) and the backward. Without module hooks (they
    would cost every module call) untimed work there - a log line, a sleep - counts as forward."""
    bwd = spans[spans["cat"] == "backward"]
    if not len(bwd):
        return np.empty(0, np.int64), np.empty(0, np.int64)
    anchors = spans[spans["cat"].isin(["data", "backward", "optimizer", "io", "sync",
                                        "collective"])]
    ends = np.sort(anchors["end_ns"].to_numpy(np.int64))
    starts = bwd["start_ns"].to_numpy(np.int64)
    i = np.searchsorted(ends, starts, side="right") - 1
    anchor = np.where(i >= 0, ends[np.maximum(i, 0)], np.iinfo(np.int64).min)
    return anchor, starts  # the step window clips an anchor before the step (or none at all)


def _sweep(win_start, win_end, intervals):
    """ns per (window, category) with priority resolution; the last column is unexplained.
    win_*: sorted, non-overlapping windows; intervals: {category index: (starts, ends)}."""
    k = len(CATEGORIES)
    out = np.zeros((len(win_start), k + 1), dtype=np.int64)
    if not len(win_start):
        return out
    lo, hi = int(win_start.min()), int(win_end.max())
    clipped = {}
    bounds = [win_start, win_end]
    for c, (s, e) in intervals.items():
        s = np.clip(np.asarray(s, np.int64), lo, hi)
        e = np.clip(np.asarray(e, np.int64), lo, hi)
        keep = e > s
        clipped[c] = (s[keep], e[keep])
        bounds += [s[keep], e[keep]]
    points = np.unique(np.concatenate(bounds))
    if len(points) < 2:
        return out
    seg_len = np.diff(points)
    winner = np.full(len(seg_len), k, dtype=np.int64)
    for c in sorted(clipped, reverse=True):          # lowest priority first, higher overwrite
        s, e = clipped[c]
        if not len(s):
            continue
        delta = np.zeros(len(points) + 1, dtype=np.int64)
        np.add.at(delta, np.searchsorted(points, s), 1)
        np.add.at(delta, np.searchsorted(points, e), -1)
        active = np.cumsum(delta)[:-2] > 0
        winner[active] = c
    seg_start = points[:-1]
    w = np.searchsorted(win_start, seg_start, side="right") - 1
    valid = (w >= 0) & (seg_start < win_end[np.maximum(w, 0)])
    np.add.at(out, (w[valid], winner[valid]), seg_len[valid])
    return out


def _rank_intervals(spans, compiles, win_start):
    intervals = {}
    train = _training_threads(spans)
    on_train = spans[spans["tid"].isin(train) | ~spans["cat"].isin(TRAINING_THREAD_ONLY)]
    index = {c: i for i, c in enumerate(CATEGORIES)}

    def add(cat, s, e):
        s0, e0 = intervals.get(index[cat], (np.empty(0, np.int64), np.empty(0, np.int64)))
        intervals[index[cat]] = (np.concatenate([s0, np.asarray(s, np.int64)]),
                                 np.concatenate([e0, np.asarray(e, np.int64)]))

    for cat, rows in on_train.groupby("cat"):
        name = "forward_backward" if cat == "backward" else cat
        if name in index:
            add(name, rows["start_ns"].to_numpy(np.int64), rows["end_ns"].to_numpy(np.int64))
    fs, fe = _forward_intervals(on_train)
    if len(fs):
        # a forward never reaches back before the step (or start-up) its backward belongs to
        w = np.searchsorted(win_start, fe, side="right") - 1
        floor = np.where(w >= 0, win_start[np.maximum(w, 0)], fe)
        add("forward_backward", np.maximum(fs, floor), fe)
    if len(compiles):
        comp = compiles.dropna(subset=["start_ns", "end_ns"])
        tune = comp["kind"] == "triton_autotune"
        for cat, rows in (("autotune", comp[tune]), ("compile", comp[~tune])):
            if len(rows):
                add(cat, rows["start_ns"].astype("int64"), rows["end_ns"].astype("int64"))
    return intervals


def _process_starts(events):
    if not len(events) or "type" not in events:
        return {}
    ps = events[events["type"] == "process_start"]
    return {str(r): int(t) for r, t in zip(ps["rank"], ps["t"])}


def compute(steps, spans, compiles, events):
    """(ledger of the steps, start-up ledger): one row per rank-step / per rank, COLUMNS."""
    steps = steps.dropna(subset=["start_ns", "end_ns"])
    starts = _process_starts(events)
    step_rows, startup_rows = [], []
    by_rank_spans = dict(tuple(spans.groupby("rank"))) if len(spans) else {}
    by_rank_comp = dict(tuple(compiles.groupby("rank"))) if len(compiles) else {}
    for rank, group in steps.groupby("rank", sort=False):
        group = group.sort_values("start_ns")
        ws = group["start_ns"].to_numpy(np.int64)
        we = group["end_ns"].to_numpy(np.int64)
        ids = group["step"].to_numpy(np.int64)
        first = starts.get(str(rank))
        has_startup = first is not None and first < ws[0]
        if has_startup:
            ws, we, ids = (np.concatenate([[first], ws]), np.concatenate([[ws[0]], we]),
                           np.concatenate([[STARTUP_STEP], ids]))
        intervals = _rank_intervals(by_rank_spans.get(rank, spans.iloc[0:0]),
                                    by_rank_comp.get(rank, compiles.iloc[0:0]), ws)
        ns = _sweep(ws, we, intervals)
        table = pd.DataFrame(ns / 1e9, columns=[f"{c}_s" for c in CATEGORIES] + ["unexplained_s"])
        table.insert(0, "wall_s", (we - ws) / 1e9)
        table.insert(0, "end_ns", we)
        table.insert(0, "start_ns", ws)
        table.insert(0, "step", ids)
        table.insert(0, "rank", rank)
        if has_startup:
            startup_rows.append(table.iloc[:1])
            table = table.iloc[1:]
        step_rows.append(table)
    ledger = pd.concat(step_rows, ignore_index=True) if step_rows else pd.DataFrame(columns=COLUMNS)
    startup = (pd.concat(startup_rows, ignore_index=True) if startup_rows
               else pd.DataFrame(columns=COLUMNS))
    return ledger[COLUMNS], startup[COLUMNS]


# -- reading the ledger ----------------------------------------------------------------------------
def rows(run, rank=None, steps=None):
    led = run.ledger if rank is None else run.rank_rows("ledger", rank)
    if steps is not None:
        led = led[led["step"].isin(set(int(s) for s in steps))]
    return led


def share(run, categories, rank=None, steps=None):
    """(share of wall time, seconds per step) of the categories over the given rank-steps."""
    led = rows(run, rank, steps)
    if not len(led):
        return 0.0, 0.0
    secs = float(led[[f"{c}_s" for c in categories]].to_numpy().sum())
    wall = float(led["wall_s"].sum())
    return (secs / wall if wall else 0.0), secs / len(led)


def breakdown(led):
    """{category: mean seconds per row} of a ledger slice, unexplained last; zero lines left out."""
    if not len(led):
        return {}
    out = {}
    for c in CATEGORIES + ("unexplained",):
        v = float(led[f"{c}_s"].mean())
        if v > 0:
            out[c] = v
    return out


def breakdown_text(led, limit=6):
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


def startup_text(row):
    """'start-up 7.43 s = gc 1.58 · imports, model build, data set-up 5.85' for one start-up row."""
    parts = [(c, float(row[f"{c}_s"])) for c in CATEGORIES if float(row[f"{c}_s"]) > 0]
    items = [f"{LABELS[c]} {_num(v)}" for c, v in sorted(parts, key=lambda kv: -kv[1])]
    items.append(f"imports, model build, data set-up {_num(float(row['unexplained_s']))}")
    return f"start-up {_num(float(row['wall_s']))} s = " + " · ".join(items)


def _num(seconds):
    return f"{seconds:.3f}" if seconds < 0.1 else f"{seconds:.2f}"


def steady_rows(run, rank=None):
    """The ledger over the steady window (no warm-up, no torch.profiler window)."""
    from traindx.analyzers import evidence as ev

    def build():
        steady = ev.steady_steps(run)
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


# -- predictions -------------------------------------------------------------------------------------
def removed_seconds(run, finding):
    """Seconds per steady step the finding's fix removes: the ledger lines in finding.removes
    ({"categories": [...], "steps": [...] optional, "workers": N optional: the lines move to N
    processes beside the step, on "cpus": C cores per rank, "fraction": x optional}), over its
    ranks' steady steps (the slowest rank's mean); None when the finding names no ledger line."""
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
    per_row = led[[f"{c}_s" for c in cats]].sum(axis=1)
    workers = removes.get("workers")
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
        chosen = set(int(s) for s in removes["steps"])
        per_row = per_row.where(led["step"].isin(chosen), 0.0)
    fraction = float(removes.get("fraction", 1.0))
    return float(per_row.groupby(led["rank"]).mean().max()) * fraction


def predicted_step_time(run, finding):
    """What the --fix loop writes beside the measured candidate: {"baseline_step_s": mean steady
    step, "removed_s": ledger seconds per step the fix removes, "predicted_step_s": baseline -
    removed, "categories": ..., "method": ...}; removed/predicted are None when the finding names
    no ledger line (then fall back to the prescription's expected_gain_s_per_step)."""
    led = steady_rows(run)
    ranks = [r for r in (finding.ranks or ()) if r in set(led["rank"])]
    if ranks:
        led = led[led["rank"].isin(ranks)]
    baseline = float(led.groupby("rank")["wall_s"].mean().max()) if len(led) else None
    removed = removed_seconds(run, finding)
    if removed is None:
        gains = [p.expected_gain_s_per_step for p in finding.prescriptions
                 if p.expected_gain_s_per_step is not None]
        removed = gains[0] if gains else None
        method = "the prescription's expected gain (the finding names no ledger line)"
    else:
        method = "ledger lines the fix removes, mean per steady step"
    predicted = None if baseline is None or removed is None else max(0.0, baseline - removed)
    return {"baseline_step_s": baseline, "removed_s": removed, "predicted_step_s": predicted,
            "categories": list((getattr(finding, "removes", None) or {}).get("categories", ())),
            "method": method}
