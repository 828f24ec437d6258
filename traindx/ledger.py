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

Pure and vectorised: one sort and a cumulative sum per category over every rank, O(n log n).
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
LEDGER_CHUNK_RANKS = 128  # ranks swept together: bounds the sweep's memory on large jobs


def spans_table(events):
    """The shim's span events: rank, cat, start_ns, end_ns, tid; caller (the job's frame) and
    call (e.g. "torch.save") for the rare ones, None for the others."""
    cols = ["rank", "cat", "start_ns", "end_ns", "tid", "caller", "call"]
    if not len(events) or "type" not in events:
        return pd.DataFrame(columns=cols)
    df = events[events["type"] == "span"]
    if not len(df):
        return pd.DataFrame(columns=cols)

    def objects(col):  # plain object columns (pandas would make Arrow-backed str of them)
        return pd.Series(df[col].to_numpy(object) if col in df else np.full(len(df), None),
                         dtype=object)

    out = pd.DataFrame({"rank": objects("rank"), "cat": objects("cat"),
                        "start_ns": df["start"].astype("int64").to_numpy(),
                        "end_ns": df["t"].astype("int64").to_numpy(),
                        "tid": df["tid"].to_numpy(),
                        "caller": objects("caller"), "call": objects("call")})
    order = np.argsort(out["start_ns"].to_numpy(), kind="stable")
    return out.take(order).reset_index(drop=True)


def has_spans(run):
    """True when the run carries the shim's spans (older runs and `attach` do not)."""
    return len(run.spans) > 0


def _sweep(win_start, win_end, intervals):
    """ns per (window, category) with priority resolution; the last column is unexplained.
    win_*: sorted, non-overlapping windows; intervals: {category index: (starts, ends)}.

    One argsort of every boundary gives each boundary its index among the distinct points
    (no binary search per boundary: millions of random look-ups cost more than the sort)."""
    k = len(CATEGORIES)
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
    where = np.empty(len(order), np.int64)          # each boundary's index in points
    where[order] = np.cumsum(new) - 1
    del order, sorted_b, new
    offs = np.cumsum([0] + sizes)
    seg_len = np.diff(points)
    n = len(points)
    winner = np.full(n - 1, k, dtype=np.int64)
    pieces = {c: (where[offs[2 + 2 * i]: offs[3 + 2 * i]], where[offs[3 + 2 * i]: offs[4 + 2 * i]])
              for i, c in enumerate(cats)}
    for c in sorted(pieces, reverse=True):          # lowest priority first, higher overwrite
        si, ei = pieces[c]
        delta = np.bincount(si, minlength=n + 1) - np.bincount(ei, minlength=n + 1)
        active = np.cumsum(delta)[:-2] > 0
        winner[active] = c
    # the window a segment starts in: the last window start at or before it
    ws_i, we_i = where[offs[0]: offs[1]], where[offs[1]: offs[2]]
    mark = np.full(n, -1, np.int64)
    mark[ws_i] = np.arange(len(ws_i))
    w = np.maximum.accumulate(mark)[:-1]
    end_at = np.full(len(ws_i), -1, np.int64)
    end_at[:] = we_i
    valid = (w >= 0) & (np.arange(n - 1) < end_at[np.maximum(w, 0)])
    # integer ns sums below 2**53 per cell: exact in bincount's float64
    cell = np.bincount(w[valid] * (k + 1) + winner[valid], weights=seg_len[valid],
                       minlength=len(win_start) * (k + 1))
    return np.rint(cell).astype(np.int64).reshape(len(win_start), k + 1)


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


