"""The time ledger: every rank-step's wall time split into exclusive, measured categories.

Inputs (all on the shim's time.time_ns() axis): the steps, the shim's `span` events (the
outermost nn.Module call of the training thread, DataLoader __next__, backward, optimizer step,
the closure an optimizer step runs, torch.save/DCP saves, CUDA syncs, blocking collectives, long
GC pauses), and the compile/autotune events. Where intervals overlap, one category wins by
PRIORITY (a compile on the autograd thread while the training thread sits in backward counts as
compile; a GC inside a data wait counts once, as GC; a forward and backward inside an optimizer
step's closure - Lightning's training_step - count as fwd/bwd, not optimizer).

`forward_backward` (fwd/bwd) is the measured forward (outermost module calls) plus backward and
nothing else: the job's own hooks that torch runs inside them (the shim's `hook` spans: module
and tensor hooks whose code is the job's or a framework's) are host time. `host` is the training thread's time between its measured calls (and the parts
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
from typing import Any

import numpy as np
import pandas as pd

# the computation lives in ledger_sweep; its public names are read from here by the analyzers
from traindx.derive.ledger_sweep import (  # noqa: F401  (re-exported)
    CATEGORIES,
    COLUMNS,
    LABELS,
    LEDGER_CHUNK_RANKS,
    SPAN_CATEGORY,
    STARTUP_STEP,
    SWEEP_CLOSURE,
    SWEEP_HOOK,
    SWEEP_HOST,
    TRAINING_THREAD_ONLY,
    Array,
    categories_at,
    compute,
    measured_forward,
    spans_table,
    split_windows,
)
from traindx.derive.runview import RunView
from traindx.derive.steady import steady_steps

__all__ = [
    "CATEGORIES",
    "COLUMNS",
    "HOST_CODE_COLUMNS",
    "LABELS",
    "LEDGER_CHUNK_RANKS",
    "SPAN_CATEGORY",
    "STARTUP_STEP",
    "TRAINING_THREAD_ONLY",
    "breakdown",
    "breakdown_text",
    "compute",
    "cpu_evidence",
    "has_spans",
    "host_code",
    "host_samples",
    "measured_forward",
    "rows",
    "share",
    "spans_table",
    "split_windows",
    "startup_text",
    "steady_rows",
]


def has_spans(run: RunView) -> bool:
    """True when the run carries the shim's spans (older runs and `attach` do not)."""
    return len(run.spans) > 0


# -- what ran inside the host line --------------------------------------------------------------
HOST_CODE_COLUMNS = [
    "rank",
    "step",
    "function",
    "file",
    "line",
    "call",
    "seconds",
    "samples",
    "runq_s",
    "via",
]


def host_samples(run: RunView) -> pd.DataFrame:
    """The shim's samples of the training thread (hostsample.py), one row each: rank, pid, tid,
    t_ns, function, file, line, call, via (the library function that called the job's frame
    back: a framework's callback dispatch; None for the loop's own calls), runq_frac (the share of the time since the thread's
    previous sample that it spent runnable but waiting for a core; NaN where the shim could not
    read the kernel's run-queue delay, or for a thread's first sample)."""
    cols = ["rank", "pid", "tid", "t_ns", "function", "file", "line", "call", "via", "runq_frac"]
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
            "via": frames["via"].to_numpy(object) if "via" in frames else None,
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


def _runq_ns(ev: pd.DataFrame, lens: Array) -> Array:
    """Each sample's cumulative run-queue wait (ns) of its thread, NaN where the event has none."""
    if "runq_us" not in ev:
        return np.full(int(lens.sum()), np.nan)
    parts = []
    for v, n in zip(ev["runq_us"], lens):
        ok = isinstance(v, list) and len(v) == n
        parts.append(np.asarray(v, float) * 1000 if ok else np.full(n, np.nan))
    return np.concatenate(parts)