def _intervals(spans, srid, compiles, win_start, win_rid):
    """{category index: (starts, ends)} of every rank at once, on the ranks' shifted time axis
    (see compute): spans of the training thread(s) (compiles and GC pause every thread), the
    forward stretches before each backward, compiles and autotunes.
    spans: (cat, tid, start, end) arrays; compiles: (is autotune, start, end) arrays."""
    index = {c: i for i, c in enumerate(CATEGORIES)}
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
            target = "forward_backward" if name == "backward" else name
            if target in index:
                sel = codes == code
                add(target, s[sel], e[sel])
        # the forward pass: [previous measured call's end, backward start) on a training thread
        bwd = cat == "backward"
        if bwd.any():
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
    return {c: (np.concatenate([p[0] for p in ps]), np.concatenate([p[1] for p in ps]))
            for c, ps in parts.items()}


def split_windows(spans, compiles, win_start, win_end):
    """ns per (window, category) of ONE rank's sorted, non-overlapping windows (not steps:
    e.g. the stretch before each arrival at a collective), with the step ledger's intervals and
    priorities; the last column is unexplained. spans/compiles: that rank's run.spans/compiles."""
    win_start = np.asarray(win_start, np.int64)
    win_end = np.asarray(win_end, np.int64)
    win_rid = np.zeros(len(win_start), np.int64)
    sp = cs = None
    srid = np.empty(0, np.int64)
    if len(spans):
        sp = (spans["cat"].to_numpy(object), spans["tid"].to_numpy(),
              spans["start_ns"].to_numpy(np.int64), spans["end_ns"].to_numpy(np.int64))
        srid = np.zeros(len(spans), np.int64)
    if len(compiles):
        comp = compiles.dropna(subset=["start_ns", "end_ns"])
        if len(comp):
            cs = (comp["kind"].to_numpy(object) == "triton_autotune",
                  comp["start_ns"].astype("int64").to_numpy(), comp["end_ns"].astype("int64").to_numpy())
    return _sweep(win_start, win_end, _intervals(sp, srid, cs, win_start, win_rid))


def _process_starts(events):
    if not len(events) or "type" not in events:
        return {}
    ps = events[events["type"] == "process_start"]
    return {str(r): int(t) for r, t in zip(ps["rank"], ps["t"])}


def compute(steps, spans, compiles, events):
    """(ledger of the steps, start-up ledger): one row per rank-step / per rank, COLUMNS.

    Every rank at once: each rank's times move to a block of their own on one axis (rank id x
    the run's time span), so one sort and sweep serves all ranks and no interval can reach
    another rank's windows; the split is the per-rank one, exactly."""
    steps = steps.dropna(subset=["start_ns", "end_ns"])
    empty = pd.DataFrame(columns=COLUMNS)
    if not len(steps):
        return empty, empty.copy()
    starts = _process_starts(events)
    ranks = pd.unique(steps["rank"])                     # the order of the output's ranks
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
    lows = [w_s.min()] + ([spans["start_ns"].astype("int64").min(), spans["end_ns"].astype("int64").min()]
                          if len(spans) else []) + \
        ([comp["start_ns"].astype("int64").min(), comp["end_ns"].astype("int64").min()] if len(comp) else [])
    highs = [w_e.max()] + ([spans["start_ns"].astype("int64").max(), spans["end_ns"].astype("int64").max()]
                           if len(spans) else []) + \
        ([comp["start_ns"].astype("int64").max(), comp["end_ns"].astype("int64").max()] if len(comp) else [])
    base, width = int(min(lows)), int(max(highs)) - int(min(lows)) + 1
    # ranks whose blocks fit in int64, and few enough that the sweep's arrays stay small
    per_chunk = max(1, min((1 << 62) // width, LEDGER_CHUNK_RANKS))
    span_cat = spans["cat"].to_numpy(object) if len(spans) else None
    span_tid = spans["tid"].to_numpy() if len(spans) else None
    ns = np.zeros((len(w_s), len(CATEGORIES) + 1), np.int64)
    for lo in range(0, len(ranks), per_chunk):
        hi = lo + per_chunk
        wsel = (w_rid >= lo) & (w_rid < hi)
        ssel = (srid >= lo) & (srid < hi)
        csel = (crid >= lo) & (crid < hi)

        def shift(t, r):
            return (np.asarray(t, np.int64) - base) + (r - lo) * width

        cs = sp = None
        if len(comp):
            cs = (comp["kind"].to_numpy(object)[csel] == "triton_autotune",
                  shift(comp["start_ns"].astype("int64").to_numpy()[csel], crid[csel]),
                  shift(comp["end_ns"].astype("int64").to_numpy()[csel], crid[csel]))
        if len(spans):
            sp = (span_cat[ssel], span_tid[ssel],
                  shift(spans["start_ns"].to_numpy(np.int64)[ssel], srid[ssel]),
                  shift(spans["end_ns"].to_numpy(np.int64)[ssel], srid[ssel]))
        win_s, win_e = shift(w_s[wsel], w_rid[wsel]), shift(w_e[wsel], w_rid[wsel])
        intervals = _intervals(sp, srid[ssel], cs, win_s, w_rid[wsel])
        ns[wsel] = _sweep(win_s, win_e, intervals)
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
def cpu_evidence(run, ranks=None):
    """What the shim measured about CPU over the steady steps (the slowest rank of `ranks`), or
    None when the run has no `cpu` events (an older shim, `attach`): per step, in seconds,
    wall, data (the ledger's data line), data_cpu (the training thread's CPU seconds inside the
    DataLoader's __next__: the loading work itself when num_workers=0), proc_cpu (all threads of
    the process), thread_cpu (the training thread); cores (the process's CPU affinity), running
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
    data_cpu = 0.0
    if "cat" in spans and "cpu" in spans:
        data = spans[(spans["cat"] == "data") & spans["cpu"].notna()]
        ordered = led.sort_values("start_ns")
        begin = ordered["start_ns"].astype("int64").to_numpy()
        end = ordered["end_ns"].astype("int64").to_numpy()
        starts = data["start"].astype("int64").to_numpy()
        i = np.searchsorted(begin, starts, side="right") - 1
        inside = (i >= 0) & (starts < end[np.clip(i, 0, None)])
        data_cpu = float(data["cpu"].to_numpy(dtype=float)[inside].sum()) / len(led)
    wall = float(led["wall_s"].mean())
    out = {"rank": rank, "steps": len(led), "wall": wall, "data": float(led["data_s"].mean()),
           "data_cpu": data_cpu, "proc_cpu": float(cpu["proc_cpu_s"].mean()),
           "thread_cpu": float(cpu["thread_cpu_s"].mean()) if "thread_cpu_s" in cpu else None,
           "running": None, "idle": None}
    cores = cpu["cores"].dropna() if "cores" in cpu else []
    out["cores"] = int(cores.iloc[0]) if len(cores) else (run.manifest.get("host") or {}).get("cpus")
    if "running" in cpu and cpu["running"].notna().any():
        out["running"] = float(cpu["running"].mean())
    if "sys_idle_s" in cpu and cpu["sys_idle_s"].notna().any() and wall > 0:
        out["idle"] = float(cpu["sys_idle_s"].mean()) / wall
    return out


def workers_step_model(load_cpu, rest_cpu, rest_wall, workers, cores, others):
    """The step time once `workers` DataLoader processes make the batches (num_workers=0 before).

    The model (per-task fair share, which is what Linux's CFS gives runnable tasks of equal
    weight): the loading work is CPU work that does not shrink when it moves - `load_cpu`
    seconds per batch (the training thread's CPU inside __next__ before the fix); the rest of
    the step is `rest_cpu` CPU seconds per step on the training process, spread over
    a = max(1, rest_cpu / rest_wall) threads (its intra-op threads, as measured before the fix).
    `others` runnable tasks of other processes compete for the `cores`. With the training
    process runnable a fraction u_m of the time and the workers u_w, every runnable task gets

        share = min(1, cores / (others + a * u_m + workers * u_w))

    and the steady step is the slower of the two stages of the pipeline,

        step = max(load_cpu / (workers * share),  rest_cpu / (a * share))

    u_m and u_w are the stages' busy fractions (stage time / step), solved by fixed-point
    iteration. What it leaves out, and why: the batch transfer from a worker (a tensor batch
    goes through shared memory: ~1 ms for 256 x 256 floats on the training thread, inside the
    measured noise of these steps); schedulers that weight groups of tasks (cgroups, autogroup,
    nice), which the range in predicted_step_time covers; and an intra-op thread pool (torch's
    default, a thread per core) that spins at its barriers: once the workers oversubscribe the
    cores its parallel regions wait for descheduled threads, and a step can end up slower than
    before - measured, not modelled (bench/ledger_predictions.py, case getitem-cpu)."""
    a = max(1.0, rest_cpu / rest_wall) if rest_wall > 0 else 1.0
    u_m = u_w = 1.0
    step = 0.0
    for _ in range(50):
        share = min(1.0, cores / max(1e-9, others + a * u_m + workers * u_w))
        load = load_cpu / (workers * share)
        main = rest_cpu / (a * share)
        step = max(load, main)
        if step <= 0:
            return 0.0
        u_m, u_w = min(1.0, main / step), min(1.0, load / step)
    return step


def workers_step_capped(load_cpu, rest_cpu, rest_wall, workers, job_cores):
    """The step time once `workers` processes make the batches when the job cannot get more
    cores than `job_cores` (what it used before the fix plus the machine's idle cores): a
    scheduler that shares the cores between groups of tasks (cgroups, one per container or
    session) gives a group the same share however many tasks it runs. All the CPU work of a
    step then has those cores, and neither stage can go faster than one core per task:

        step = max((load_cpu + rest_cpu) / job_cores,  load_cpu / workers,  rest_cpu / a)"""
    a = max(1.0, rest_cpu / rest_wall) if rest_wall > 0 else 1.0
    cores = max(1e-9, min(job_cores, workers + a))
    return max((load_cpu + rest_cpu) / cores, load_cpu / workers, rest_cpu / a)


def _workers_prediction(run, finding, removes):
    """(predicted step, (low, high), cpu evidence) for a fix that moves the data line into
    `workers` DataLoader processes, from the shim's CPU evidence; None without it.

    The same baseline allows two readings of how many cores the job gets once it runs more
    processes, and the truth depends on how the kernel groups tasks, which the run cannot see
    (Linux autogroup shares the cores between sessions first, containers and Slurm share them
    between cgroups, and other users' load comes and goes):
      per task   workers_step_model (every task takes an equal share), with the other runnable
                 tasks counted on the machine at the step ends (less the training process's
                 own threads), and with them read from the share the training thread got
                 while it loaded batches (data_cpu / data = cores / (others + 1));
      per group  workers_step_capped with the job held to the cores it had (proc_cpu / wall,
                 plus the idle cores): its group's share does not grow with its task count.
    The range is [fastest, slowest] of these; the prediction is its middle (the point that is
    never further than half the range from either regime). On a machine with idle cores both
    readings agree and the range is narrow; on a busy shared one it is wide, and says so.
    Other ranks on the host add their own workers."""
    evd = cpu_evidence(run, finding.ranks)
    if evd is None or evd["data_cpu"] <= 0 or not evd.get("cores") or evd["wall"] <= 0:
        return None
    cores = float(evd["cores"])
    rest_wall = max(0.0, evd["wall"] - evd["data"])
    rest_cpu = max(0.0, evd["proc_cpu"] - evd["data_cpu"])
    own_threads = 1.0
    if evd["thread_cpu"] is not None:
        own_threads += max(0.0, evd["proc_cpu"] - evd["thread_cpu"]) / evd["wall"]
    share_seen = min(1.0, evd["data_cpu"] / evd["data"]) if evd["data"] > 0 else 1.0
    from_share = max(0.0, cores / share_seen - 1.0)
    counted = max(0.0, evd["running"] - own_threads) if evd["running"] is not None else from_share
    ranks = max(1, run.ledger["rank"].nunique()) if len(run.ledger) else 1
    workers = float(removes["workers"])
    extra = (ranks - 1) * workers
    per_task = [workers_step_model(evd["data_cpu"], rest_cpu, rest_wall, workers, cores,
                                   others + extra) for others in (counted, from_share)]
    job_cores = min(cores / ranks, evd["proc_cpu"] / evd["wall"] + (evd["idle"] or 0.0) / ranks)
    per_group = workers_step_capped(evd["data_cpu"], rest_cpu, rest_wall, workers, job_cores)
    low, high = min(per_task + [per_group]), max(per_task + [per_group])
    evd.update(others_counted=counted, others_from_share=from_share, job_cores=job_cores,
               workers=workers, per_task_s=per_task, per_group_s=per_group)
    return (low + high) / 2, (low, high), evd


def _freezes_the_heap(finding):
    """True when the finding's first prescription is gc.freeze() (not Megatron's manual GC,
    which moves every collection out of the steps and so does remove the whole gc line)."""
    p = finding.prescriptions[0] if getattr(finding, "prescriptions", ()) else None
    return p is not None and "gc.freeze" in f"{p.command or ''} {p.summary}"


def gc_freeze_residual(run, rank, steps):
    """Seconds per step of the gc line that gc.freeze() leaves, from the baseline's own GC
    records on `rank` over `steps` (its steady steps); None when they cannot tell.

    What freeze removes: the objects alive at the freeze leave the collector's view, so a full
    (gen-2) collection stops walking them. What it leaves (measured: bench/ledger_predictions.py
    case gc, and tests/test_ledger.py): (1) the young collections (gen 0/1 pauses >= 1 ms in the
    gc line): they walk new objects, frozen or not; (2) the garbage the steps make that only a
    full collection frees (reference cycles that survived the young generations): the same
    amount per step is still found and freed, by more frequent and shorter full collections
    (the frozen heap no longer counts towards the 25 % rule that spaces them out). A baseline
    full collection costs a + b * collected (a: walking the surviving heap, which freeze
    removes; b: per object freed, which stays): b is the slope of the shortest pause against
    the objects freed, over the steady gen-2 collections of each haul size (the shim's per-step
    gcstats; the shortest, because CPU contention only lengthens a pause), and the residual is
    b * (objects freed by full collections per step). It needs collections that freed
    different numbers of objects; with one haul size only it is None."""
    steps = set(int(s) for s in steps)
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
        if len(begin) and len(s):     # each young pause inside a step, clipped at its end
            i = np.clip(np.searchsorted(begin, s, side="right") - 1, 0, None)
            inside = (s >= begin[i]) & (s < end[i])
            young = float((np.minimum(e, end[i]) - s)[inside].sum()) / 1e9
    n = len(steps)
    if not len(full):
        return young / n
    count = full["count"].to_numpy(float)
    pause = pd.Series(full["total_s"].to_numpy(float) / count)       # per collection
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


def _gc_freeze_removed(run, led):
    """The gc line per step less what gc.freeze leaves (gc_freeze_residual), for the slowest
    rank; None when a rank's records cannot tell."""
    out = []
    for rank, rl in led.groupby("rank"):
        residual = gc_freeze_residual(run, rank, rl["step"])
        if residual is None:
            return None
        out.append(max(0.0, float(rl["gc_s"].mean()) - residual))
    return max(out) if out else None


def io_after_effect(led):
    """Seconds per step that the steps holding an I/O span (a save) and the step right after
    each lose beyond the span itself: their time outside the io line, less the mean of the
    other steps' (per rank, the slowest rank's; never below zero). None when every step or no
    step holds I/O (nothing to compare with).

    Why (measured: bench/ledger_predictions.py case checkpoint, tests/test_ledger.py): a
    torch.save of a large state dict leaves work behind it - the kernel writes the dirty pages
    back and the save's buffers have pushed the model out of the CPU caches - so the rest of
    the saving step and the next step are slower than the other steps, and removing the save
    removes that too. On a quiet 16-core host it is a few per cent of the save; on a loaded
    2-core machine, where the writeback competes with the job for the cores, the measured
    saving exceeded the io line by 30-35 %."""
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


def removed_seconds(run, finding):
    """Seconds per steady step the finding's fix removes: the ledger lines in finding.removes
    ({"categories": [...], "steps": [...] optional, "workers": N optional: the lines move to N
    processes beside the step, on "cpus": C cores per rank, "fraction": x optional}), over its
    ranks' steady steps (the slowest rank's mean); None when the finding names no ledger line.
    Lines that move into N worker processes: the CPU model of _workers_prediction where the shim
    recorded CPU evidence (a step can then also get slower than before: a negative saving),
    else the overlap bound below."""
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
        model = _workers_prediction(run, finding, removes)
        if model is not None:
            baseline = float(led.groupby("rank")["wall_s"].mean().max())
            return (baseline - model[0]) * float(removes.get("fraction", 1.0))
    if cats == ["gc"] and not removes.get("steps") and _freezes_the_heap(finding):
        removed = _gc_freeze_removed(run, led)
        if removed is not None:
            return removed * float(removes.get("fraction", 1.0))
    after = io_after_effect(led) if cats == ["io"] and not workers and not removes.get("steps") \
        else None
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
        chosen = set(int(s) for s in removes["steps"])
        per_row = per_row.where(led["step"].isin(chosen), 0.0)
    fraction = float(removes.get("fraction", 1.0))
    return float(per_row.groupby(led["rank"]).mean().max()) * fraction


def predicted_step_time(run, finding):
    """What the --fix loop writes beside the measured candidate: {"baseline_step_s": mean steady
    step, "removed_s": ledger seconds per step the fix removes, "predicted_step_s": baseline -
    removed, "categories": ..., "method": ...}; removed/predicted are None when the finding names
    no ledger line (then fall back to the prescription's expected_gain_s_per_step). A fix that
    moves the data line into DataLoader workers adds "predicted_range_s": [fast, slow] and the
    "cpu_evidence" it came from (_workers_prediction): its result depends on how many cores
    the job really gets beside the machine's other work, which one baseline run bounds but does
    not fix."""
    led = steady_rows(run)
    ranks = [r for r in (finding.ranks or ()) if r in set(led["rank"])]
    if ranks:
        led = led[led["rank"].isin(ranks)]
    baseline = float(led.groupby("rank")["wall_s"].mean().max()) if len(led) else None
    removed = removed_seconds(run, finding)
    spread = None
    if removed is None:
        gains = [p.expected_gain_s_per_step for p in finding.prescriptions
                 if p.expected_gain_s_per_step is not None]
        removed = gains[0] if gains else None
        method = "the prescription's expected gain (the finding names no ledger line)"
    else:
        method = "ledger lines the fix removes, mean per steady step"
        removes = getattr(finding, "removes", None) or {}
        model = _workers_prediction(run, finding, removes) if removes.get("workers") and \
            list(removes.get("categories", ())) == ["data"] and not removes.get("steps") else None
        if list(removes.get("categories", ())) == ["gc"] and _freezes_the_heap(finding) \
                and not removes.get("steps") and _gc_freeze_removed(run, led) is not None:
            method = ("gc line less what gc.freeze leaves: young collections and the cost of "
                      "freeing each step's cyclic garbage (traindx.ledger.gc_freeze_residual)")
        if model is not None:
            spread = {"low_s": model[1][0], "high_s": model[1][1],
                      "cpu_evidence": {k: v for k, v in model[2].items()}}
            method = ("CPU model of the DataLoader workers (traindx.ledger.workers_step_model) "
                      "from the shim's CPU evidence")
    predicted = None if baseline is None or removed is None else max(0.0, baseline - removed)
    out = {"baseline_step_s": baseline, "removed_s": removed, "predicted_step_s": predicted,
           "categories": list((getattr(finding, "removes", None) or {}).get("categories", ())),
           "method": method}
    if spread:
        out["predicted_range_s"] = [spread["low_s"], spread["high_s"]]
        out["cpu_evidence"] = spread["cpu_evidence"]
    return out