def host_code(run: RunView) -> pd.DataFrame:
    """What code ran inside the `host` line, per rank-step (HOST_CODE_COLUMNS): the shim's samples
    of the training thread that fall where the ledger books host time, grouped by the job's
    function and file:line and the call the stack ended in; `seconds` splits the step's host_s
    by the samples' shares (the ledger's exact total, the samples' split) and `samples` counts
    them; `runq_s` is the part
    of those seconds the thread spent waiting for a core (the samples' run-queue shares; NaN
    where the record has none): on a loaded machine a time slice that ends inside a line
    leaves the thread at that line while other tasks run. Steps whose host time no sample saw
    have no rows."""

    def build() -> pd.DataFrame:
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
            busy = _busy_of_rank(run, rank)
            cat = categories_at(spans, comp, ws, we, t, residual=not forward, busy=busy)
            host = (cat == SWEEP_HOST) | (cat == SWEEP_CLOSURE) | (cat == SWEEP_HOOK)
            kept.append(
                mine[host].assign(
                    step=rows_["step"].to_numpy(np.int64)[w[host]],
                    host_s=rows_["host_s"].to_numpy(float)[w[host]],
                )
            )
        if not kept:
            return pd.DataFrame(columns=HOST_CODE_COLUMNS)
        df = pd.concat(kept, ignore_index=True)
        for col in ("function", "file", "call", "via"):
            df[col] = df[col].astype(object).where(df[col].notna(), "")
        keys = ["rank", "step", "function", "file", "line", "call", "via"]
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
        g["via"] = g["via"].where(g["via"] != "", None)
        g = g.sort_values(["rank", "step", "seconds"], ascending=[True, True, False], kind="stable")
        return g.reset_index(drop=True)[HOST_CODE_COLUMNS]

    return run.cached("host_code", build).copy(deep=False)


def _busy_of_rank(run: RunView, rank: object) -> tuple[Array, Array] | None:
    """(starts, ends) where the rank's GPU still ran earlier work (RunRecord.gpu_busy), or None."""
    busy = getattr(run, "gpu_busy", None)
    if busy is None or not len(busy):
        return None
    mine = busy[busy["rank"].astype(str) == str(rank)]
    return mine["start_ns"].to_numpy(np.int64), mine["end_ns"].to_numpy(np.int64)


def _legacy(run: RunView) -> bool:
    return not measured_forward(run.spans, run.of_type("host_samples"))


# -- reading the ledger ----------------------------------------------------------------------------
def rows(run: RunView, rank: str | None = None, steps: Iterable[int] | None = None) -> pd.DataFrame:
    led = run.ledger if rank is None else run.rank_rows("ledger", rank)
    if steps is not None:
        led = led[led["step"].isin({int(s) for s in steps})]
    return led


def share(
    run: RunView, categories: Iterable[str], rank: str | None = None, steps: Iterable[int] | None = None
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


def _num(seconds: float) -> str:
    return f"{seconds:.3f}" if seconds < 0.1 else f"{seconds:.2f}"


def steady_rows(run: RunView, rank: str | None = None) -> pd.DataFrame:
    """The ledger over the steady window (no warm-up, no torch.profiler window)."""

    def build() -> pd.DataFrame:
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


# -- CPU evidence (derived; the savings model that prices findings is traindx.analyzers.core.savings) ---
def cpu_evidence(run: RunView, ranks: Iterable[str] | None = None) -> dict[str, Any] | None:
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
    if "sys_span_s" in cpu and cpu["sys_span_s"].notna().any():  # readings may span several steps
        read = cpu.dropna(subset=["sys_idle_s", "sys_span_s"])
        span = float(read["sys_span_s"].sum())
        out["idle"] = float(read["sys_idle_s"].sum()) / span if span > 0 else None
    elif "sys_idle_s" in cpu and cpu["sys_idle_s"].notna().any() and wall > 0:
        out["idle"] = float(cpu["sys_idle_s"].mean()) / wall
    return out
