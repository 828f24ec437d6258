"""The report's data: everything the HTML report and the terminal summary show, built once from a
RunRecord and its findings as plain JSON-able values (pure: no I/O beyond the record itself).

Times are seconds since the run's start (manifest start_ns), so every chart shares one x axis.
Large evidence is reduced here (steps binned, samples merged into a pruned tree, metrics
downsampled) so a 10-minute run renders to a few megabytes at most.
"""
import bisect
import json
import math
import os
import re
import shlex
from datetime import datetime, timezone
from functools import lru_cache

from traindx import redact
from traindx.findings import SEVERITIES

# a step slower than this many times the median is "slow" and gets a cause
SLOW_FACTOR = 1.5
CAUSE_SHARE = 0.3             # an event covering this share of a step names the step's cause
EVIDENCE_SHARE = 0.1          # ...and covering this share of all step time makes the headline
MAX_STEP_BARS = 800           # more steps than this are binned (about one bar per pixel)
MAX_GPU_POINTS = 600          # per GPU and metric
MAX_COMPILE_ROWS = 200
FINDING_COMPILE_ROWS = 5      # a finding shows its first compiles; the rest are summed up per kernel
MAX_LOG_LINES = 40
FLAME_MIN_SHARE = 0.004       # icicle nodes smaller than this share of the samples are pruned
FLAME_MAX_DEPTH = 80
MAX_LANE_SNAPSHOTS = 400
MAX_EVIDENCE_ROWS = 25
MAX_TEXT = 2000

# Environment variables worth showing: they change how training runs. Anything else in the
# (already redacted) manifest env stays out of the report.
RELEVANT_ENV = re.compile(
    r"^(CUDA_|NCCL_|TORCH|PYTORCH_|FLASH_ATTENTION|CUTE_DSL|TRITON_|OMP_NUM_THREADS|MKL_NUM_THREADS|"
    r"RANK$|LOCAL_RANK$|WORLD_SIZE$|LOCAL_WORLD_SIZE$|MASTER_ADDR$|MASTER_PORT$|NVTE_|"
    r"MEGATRON|HF_HUB_OFFLINE|TOKENIZERS_PARALLELISM|PYTHONPATH$|TRAINDX_)")
REDACTED = redact.REDACTED

# causes of a slow step, in the order they win ties; colours live in the template
CAUSES = {
    "compile": "JIT compile",
    "autotune": "autotuning",
    "dynamo": "torch.compile recompile",
    "gc": "garbage collection",
    "warmup": "first step",
    "unexplained": "slow, cause not recorded",
    "normal": "normal",
}
COMPILE_CAUSE = {"cute_dsl": "compile", "triton": "compile", "triton_autotune": "autotune",
                 "dynamo": "dynamo"}


redact_text = redact.redact_text  # every string shown goes through _clip: log lines included


def _clip(text, limit=MAX_TEXT):
    text = redact_text(str(text))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _num(value):
    """A float, or None for missing/NaN (pandas hands both)."""
    if value is None:
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) or math.isinf(f) else f


def _text(value):
    """A string column's value: '' for None and pandas' NaN."""
    return value if isinstance(value, str) else ("" if value is None or _num(value) is None else str(value))


def _median(values):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _quantile(values, q):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    pos = (len(values) - 1) * q
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def _ranges(numbers):
    """[0, 1, 2, 5, 7, 8] -> '0–2, 5, 7–8' (short for long runs)."""
    numbers = sorted({int(n) for n in numbers})
    if not numbers:
        return ""
    parts, start, prev = [], numbers[0], numbers[0]
    for n in numbers[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        parts.append(str(start) if start == prev else f"{start}–{prev}")
        if n is not None:
            start = prev = n
    if len(parts) > 12:
        parts = parts[:10] + [f"… ({len(numbers)} steps)"]
    return ", ".join(parts)


def _frame_label(frame):
    if not isinstance(frame, dict):
        return _clip(frame, 300) if frame else ""
    where = frame.get("file") or frame.get("filename") or ""
    line = frame.get("line")
    func = frame.get("function") or frame.get("name") or ""
    loc = f"{where}:{line}" if where and line else where
    return _clip(f"{loc} ({func})" if func and loc else (loc or func), 400)


# -- run metadata ----------------------------------------------------------------------------------
def run_meta(run):
    m = run.manifest
    start_ns, end_ns = m.get("start_ns"), m.get("end_ns")
    env = {}
    for name, value in sorted((m.get("env") or {}).items()):
        if RELEVANT_ENV.match(name):
            env[name] = REDACTED if redact.is_secret_name(name) else _clip(value, 400)
    command = m.get("command") or []
    return {
        "id": os.path.basename(run.path.rstrip(os.sep)),
        "path": run.path,
        "command": _clip(shlex.join(redact.redact_argv(command)) if isinstance(command, list)
                         else command, 4000),
        "cwd": _clip(m.get("cwd") or "", 400),
        "started": (datetime.fromtimestamp(start_ns / 1e9, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
                    if start_ns else None),
        "duration_s": (end_ns - start_ns) / 1e9 if start_ns and end_ns else None,
        "exit_code": m.get("exit_code"),
        "signal": m.get("signal"),
        "status": m.get("status"),
        "host": {k: _clip(v, 300) for k, v in (m.get("host") or {}).items()},
        "gpus": [_gpu_label(g) for g in m.get("gpus") or []],
        "packages": {k: v for k, v in (m.get("packages") or {}).items() if v},
        "env": env,
        "ranks": list(run.ranks),
        "options": {k: v for k, v in (m.get("options") or {}).items() if k != "extra_env"},
    }


def _gpu_label(gpu):
    if isinstance(gpu, dict):
        name = gpu.get("name") or "GPU"
        mem = gpu.get("memory_total_bytes") or gpu.get("memory_bytes")
        extra = f", {mem / 2**30:.0f} GiB" if isinstance(mem, (int, float)) else ""
        return _clip(f"{name}{extra}", 200)
    return _clip(gpu, 200)


EVIDENCE_NAMES = {"nvml": "GPU metrics (NVML)", "gpus": "GPU inventory", "pyspy": "py-spy stacks",
                  "shim": "in-process events (shim)", "trace": "torch.profiler window",
                  "torch_profiler": "torch.profiler window"}


def missing_evidence(run):
    """What could not be collected, one short line each (a py-spy backtrace is cut to its gist)."""
    out = []
    for what, why in sorted((run.missing or {}).items()):
        lines = [l.strip() for l in str(why).splitlines() if l.strip()]
        gist = next((l for l in lines if not re.match(r"^\d+:", l)), lines[0] if lines else "")
        # "NVML unavailable: NVMLError_LibraryNotFound: NVML Shared Library Not Found" -> the last part
        last = gist.rsplit(": ", 1)[-1]
        short = last if len(last) >= 12 else gist
        out.append({"what": _clip(what, 100), "name": EVIDENCE_NAMES.get(what, what.replace("_", " ")),
                    "why": _clip(gist, 300), "short": _clip(short, 200), "full": _clip(why, 2000)})
    return out


def missing_summary(missing):
    """'GPU inventory, GPU metrics (NVML) (NVML Shared Library Not Found)': one entry per reason."""
    by_reason = {}
    for m in missing:
        by_reason.setdefault(m["short"], []).append(m["name"])
    return "; ".join(f"{', '.join(names)}: {reason}" for reason, names in by_reason.items())


# -- steps and what made them slow ----------------------------------------------------------------
def _step_rows(run, t0):
    """Per rank, steps as dicts; from the shim, else from the job's log lines."""
    rows = {}
    steps = run.steps
    if len(steps):
        for s in steps.itertuples():
            if s.start_ns is None or _num(s.start_ns) is None:
                continue
            rows.setdefault(str(s.rank), []).append({
                "step": int(s.step), "start_s": (int(s.start_ns) - t0) / 1e9,
                "end_s": (int(s.end_ns) - t0) / 1e9, "duration_s": float(s.duration_s)})
        source = "shim"
    else:
        ls = run.log_steps
        ls = ls[ls["step_time_s"].notna() & ls["step"].notna()] if len(ls) else ls
        for s in ls.itertuples():
            end = (int(s.t) - t0) / 1e9
            rows.setdefault("0", []).append({"step": int(s.step), "start_s": end - s.step_time_s,
                                             "end_s": end, "duration_s": float(s.step_time_s)})
        source = "log" if rows else None
    return rows, source


MAX_TIMELINE_RANKS = 32       # ranks drawn per-step (timeline, heatmap); the rest in ranks_summary
CAUSE_ORDER = ("compile", "autotune", "dynamo", "gc")


def _step_table(run, t0):
    """Every rank's steps as columns (rank, step, start_s, end_s, duration_s), in run.steps
    order; from the shim, else from the job's log lines. Vectorised: a run of a thousand ranks
    has millions of steps."""
    import numpy as np
    import pandas as pd

    steps = run.steps
    if len(steps):
        start = pd.to_numeric(steps["start_ns"], errors="coerce")
        s = steps[start.notna().to_numpy()]
        st = pd.DataFrame({
            "rank": pd.Series(s["rank"].astype(str).to_numpy(object), dtype=object),
            "step": s["step"].to_numpy(np.int64),
            "start_s": (s["start_ns"].to_numpy(np.int64) - t0) / 1e9,
            "end_s": (s["end_ns"].to_numpy(np.int64) - t0) / 1e9,
            "duration_s": s["duration_s"].to_numpy(np.float64)})
        return st, "shim"
    rows = []
    ls = run.log_steps
    ls = ls[ls["step_time_s"].notna() & ls["step"].notna()] if len(ls) else ls
    for r in ls.itertuples():
        end = (int(r.t) - t0) / 1e9
        rows.append({"rank": "0", "step": int(r.step), "start_s": end - r.step_time_s,
                     "end_s": end, "duration_s": float(r.step_time_s)})
    st = pd.DataFrame(rows, columns=["rank", "step", "start_s", "end_s", "duration_s"])
    st["rank"] = pd.Series(st["rank"].to_numpy(object), dtype=object)
    return st, ("log" if rows else None)


def classify_table(st, compiles, gc):
    """classify_steps over the step table, vectorised: compile_s, gc_s, slow, cause columns
    added; (median, threshold) returned. gc: frame (rank, step, gc) of GC seconds per step."""
    import numpy as np
    import pandas as pd

    n = len(st)
    d = st["duration_s"].to_numpy(np.float64)
    median = float(np.median(d)) if n else None
    threshold = median * SLOW_FACTOR if median else None
    secs = np.zeros((n, len(CAUSE_ORDER)))
    by_rank = {}
    for e in compiles:
        by_rank.setdefault(e["rank"], []).append(e)
    if by_rank and n:
        groups = st.groupby("rank", sort=False).indices
        s0, s1 = st["start_s"].to_numpy(np.float64), st["end_s"].to_numpy(np.float64)
        for rank, events in by_rank.items():
            idx = groups.get(rank)
            if idx is None:
                continue
            a, b = s0[idx], s1[idx]
            for e in events:
                ov = np.minimum(b, e["end_s"]) - np.maximum(a, e["start_s"])
                hit = ov > 0
                if hit.any():
                    col = CAUSE_ORDER.index(COMPILE_CAUSE.get(e["kind"], "compile"))
                    secs[idx[hit], col] += ov[hit]
    if len(gc) and n:
        g = st[["rank", "step"]].merge(gc, on=["rank", "step"], how="left")["gc"].to_numpy(np.float64)
        # the first GC aggregate also holds collections from before step 0: clamp to the step
        secs[:, -1] = np.minimum(np.nan_to_num(g), d)
    compile_s = secs[:, :-1].sum(axis=1)
    slow = (d > threshold) if threshold else np.zeros(n, bool)
    best = secs.argmax(axis=1) if n else np.zeros(0, np.int64)
    best_s = secs[np.arange(n), best] if n else np.zeros(0)
    excess = d - (median or 0.0)
    # a cause when an event covers a good part of the step (every step compiling is as much a
    # finding as one slow step), or when a slow step's excess is mostly that event
    named = (best_s > 0) & ((best_s >= CAUSE_SHARE * d) | (slow & (best_s >= 0.25 * excess)))
    first_step = st.groupby("rank", sort=False)["step"].transform("min").to_numpy() if n else []
    cause = np.where(named, np.array(CAUSE_ORDER, dtype=object)[best],
                     np.where(slow, np.where(st["step"].to_numpy() == first_step, "warmup",
                                             "unexplained"), "normal"))
    st["compile_s"] = compile_s
    st["gc_s"] = secs[:, -1]
    st["slow"] = slow
    st["cause"] = pd.Series(cause, index=st.index, dtype=object)
    return median, threshold


def _timeline_ranks(st, worst_rank):
    """The ranks drawn step by step: all of them up to MAX_TIMELINE_RANKS; beyond, the first
    rank, the worst step's rank and the ranks with the slowest median step (in rank order)."""
    ranks = list(dict.fromkeys(st["rank"]))
    if len(ranks) <= MAX_TIMELINE_RANKS:
        return ranks
    medians = st.groupby("rank", sort=False)["duration_s"].median().sort_values(ascending=False,
                                                                               kind="stable")
    keep = {ranks[0]} | ({worst_rank} if worst_rank is not None else set())
    for r in medians.index:
        if len(keep) >= MAX_TIMELINE_RANKS:
            break
        keep.add(r)
    return [r for r in ranks if r in keep]


def _rows_of(st, ranks):
    """{rank: [step dicts]} of the given ranks (what the charts draw)."""
    sub = st[st["rank"].isin(ranks)]
    out = {r: [] for r in ranks}
    cols = ["step", "start_s", "end_s", "duration_s", "compile_s", "gc_s", "slow", "cause"]
    for rank, group in sub.groupby("rank", sort=False):
        values = {c: group[c].tolist() for c in cols}
        out[rank] = [{"step": int(values["step"][i]), "start_s": values["start_s"][i],
                      "end_s": values["end_s"][i], "duration_s": values["duration_s"][i],
                      "compile_s": values["compile_s"][i], "gc_s": values["gc_s"][i],
                      "slow": bool(values["slow"][i]), "cause": values["cause"][i]}
                     for i in range(len(group))]
    return {r: rows for r, rows in out.items() if rows}


def _gaps_table(st, median):
    """step_gaps over the step table, vectorised (consecutive steps of a rank)."""
    import numpy as np

    if not median or len(st) < 2:
        return []
    floor = max(1.0, 2 * median)
    rank = st["rank"].to_numpy(object)
    same = rank[1:] == rank[:-1]
    start, end, step = (st["start_s"].to_numpy(np.float64), st["end_s"].to_numpy(np.float64),
                        st["step"].to_numpy(np.int64))
    gap = start[1:] - end[:-1]
    out = []
    for i in np.flatnonzero(same & (gap >= floor)):
        out.append({"rank": rank[i], "after_step": int(step[i]), "before_step": int(step[i + 1]),
                    "start_s": float(end[i]), "end_s": float(start[i + 1]), "duration_s": float(gap[i])})
    return out


def _gpu_util_in_windows(run, t0, starts, ends):
    """gpu_util_in_steps over step windows given as arrays, vectorised."""
    import numpy as np
    import pandas as pd

    gpu = run.gpu
    if not len(gpu) or "util" not in gpu or not len(starts):
        return None
    order = np.lexsort((ends, starts))
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)  # the latest end among windows starting at or before
    ts = (pd.to_numeric(gpu["t"], errors="coerce").to_numpy(np.float64) - t0) / 1e9
    util = pd.to_numeric(gpu["util"], errors="coerce").to_numpy(np.float64)
    i = np.searchsorted(starts, ts, side="right") - 1
    ok = ~np.isnan(util) & ~np.isnan(ts) & (i >= 0) & (util != np.inf) & (util != -np.inf)
    ok &= reach[np.maximum(i, 0)] >= ts
    return float(util[ok].mean()) if ok.any() else None


def _compile_events(run, t0):
    out = []
    df = run.compiles
    for c in df.itertuples() if len(df) else []:
        start, end = _num(c.start_ns), _num(c.end_ns)
        if start is None and end is not None:
            start = end - (_num(c.duration_s) or 0) * 1e9
        if start is None:
            continue
        end = end if end is not None else start
        call_site = getattr(c, "fa4_call_site", None)
        out.append({"rank": str(c.rank), "kind": str(c.kind), "kernel": _clip(_text(c.kernel) or "?", 300),
                    "start_s": (start - t0) / 1e9, "end_s": (end - t0) / 1e9,
                    "duration_s": _num(c.duration_s) or (end - start) / 1e9,
                    "thread": _clip(_text(c.thread), 100),
                    # bool, numpy's bool_, or NaN where the event had no such field
                    "is_main_thread": bool(c.is_main_thread) if type(c.is_main_thread).__name__ in ("bool", "bool_")
                    else None,
                    "step": int(c.step) if _num(c.step) is not None else None,
                    "caller": _frame_label(c.caller) if isinstance(c.caller, dict) else "",
                    "key_fields": c.key_fields if isinstance(c.key_fields, dict) else None,
                    "key": _clip(c.key, 600) if isinstance(c.key, str) else None,
                    "call_site": _frame_label(call_site) if isinstance(call_site, dict) else ""})
    out.sort(key=lambda e: e["start_s"])
    # the key diff against the previous compile of the same kernel on the same rank: the field
    # that changes between recompiles is what a user has to fix
    previous = {}
    for e in out:
        prev = previous.get((e["rank"], e["kernel"]))
        e["first"] = prev is None
        e["key_diff"] = []
        if prev is not None and prev["key_fields"] and e["key_fields"]:
            for name in list(dict.fromkeys(list(prev["key_fields"]) + list(e["key_fields"]))):
                before, after = prev["key_fields"].get(name), e["key_fields"].get(name)
                if before != after:
                    e["key_diff"].append({"field": _clip(name, 100), "before": _clip(before, 200),
                                          "after": _clip(after, 200)})
        elif prev is not None and prev["key"] and e["key"] and prev["key"] != e["key"]:
            e["key_diff"].append({"field": "key", "before": prev["key"], "after": e["key"]})
        if prev is not None and not e["key_diff"]:
            # the same key text compiled again: the key holds objects compared by identity, such
            # as a tensor (a new one every call), so the in-memory cache can never hit
            for name, value in (e["key_fields"] or {}).items():
                if re.search(r"(?:\b|Fake|Functional)[Tt]ensor\(", str(value)):
                    e["key_diff"].append({"field": _clip(name, 100), "before": _clip(value, 200),
                                          "after": "a new tensor object: the key never matches"})
        previous[(e["rank"], e["kernel"])] = e
    for e in out:
        e.pop("key_fields")
    return out


def compile_groups(compiles):
    """Compile events per kernel: how often, how long, in which steps and threads, and which key
    fields changed between its compiles (what a user has to fix)."""
    groups = {}
    for c in compiles:
        g = groups.setdefault((c["rank"], c["kernel"]), {
            "rank": c["rank"], "kernel": c["kernel"], "kind": c["kind"], "count": 0, "total_s": 0.0,
            "steps": [], "threads": [], "changed": {}, "call_site": c["call_site"] or c["caller"]})
        g["count"] += 1
        g["total_s"] += c["duration_s"]
        if c["step"] is not None:
            g["steps"].append(c["step"])
        if c["thread"] and c["thread"] not in g["threads"]:
            g["threads"].append(c["thread"])
        for d in c["key_diff"]:
            g["changed"].setdefault(d["field"], d["after"])
    out = []
    for g in groups.values():
        g["steps"] = _ranges(g["steps"])
        g["changed"] = [{"field": k, "example": v} for k, v in list(g["changed"].items())[:6]]
        g["mean_s"] = g["total_s"] / g["count"]
        out.append(g)
    out.sort(key=lambda g: -g["total_s"])
    return out


def _gc_by_step(run):
    """{(rank, step): seconds in GC} (see _gc_frame)."""
    gc = _gc_frame(run)
    return {(r, int(s)): float(g) for r, s, g in zip(gc["rank"], gc["step"], gc["gc"])}


def _gc_frame(run):
    """(rank, step, gc) seconds in GC per step: the ledger's gc line when the shim timed GC
    pauses as intervals (start-up's collections then stay in start-up, not in step 0), else the
    shim's per-step aggregates (one grouped sum, not a Python loop over every event)."""
    import numpy as np
    import pandas as pd

    def frame(rank, step, gc):
        return pd.DataFrame({"rank": pd.Series(np.asarray(rank).astype(str).astype(object), dtype=object),
                             "step": np.asarray(step, np.int64), "gc": np.asarray(gc, np.float64)})

    try:
        from traindx import ledger as L

        if L.has_spans(run):
            led = run.ledger
            return frame(led["rank"].to_numpy(object), led["step"], led["gc_s"])
    except Exception:
        pass
    gc = run.gc
    if len(gc) and "total_s" in gc and "step" in gc:
        step = pd.to_numeric(gc["step"], errors="coerce")
        total = pd.to_numeric(gc["total_s"], errors="coerce")
        total = total.where(total.abs() != math.inf).fillna(0.0)
        ok = step.notna() & (step.abs() != math.inf)
        table = pd.DataFrame({"rank": gc["rank"][ok].astype(str).to_numpy(object),
                              "step": step[ok].astype("int64"), "total": total[ok]})
        sums = table.groupby(["rank", "step"], sort=False)["total"].sum()
        return frame(sums.index.get_level_values(0), sums.index.get_level_values(1), sums.to_numpy())
    return frame([], [], [])


def _overlap(a0, a1, b0, b1):
    return max(0.0, min(a1, b1) - max(a0, b0))


def classify_steps(step_rows, compiles, gc_by_step):
    """Mark slow steps and name their cause: the recorded event that covers most of the step."""
    all_durations = [s["duration_s"] for rows in step_rows.values() for s in rows]
    median = _median(all_durations)
    threshold = median * SLOW_FACTOR if median else None
    by_rank = {}
    for e in compiles:
        by_rank.setdefault(e["rank"], []).append(e)
    for rank, rows in step_rows.items():
        events = by_rank.get(rank, [])
        # events by start; a step only looks at those starting within the longest event's
        # length before it (O(steps x log events), not steps x events)
        order = sorted(range(len(events)), key=lambda i: events[i]["start_s"])
        starts = [events[i]["start_s"] for i in order]
        longest = max((e["end_s"] - e["start_s"] for e in events), default=0.0)
        first_step = min(s["step"] for s in rows) if rows else None
        for s in rows:
            seconds = {}
            lo = bisect.bisect_left(starts, s["start_s"] - longest - 1e-6)
            hi = bisect.bisect_left(starts, s["end_s"])
            for e in (events[i] for i in sorted(order[lo:hi])):  # in record order, as before
                ov = _overlap(s["start_s"], s["end_s"], e["start_s"], e["end_s"])
                if ov > 0:
                    cause = COMPILE_CAUSE.get(e["kind"], "compile")
                    seconds[cause] = seconds.get(cause, 0.0) + ov
            # the first GC aggregate also holds collections from before step 0: clamp to the step
            gc_s = min(gc_by_step.get((rank, s["step"]), 0.0), s["duration_s"])
            if gc_s:
                seconds["gc"] = gc_s
            s["compile_s"] = sum(v for k, v in seconds.items() if k != "gc")
            s["gc_s"] = gc_s
            s["slow"] = bool(threshold and s["duration_s"] > threshold)
            # a cause when an event covers a good part of the step (every step compiling is as much
            # a finding as one slow step), or when a slow step's excess is mostly that event
            best = max(seconds.items(), key=lambda kv: kv[1], default=(None, 0.0))
            excess = s["duration_s"] - (median or 0.0)
            cause = "normal"
            if best[0] and (best[1] >= CAUSE_SHARE * s["duration_s"] or (s["slow"] and best[1] >= 0.25 * excess)):
                cause = best[0]
            elif s["slow"]:
                cause = "warmup" if s["step"] == first_step else "unexplained"
            s["cause"] = cause
    return median, threshold


def step_gaps(step_rows, median):
    """Wall time between one step's end and the next one's start that is long enough to matter
    (evaluation, checkpointing, a profiler export): no step's duration counts it."""
    gaps = []
    if not median:
        return gaps
    floor = max(1.0, 2 * median)
    for rank, rows in step_rows.items():
        for a, b in zip(rows, rows[1:]):
            gap = b["start_s"] - a["end_s"]
            if gap >= floor:
                gaps.append({"rank": rank, "after_step": a["step"], "before_step": b["step"],
                             "start_s": a["end_s"], "end_s": b["start_s"], "duration_s": gap})
    return gaps


def _bin_steps(rows, limit=MAX_STEP_BARS):
    """At most `limit` bars: consecutive steps are merged; a bin's bar is its median step, and its
    slowest step (with the most common slow cause) rides on top, so outliers stay visible."""
    if len(rows) <= limit:
        return rows
    size = math.ceil(len(rows) / limit)
    out = []
    for i in range(0, len(rows), size):
        chunk = rows[i: i + size]
        slow = [s for s in chunk if s["slow"]]
        causes = {}
        for s in slow:
            causes[s["cause"]] = causes.get(s["cause"], 0) + 1
        out.append({"step": chunk[0]["step"], "start_s": chunk[0]["start_s"], "end_s": chunk[-1]["end_s"],
                    "duration_s": _median([s["duration_s"] for s in chunk]),
                    "max_s": max(s["duration_s"] for s in chunk),
                    "cause": max(causes, key=causes.get) if causes else "normal",
                    "slow": bool(slow), "slow_count": len(slow), "binned": len(chunk),
                    "compile_s": sum(s.get("compile_s", 0.0) for s in chunk),
                    "gc_s": sum(s.get("gc_s", 0.0) for s in chunk),
                    "label": f"steps {chunk[0]['step']}–{chunk[-1]['step']}"})
    return out


def _losses(run):
    ls = run.log_steps
    if not len(ls) or "loss" not in ls:
        return {}
    # a line without a step or a loss (a log format that carries only one) is no point of the curve
    return {int(s.step): float(s.loss) for s in ls.itertuples()
            if _num(s.loss) is not None and _num(s.step) is not None}


# -- py-spy: the GIL holder's stacks as an icicle tree, and per-thread GIL shares -----------------
@lru_cache(maxsize=65536)
def _frame_kind(frame, cwd=""):
    """user (the job's own files), library, python (stdlib), traindx (our hooks) or native."""
    f = frame.file or ""
    if not f:
        return "native"
    if "_traindx_shim" in f or "/traindx/" in f:
        return "traindx"  # the profiler's own hooks: not the user's code
    if f.startswith("<"):
        return "python"
    if "site-packages" in f or "dist-packages" in f:
        return "library"
    parts = f.split("/")
    if not f.startswith("/") or (cwd and f.startswith(cwd.rstrip("/") + "/")):
        # under the job's folder, except packages unpacked into hidden folders (.venv, .fa4-b17)
        inside = parts[len(cwd.rstrip("/").split("/")):] if f.startswith("/") else parts
        return "library" if any(p.startswith(".") and p not in (".", "..") for p in inside[:-1]) else "user"
    if re.search(r"/lib/python3\.\d+/", f):
        return "python"
    return "library"  # elsewhere on the machine: an installed package (e.g. /opt/…/site)


_SPEEDSCOPE_THREAD = re.compile(r'^Thread (\d+) "(.*)"$')
_THREAD_ROOT_FRAME = re.compile(r"^thread \(\d+\)|^process \d+:")


def _native_tid(name):
    m = _SPEEDSCOPE_THREAD.match(str(name))
    return m[1] if m else None


def thread_label(name, names=None):
    """py-spy's 'Thread 6263 "MainThread"' -> 'MainThread (6263)'; an empty name is looked up in
    `names` ({native thread id: Python thread name}, from py-spy's dumps)."""
    m = _SPEEDSCOPE_THREAD.match(str(name))
    if not m:
        return str(name)
    label = m[2] or (names or {}).get(m[1])
    return f"{label} ({m[1]})" if label else f"thread {m[1]}"


def flame_tree(threads, min_share=FLAME_MIN_SHARE, max_depth=FLAME_MAX_DEPTH, names=None, cwd=""):
    """{thread: ThreadSamples} -> a tree {name, file, line, kind, value, children}, threads at the
    first level; nodes under min_share of all samples are dropped (their weight stays in the parent)."""
    root = {"name": "all samples", "file": "", "line": 0, "kind": "root", "value": 0, "children": {}}
    for thread, ts in threads.items():
        tnode = root["children"].setdefault(("thread", thread), {
            "name": thread_label(thread, names), "file": "", "line": 0, "kind": "thread", "value": 0,
            "children": {}})
        for stack, weight in zip(ts.stacks, ts.weights):
            root["value"] += weight
            tnode["value"] += weight
            node = tnode
            in_import = False
            for frame in stack[:max_depth]:
                if not frame.file and _THREAD_ROOT_FRAME.match(frame.name):
                    continue  # py-spy's own "thread (id): name" root
                if frame.file.startswith("<frozen importlib"):
                    # a chain of importlib frames says one thing: "importing"; keep one node
                    if in_import:
                        continue
                    in_import = True
                    key = ("(import machinery)", "", 0)
                    kind = "python"
                else:
                    in_import = False
                    key = (frame.name, frame.file, frame.line)
                    kind = _frame_kind(frame, cwd)
                child = node["children"].get(key)
                if child is None:
                    child = node["children"][key] = {"name": key[0], "file": key[1],
                                                     "line": key[2], "kind": kind,
                                                     "value": 0, "children": {}}
                child["value"] += weight
                node = child
    total = root["value"]

    def finish(node):
        kids = [c for c in node["children"].values() if total and c["value"] / total >= min_share]
        kids.sort(key=lambda c: -c["value"])
        return {"name": _clip(node["name"], 300), "file": _clip(node["file"], 300),
                "line": node["line"], "kind": node["kind"], "value": node["value"],
                "children": [finish(c) for c in kids]}

    return finish(root)


def _hottest_path(tree):
    """The heaviest chain of user/library frames under the heaviest thread: the one-line answer to
    'what held the GIL'."""
    path, node = [], tree
    while node["children"]:
        node = node["children"][0]
        if node["kind"] != "thread":
            path.append(node)
    return path


_PACKAGE = re.compile(r"/(?:site-packages|dist-packages|site)/([^/]+)/(?:dsl_packages/([^/]+)/)?")


def _package_of(file):
    """'…/site-packages/torch/autograd/function.py' -> 'torch' (the hand-overs worth showing)."""
    m = _PACKAGE.search(file or "")
    return (m[2] or m[1]) if m else ""


def _condensed(path, keep_last=2, max_lines=12):
    """The hottest path for reading: where it starts, every hand-over between the job's code,
    libraries and the stdlib, and where it ends; the rest elided."""
    keep = set(range(len(path) - keep_last, len(path))) | {0}
    owners = [(n["kind"], _package_of(n["file"])) for n in path]
    for i in range(1, len(path)):
        if owners[i] != owners[i - 1]:
            keep |= {i - 1, i}
    out, last = [], -1
    for i in sorted(k for k in keep if 0 <= k < len(path)):
        if i > last + 1:
            out.append({"name": f"… {i - last - 1} frame{'s' if i - last - 1 > 1 else ''}", "where": "", "kind": "elided"})
        n = path[i]
        out.append({"name": n["name"], "where": f"{n['file']}:{n['line']}" if n["file"] else "", "kind": n["kind"]})
        last = i
    if len(out) > max_lines:
        # deep import chains hand over at every level: keep the start and the innermost end
        head, tail = out[:3], out[-(max_lines - 4):]
        skipped = len(path) - sum(1 for n in head + tail if n["kind"] != "elided")
        out = head + [{"name": f"… {skipped} frames", "where": "", "kind": "elided"}] + \
            [n for n in tail if n["kind"] != "elided" or n is not tail[0]]
    return out


def _thread_names(run, rank):
    """{native thread id: Python thread name} from py-spy's dumps of one rank."""
    d = run.dumps
    if not len(d) or "os_thread_id" not in d:
        return {}
    d = d[(d["rank"] == rank) & d["os_thread_id"].notna()]
    return {str(int(tid)): name for tid, name in zip(d["os_thread_id"], d["thread_name"])
            if isinstance(name, str) and name}


def gil_view(run):
    """Per rank: the --gil recording as a tree and each thread's share of GIL samples."""
    out = []
    recordings = run.pyspy
    cwd = str(run.manifest.get("cwd") or "")
    for rank in sorted({r for r, _ in recordings}, key=lambda r: (len(r), r)):
        gil = recordings.get((rank, "gil"))
        idle = recordings.get((rank, "all")) or {}
        if not gil:
            continue
        names = _thread_names(run, rank)
        idle_by_tid = {_native_tid(n) or n: sum(ts.weights) for n, ts in idle.items()}
        total_gil = sum(sum(ts.weights) for ts in gil.values())
        threads = []
        for name, ts in gil.items():
            held = sum(ts.weights)
            all_samples = idle_by_tid.get(_native_tid(name) or name)
            threads.append({"thread": _clip(thread_label(name, names), 100), "gil_s": held,
                            "share_of_gil": held / total_gil if total_gil else 0.0,
                            # two recorders sample independently: clamp their noise at 100 %
                            "held_while_sampled": min(1.0, held / all_samples) if all_samples else None})
        threads.sort(key=lambda t: -t["gil_s"])
        tree = flame_tree(gil, names=names, cwd=cwd)
        out.append({"rank": rank, "total_s": total_gil, "threads": threads, "tree": tree,
                    "hottest": _condensed(_hottest_path(tree))})
    return out


# -- thread lanes: which thread ran, which held the GIL, around the worst step -------------------
def thread_lanes(run, t0, worst, compiles, step_rows):
    dumps = run.dumps
    if not len(dumps) or worst is None:
        return None
    rank = worst["rank"]
    d = dumps[dumps["rank"] == rank] if rank in set(dumps["rank"]) else dumps
    times = sorted(set(int(t) for t in d["t"]))
    if not times:
        return None
    w0, w1 = t0 + worst["start_s"] * 1e9, t0 + worst["end_s"] * 1e9
    inside = [t for t in times if w0 <= t <= w1]
    if len(inside) >= 3:
        chosen, zoom = inside, "step"
    else:
        # the step is shorter than the snapshot interval: show the whole run, step highlighted
        chosen, zoom = times, "run"
    if len(chosen) > MAX_LANE_SNAPSHOTS:
        stride = math.ceil(len(chosen) / MAX_LANE_SNAPSHOTS)
        chosen = chosen[::stride]
    chosen_set = set(chosen)
    d = d[d["t"].isin(chosen_set)]
    interval = (chosen[-1] - chosen[0]) / max(1, len(chosen) - 1) if len(chosen) > 1 else 1e9
    lanes = {}
    for r in d.itertuples():
        name = r.thread_name if isinstance(r.thread_name, str) and r.thread_name else f"thread {r.thread_id}"
        frames = r.frames if isinstance(r.frames, list) else []
        state = "gil" if r.owns_gil else ("active" if r.active else "idle")
        top = frames[0] if frames else {}
        lanes.setdefault(name, []).append({
            "t_s": (int(r.t) - t0) / 1e9, "state": state,
            "frame": _clip(f"{top.get('name', '?')} ({top.get('filename', '')}:{top.get('line', '')})", 300)
            if top else "",
            "stack": [_clip(f"{f.get('name', '?')} ({os.path.basename(str(f.get('filename', '')))}:{f.get('line', '')})", 200)
                      for f in frames[:8]]})
    threads = []
    for name, snaps in lanes.items():
        segments = []
        for s in snaps:
            if segments and segments[-1]["state"] == s["state"] and segments[-1]["frame"] == s["frame"]:
                segments[-1]["end_s"] = s["t_s"] + interval / 2e9
                continue
            segments.append({"start_s": s["t_s"] - interval / 2e9, "end_s": s["t_s"] + interval / 2e9,
                             "state": s["state"], "frame": s["frame"], "stack": s["stack"]})
        held = sum(1 for s in snaps if s["state"] == "gil")
        threads.append({"name": _clip(name, 100), "segments": segments, "gil_snapshots": held,
                        "active_snapshots": sum(1 for s in snaps if s["state"] != "idle")})
    # busiest first: the GIL holder on top, idle helper threads at the bottom
    threads.sort(key=lambda t: (-t["gil_snapshots"], -t["active_snapshots"], t["name"]))
    lo = chosen[0] / 1e9 - t0 / 1e9 - interval / 2e9
    hi = chosen[-1] / 1e9 - t0 / 1e9 + interval / 2e9
    if zoom == "step":
        lo, hi = min(lo, worst["start_s"]), max(hi, worst["end_s"])
    window_compiles = [c for c in compiles if c["rank"] == rank and c["end_s"] >= lo and c["start_s"] <= hi]
    steps_in_window = [{"step": s["step"], "start_s": s["start_s"], "end_s": s["end_s"], "cause": s["cause"]}
                       for s in step_rows.get(rank, []) if s["end_s"] >= lo and s["start_s"] <= hi]
    return {"rank": rank, "zoom": zoom, "step": worst["step"], "steps": steps_in_window[:MAX_STEP_BARS], "step_start_s": worst["start_s"],
            "step_end_s": worst["end_s"], "start_s": lo, "end_s": hi,
            "snapshots": len(chosen), "interval_s": interval / 1e9, "threads": threads[:24],
            "compiles": [{"thread": c["thread"], "start_s": c["start_s"], "end_s": c["end_s"],
                          "kernel": c["kernel"]} for c in window_compiles[:200]]}


# -- GPU metrics ---------------------------------------------------------------------------------
def _downsample(xs, ys, limit=MAX_GPU_POINTS):
    """Min/max per bucket so spikes and dips survive the reduction."""
    if len(xs) <= limit:
        return list(xs), list(ys)
    size = math.ceil(len(xs) / (limit // 2))
    ox, oy = [], []
    for i in range(0, len(xs), size):
        cx, cy = xs[i: i + size], ys[i: i + size]
        pairs = [(x, y) for x, y in zip(cx, cy) if y is not None]
        if not pairs:
            continue
        lo = min(pairs, key=lambda p: p[1])
        hi = max(pairs, key=lambda p: p[1])
        for p in sorted({lo, hi}):
            ox.append(p[0])
            oy.append(p[1])
    return ox, oy


CLOCK_REASONS = {0x1: "GPU idle", 0x4: "power cap", 0x8: "HW slowdown", 0x20: "SW thermal",
                 0x40: "HW thermal", 0x80: "power brake"}


def gpu_util_in_steps(run, t0, step_rows):
    """Mean NVML utilization over the samples taken while a step ran (start-up excluded)."""
    gpu = run.gpu
    if not len(gpu) or "util" not in gpu or not step_rows:
        return None
    windows = sorted((s["start_s"], s["end_s"]) for rows in step_rows.values() for s in rows)
    starts = [a for a, _ in windows]
    # the latest end among windows starting at or before each one (ranks' steps overlap)
    reach, furthest = [], float("-inf")
    for _, b in windows:
        furthest = max(furthest, b)
        reach.append(furthest)
    values = []
    for t, u in zip(gpu["t"], gpu["util"]):
        ts, u = (int(t) - t0) / 1e9, _num(u)
        i = bisect.bisect_right(starts, ts) - 1
        if u is not None and i >= 0 and reach[i] >= ts:
            values.append(u)
    return sum(values) / len(values) if values else None


def gpu_view(run, t0):
    gpu = run.gpu
    if not len(gpu):
        why = (run.missing or {}).get("nvml") or (run.missing or {}).get("gpus")
        return {"available": False,
                "reason": _clip(str(why).splitlines()[0], 300) if why else "no GPU samples were recorded"}
    series = []
    for index, g in gpu.groupby("gpu") if "gpu" in gpu else [(0, gpu)]:
        g = g.sort_values("t")
        ts = [(int(t) - t0) / 1e9 for t in g["t"]]
        entry = {"gpu": int(index) if _num(index) is not None else str(index), "metrics": {}}
        for col, label, unit in (("util", "utilization", "%"), ("sm_clock_mhz", "SM clock", "MHz"),
                                 ("power_w", "power", "W")):
            if col in g:
                xs, ys = _downsample(ts, [_num(v) for v in g[col]])
                if any(y is not None for y in ys):
                    entry["metrics"][col] = {"label": label, "unit": unit, "t_s": xs, "values": ys}
        reasons = {}
        if "clock_event_reasons" in g:
            for v in g["clock_event_reasons"]:
                v = _num(v)
                for bit, name in CLOCK_REASONS.items():
                    if v is not None and int(v) & bit:
                        reasons[name] = reasons.get(name, 0) + 1
        entry["throttle"] = {k: v / len(g) for k, v in reasons.items()}
        util = [_num(v) for v in g["util"]] if "util" in g else []
        entry["mean_util"] = sum(u for u in util if u is not None) / max(1, sum(u is not None for u in util)) if util else None
        series.append(entry)
    # clock throttling, one line per distinct pattern rather than one per GPU
    throttle = {}
    for e in series:
        for reason, share in e["throttle"].items():
            throttle.setdefault((reason, round(share, 2)), []).append(e["gpu"])
    notes = [{"reason": reason, "share": share, "gpus": _ranges(g) if all(isinstance(x, int) for x in g)
              else ", ".join(map(str, g))} for (reason, share), g in sorted(throttle.items(), key=lambda kv: -kv[0][1])]
    return {"available": True, "series": series, "throttle": notes}


# -- the time ledger -------------------------------------------------------------------------------
def ledger_view(run, rank=None):
    """The time ledger of one rank (the given one, else the slowest by mean step): per-step
    stacked parts (binned beyond MAX_STEP_BARS), the run total per category, start-up, and the
    one-line breakdown of the steady steps."""
    from traindx import ledger as L

    led = run.ledger
    if not len(led):
        return {"available": False}
    if rank is None:
        means = led.groupby("rank")["wall_s"].mean()
        rank = means.idxmax()
    mine = run.rank_rows("ledger", rank).sort_values("step")
    cats = [c for c in L.CATEGORIES + ("unexplained",) if float(mine[f"{c}_s"].sum()) > 0]
    bin_size = max(1, math.ceil(len(mine) / MAX_STEP_BARS))
    bars = []
    for i in range(0, len(mine), bin_size):
        chunk = mine.iloc[i:i + bin_size]
        bars.append({"step": int(chunk["step"].iloc[0]), "last_step": int(chunk["step"].iloc[-1]),
                     "wall_s": float(chunk["wall_s"].mean()),
                     "parts": {c: float(chunk[f"{c}_s"].mean()) for c in cats}})
    total = {c: float(mine[f"{c}_s"].sum()) for c in cats}
    startup = run.startup_ledger
    startup = startup[startup["rank"] == rank]
    start = None
    if len(startup):
        row = startup.iloc[0]
        start = {"wall_s": float(row["wall_s"]),
                 "parts": {c: float(row[f"{c}_s"]) for c in L.CATEGORIES + ("unexplained",)
                           if float(row[f"{c}_s"]) > 0}}
    steady = L.steady_rows(run, rank)
    return {"available": True, "rank": str(rank), "categories": cats,
            "labels": {c: L.LABELS[c] for c in L.CATEGORIES + ("unexplained",)},
            "bars": bars, "bin_size": bin_size, "total": total,
            "total_wall_s": float(mine["wall_s"].sum()), "startup": start,
            "line": L.breakdown_text(steady if len(steady) else mine),
            "ranks": int(led["rank"].nunique())}


def _ledger_mean_step(run):
    """The mean steady step of the slowest rank, from the ledger (None without steps)."""
    try:
        from traindx import ledger as L

        steady = L.steady_rows(run)
        return float(steady.groupby("rank")["wall_s"].mean().max()) if len(steady) else None
    except Exception:
        return None


# -- findings -------------------------------------------------------------------------------------
def rank_for_report(findings):
    """Root causes before symptoms (each symptom right under its cause), problems before
    information, then by seconds lost per step, then by severity."""
    def key(f):
        return (f.severity == "info", -(f.seconds_lost_per_step or 0.0), -SEVERITIES.index(f.severity))

    roots = sorted((f for f in findings if getattr(f, "cause", None) is None), key=key)
    symptoms = sorted((f for f in findings if getattr(f, "cause", None) is not None), key=key)
    out, placed = [], set()
    for root in roots:
        out.append(root)
        for i, sym in enumerate(symptoms):
            if i not in placed and sym.cause == root.id and (
                    not root.ranks or not sym.ranks or set(root.ranks) & set(sym.ranks)):
                out.append(sym)
                placed.add(i)
    return out + [sym for i, sym in enumerate(symptoms) if i not in placed]


def prescription_text(p):
    """A copyable command or diff for a prescription, from its `change` when it has no command."""
    if p.command:
        return p.command, "command"
    change = p.change or {}
    lines = []
    kind = "command"
    if "env" in change:
        lines += [f"export {k}={shlex.quote(str(v))}" for k, v in change["env"].items()]
    if "arg" in change:
        arg = change["arg"] or {}
        flags = " ".join(f"{k} {shlex.quote(str(v))}" if v not in (None, "", True) else k
                         for k, v in (arg.get("set") or {}).items())
        lines.append(f"# {arg.get('framework', 'job')} arguments: {flags}")
    if "upgrade" in change:
        up = change["upgrade"] or {}
        spec = f"{up.get('package')}>={up['min_version']}" if up.get("min_version") else up.get("package")
        lines.append(f"pip install -U {shlex.quote(str(spec))}")
    if "precompile" in change:
        pre = change["precompile"] or {}
        lines.append(f"kernel-cache warm --from-run {shlex.quote(str(pre.get('from_run', '<run>')))}")
    if "code" in change:
        code = change["code"] or {}
        kind = "diff"
        lines.append(f"--- {code.get('file', '?')}:{code.get('line', '?')}")
        lines.append(f"+++ {code.get('file', '?')}:{code.get('line', '?')}")
        lines += [f"-{l}" for l in str(code.get("before", "")).splitlines()]
        lines += [f"+{l}" for l in str(code.get("after", "")).splitlines()]
    return ("\n".join(lines), kind) if lines else (None, None)


def _evidence_items(evidence):
    """A finding's evidence dict as render-ready items: text, key/value, table or preformatted.
    Empty values are left out; lists of numbers are shown inline."""
    items = []
    for key, value in (evidence or {}).items():
        label = str(key).replace("_", " ")
        if value is None or value == "" or value == [] or value == {}:
            continue
        if isinstance(value, list) and all(isinstance(v, dict) for v in value):
            columns = list(dict.fromkeys(k for v in value[:MAX_EVIDENCE_ROWS] for k in v))[:8]
            rows = [[_cell(v.get(c)) for c in columns] for v in value[:MAX_EVIDENCE_ROWS]]
            items.append({"label": label, "type": "table", "columns": [c.replace("_", " ") for c in columns],
                          "rows": rows, "more": max(0, len(value) - MAX_EVIDENCE_ROWS)})
        elif isinstance(value, (list, tuple)) and all(not isinstance(v, (dict, list)) for v in value):
            shown = ", ".join(_cell(v) for v in value[:MAX_EVIDENCE_ROWS])
            more = f" … ({len(value)} values)" if len(value) > MAX_EVIDENCE_ROWS else ""
            items.append({"label": label, "type": "text", "text": _clip(shown + more, 2000)})
        elif isinstance(value, dict) and ("file" in value or "filename" in value) and "line" in value:
            items.append({"label": label, "type": "text", "text": _frame_label(value)})
        elif isinstance(value, dict) and all(not isinstance(v, (dict, list)) for v in value.values()):
            items.append({"label": label, "type": "kv",
                          "pairs": [[_clip(k, 200), _cell(v)] for k, v in list(value.items())[:40]]})
        elif isinstance(value, (dict, list)):
            items.append({"label": label, "type": "pre",
                          "text": _clip(json.dumps(value, indent=1, default=str), 4000)})
        elif isinstance(value, str) and ("\n" in value or len(value) > 160):
            items.append({"label": label, "type": "pre", "text": _clip(value, 4000)})
        else:
            items.append({"label": label, "type": "text", "text": _cell(value)})
    return items


def _cell(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict) and ("file" in value or "filename" in value):
        return _frame_label(value)
    if isinstance(value, (dict, list)):
        return _clip(json.dumps(value, default=str), 400)
    return _clip("" if value is None else value, 400)


def _finding_view(f, compiles):
    prescriptions = []
    for p in f.prescriptions:
        text, kind = prescription_text(p)
        prescriptions.append({"kind": p.kind, "summary": _clip(p.summary, 600), "text": text and _clip(text, 4000),
                              "text_kind": kind, "expected_gain_s": p.expected_gain_s_per_step,
                              "automatic": p.automatic})
    related = []
    if f.analyzer in ("jit", "compile", "autotune", "dynamo") or "compile" in f.id:
        kernels = set()
        for key in ("kernel", "kernels"):
            v = (f.evidence or {}).get(key)
            if isinstance(v, str):
                kernels.add(v)
            elif isinstance(v, list):
                kernels |= {str(k) for k in v}
        related = [c for c in compiles if not kernels or c["kernel"] in kernels
                   or any(k in c["kernel"] for k in kernels)]
        steps = set(f.steps_affected)
        if steps and not kernels:
            related = [c for c in related if c["step"] in steps] or related
    return {
        "id": _clip(f.id, 200), "anchor": re.sub(r"[^a-zA-Z0-9_-]", "-", f.id),
        "title": _clip(f.title, 300), "severity": f.severity, "analyzer": _clip(f.analyzer, 100),
        "summary": _clip(f.summary, 3000), "seconds_lost_per_step": f.seconds_lost_per_step,
        "share_of_step": f.share_of_step, "steps_affected": _ranges(f.steps_affected),
        "n_steps_affected": len(f.steps_affected), "ranks": [str(r) for r in f.ranks],
        "prescriptions": prescriptions, "evidence": _evidence_items(f.evidence),
        "compiles": related[:FINDING_COMPILE_ROWS],
        "compiles_more": max(0, len(related) - FINDING_COMPILE_ROWS),
        "compile_groups": compile_groups(related) if len(related) > FINDING_COMPILE_ROWS else [],
        "shows_gil": f.analyzer in ("gil", "jit") or "gil" in f.id,
        "cause": getattr(f, "cause", None),
        "cause_anchor": re.sub(r"[^a-zA-Z0-9_-]", "-", f.cause) if getattr(f, "cause", None) else None,
        "symptoms": list(getattr(f, "symptoms", ()) or ()),
    }


def verdict(findings_view, median_step, cause_counts=None, steps=(), mean_step=None,
            step_totals=None):
    """The one change to make: the first finding (ranked) with a prescription and a loss.
    Savings are per mean step (the ledger's lines): the speed-up is against the mean steady
    step when the ledger gives one, else the median."""
    for f in findings_view:
        if f["severity"] == "info" or not f["prescriptions"] or f.get("cause"):
            continue  # the headline is a root cause, never a symptom
        p = f["prescriptions"][0]
        gain = p["expected_gain_s"] if p["expected_gain_s"] is not None else f["seconds_lost_per_step"]
        speedup = None
        if mean_step and gain and gain <= mean_step:
            median_step = mean_step
        if gain and median_step and 0 < gain < median_step:
            speedup = median_step / (median_step - gain)
        share = f["share_of_step"]
        return {"kind": "change", "headline": p["summary"], "finding_title": f["title"],
                "share_of_step": share,
                "finding_anchor": f["anchor"], "severity": f["severity"], "gain_s": gain,
                "speedup": speedup, "median_step_s": median_step,
                "after_step_s": (median_step - gain) if speedup else None,
                "text": p["text"], "text_kind": p["text_kind"], "automatic": p["automatic"]}
    problems = [f for f in findings_view if f["severity"] != "info" and not f.get("cause")]
    if problems:
        f = problems[0]
        return {"kind": "problem", "headline": f["title"], "finding_title": f["title"],
                "finding_anchor": f["anchor"], "severity": f["severity"],
                "gain_s": f["seconds_lost_per_step"], "speedup": None, "median_step_s": median_step,
                "after_step_s": None, "text": None, "text_kind": None, "automatic": False}
    # no analyzer flagged anything, yet the evidence may still show where the time went
    explained = {c: n for c, n in (cause_counts or {}).items() if c not in ("normal", "warmup", "unexplained")}
    if step_totals is not None:  # the same sums, taken over the step table (report._core)
        total_s = step_totals["total_s"]
        seconds = {c: float(step_totals["seconds"].get(c, 0.0)) for c in explained}
    else:
        total_s = sum(s["duration_s"] for s in steps)
        seconds = {c: sum(s["compile_s"] if c != "gc" else s["gc_s"] for s in steps if s["cause"] == c)
                   for c in explained}
    # worth a headline only when it is a real share of the run's step time (not one slow first step)
    explained = {c: n for c, n in explained.items() if total_s and seconds[c] >= EVIDENCE_SHARE * total_s}
    if explained:
        cause = max(explained, key=lambda c: seconds[c])
        n_steps = (step_totals["n_steps"] if step_totals is not None
                   else len({(s["rank"], s["step"]) for s in steps})) or 1
        return {"kind": "evidence", "headline": f"{explained[cause]} of {n_steps} steps spent most of their "
                f"time in {CAUSES[cause]} ({_seconds_text(seconds[cause])} in all)",
                "finding_title": None, "finding_anchor": None, "severity": "medium",
                "gain_s": None, "speedup": None, "median_step_s": median_step, "after_step_s": None,
                "text": None, "text_kind": None, "automatic": False}
    if not steps:
        return {"kind": "nosteps", "headline": "No training steps were recorded: nothing to measure",
                "finding_title": None, "finding_anchor": None, "severity": "info", "gain_s": None,
                "speedup": None, "median_step_s": None, "after_step_s": None, "text": None,
                "text_kind": None, "automatic": False}
    return {"kind": "healthy", "headline": "No slowdown found: nothing to change",
            "finding_title": None, "finding_anchor": None, "severity": "info", "gain_s": None,
            "speedup": None, "median_step_s": median_step, "after_step_s": None, "text": None,
            "text_kind": None, "automatic": False}


def _seconds_text(seconds):
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1e3:.0f} ms"


# -- before/after ---------------------------------------------------------------------------------
def comparison_view(comparison):
    """Any mapping the --fix loop passes: arms side by side, other keys as facts. Generic on
    purpose: whatever keys are present are shown."""
    if not comparison:
        return None
    comparison = dict(comparison)
    arms = comparison.pop("arms", None)
    if arms is None and isinstance(comparison.get("baseline"), dict) and isinstance(comparison.get("candidate"), dict):
        arms = {"baseline": comparison.pop("baseline"), "candidate": comparison.pop("candidate")}
    if isinstance(arms, list):
        arms = {str(a.get("name", f"arm {i}")): a for i, a in enumerate(arms) if isinstance(a, dict)}
    arm_names = list(arms or {})
    rows = []
    if arms:
        keys = list(dict.fromkeys(k for a in arms.values() for k in a if k != "name"))
        for k in keys:
            rows.append({"label": str(k).replace("_", " "),
                         "values": [_fmt_value(arms[n].get(k)) for n in arm_names]})
    headline = comparison.pop("verdict", None)
    facts = []
    for k, v in comparison.items():
        if isinstance(v, dict):
            facts.append({"label": str(k).replace("_", " "), "pairs":
                          [[str(kk).replace("_", " "), _fmt_value(vv)] for kk, vv in v.items()]})
        else:
            facts.append({"label": str(k).replace("_", " "), "value": _fmt_value(v)})
    return {"arms": [_clip(n, 100) for n in arm_names], "rows": rows, "facts": facts,
            "verdict": _clip(headline, 500) if headline is not None else None}


def _fmt_value(v):
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v):
        return f"[{v[0]:.4g}, {v[1]:.4g}]"
    if isinstance(v, (dict, list)):
        return _clip(json.dumps(v, default=str), 400)
    return _clip("" if v is None else v, 400)


# -- everything -----------------------------------------------------------------------------------
def _core(run, findings):
    """What both the terminal summary and the HTML report need."""
    meta = run_meta(run)
    t0 = run.manifest.get("start_ns") or (run.t_min or 0)
    import numpy as np

    # every step of every rank as columns (a thousand ranks: millions of steps); only the ranks
    # the charts draw become per-step dicts
    st, step_source = _step_table(run, t0)
    compiles = _compile_events(run, t0)
    median, threshold = classify_table(st, compiles, _gc_frame(run))
    durations = st["duration_s"].to_numpy(np.float64)
    worst = None
    if len(st):
        w = st.iloc[int(np.argmax(durations))]
        worst = {"step": int(w["step"]), "start_s": float(w["start_s"]), "end_s": float(w["end_s"]),
                 "duration_s": float(w["duration_s"]), "compile_s": float(w["compile_s"]),
                 "gc_s": float(w["gc_s"]), "slow": bool(w["slow"]), "cause": w["cause"],
                 "rank": w["rank"]}
    # steady state: skip the first step of each rank (warm-up) when there is more than one
    later = st.groupby("rank", sort=False).cumcount().to_numpy() > 0 if len(st) else np.zeros(0, bool)
    steady = durations[later] if later.any() else durations
    steady_median = float(np.median(steady)) if len(steady) else None
    mean = float(steady.mean()) if len(steady) else None
    cv = float(np.sqrt(((steady - mean) ** 2).mean()) / mean) if len(steady) and mean else None
    causes = st["cause"][st["cause"] != "normal"] if len(st) else st.get("cause", [])
    cause_counts = {c: int(n) for c, n in causes.value_counts(sort=False).items()} if len(causes) else {}
    step_totals = None
    if len(st):
        by_cause = st.assign(sec=np.where(st["cause"].to_numpy() == "gc", st["gc_s"], st["compile_s"])) \
            .groupby("cause", sort=False)["sec"].sum()
        step_totals = {"total_s": float(durations.sum()), "seconds": by_cause.to_dict(),
                       "n_steps": int(len(st[["rank", "step"]].drop_duplicates()))}
    losses = _losses(run)
    gaps = _gaps_table(st, median)
    shown = _timeline_ranks(st, worst["rank"] if worst else None) if len(st) else []
    step_rows = _rows_of(st, shown) if len(st) else {}
    first_rank = st["rank"].iloc[0] if len(st) else None
    first_start = float(st["start_s"].iloc[0]) if len(st) else None
    # missing evidence has its own notice (from the manifest); not repeated as a finding
    findings_view = [_finding_view(f, compiles) for f in rank_for_report(findings)
                     if f.id != "evidence.missing"]
    per_rank = st.groupby("rank", sort=False).size() if len(st) else None
    stats = {"steps": int(per_rank.max()) if per_rank is not None else 0,
             "ranks": (len(per_rank) if per_rank is not None else 0) or len(meta["ranks"]),
             "ranks_drawn": len(step_rows),
             "step_source": step_source, "median_step_s": median, "steady_median_s": steady_median,
             "p90_step_s": float(np.quantile(durations, 0.9)) if len(durations) else None,
             "max_step_s": float(durations.max()) if len(durations) else None,
             "cv": cv, "slow_steps": int(st["slow"].sum()) if len(st) else 0, "slow_threshold_s": threshold,
             "unexplained_steps": cause_counts.get("unexplained", 0),
             "compiles": len(compiles), "compile_s": sum(c["duration_s"] for c in compiles),
             "worst_step": {"rank": worst["rank"], "step": worst["step"], "duration_s": worst["duration_s"],
                            "cause": worst["cause"]} if worst else None,
             "final_loss": losses[max(losses)] if losses else None,
             "startup_s": first_start,
             "gpu_util_in_steps": _gpu_util_in_windows(run, t0, st["start_s"].to_numpy(np.float64),
                                                       st["end_s"].to_numpy(np.float64)),
             "gap_s": sum(g["duration_s"] for g in gaps if g["rank"] == first_rank),
             "longest_gap": max((g for g in gaps if g["rank"] == first_rank),
                                key=lambda g: g["duration_s"], default=None)}
    try:
        ledger = ledger_view(run)
    except Exception as exc:  # the report still renders without its ledger
        ledger = {"available": False, "error": f"{type(exc).__name__}: {exc}"}
    stats["ledger_line"] = ledger.get("line")
    stats["startup_line"] = None
    if ledger.get("available") and len(run.startup_ledger):
        from traindx.ledger import startup_text

        start = run.startup_ledger
        start = start[start["rank"] == ledger["rank"]] if (start["rank"] == ledger["rank"]).any() else start
        stats["startup_line"] = startup_text(start.iloc[0])
    missing = missing_evidence(run)
    core = {"run": meta, "ledger": ledger, "missing": missing, "missing_summary": missing_summary(missing),
            "verdict": verdict(findings_view, steady_median, cause_counts,
                               mean_step=_ledger_mean_step(run), step_totals=step_totals), "stats": stats,
            "findings": findings_view, "causes": CAUSES}
    return core, {"t0": t0, "step_rows": step_rows, "compiles": compiles, "worst": worst,
                  "step_table": st, "cause_counts": cause_counts, "losses": losses,
                  "gaps": gaps}


MAX_GIL_RANKS = 8             # icicles drawn; a 64-rank job would otherwise outgrow the size budget


def _worst_rank_first(per_rank, worst):
    if worst:
        per_rank = sorted(per_rank, key=lambda g: g["rank"] != worst["rank"])
    return per_rank[:MAX_GIL_RANKS]


def build_summary(run, findings):
    """The verdict, headline numbers and ranked findings: what the terminal prints."""
    return _core(run, findings)[0]


def build_report_data(run, findings, comparison=None):
    """Everything the HTML report shows, as plain JSON-able values."""
    data, x = _core(run, findings)
    t0, step_rows, compiles, st = x["t0"], x["step_rows"], x["compiles"], x["step_table"]
    compile_s, compile_n = {}, {}
    for c in compiles:
        compile_s[c["rank"]] = compile_s.get(c["rank"], 0.0) + c["duration_s"]
        compile_n[c["rank"]] = compile_n.get(c["rank"], 0) + 1
    ranks_summary = []
    if len(st):
        g = st.groupby("rank", sort=False)
        table = g["duration_s"].agg(["size", "median", "max"])
        table["p90"] = g["duration_s"].quantile(0.9)
        table["slow"] = g["slow"].sum()
        for rank, r in table.iterrows():
            ranks_summary.append({"rank": rank, "steps": int(r["size"]), "median_s": float(r["median"]),
                                  "p90_s": float(r["p90"]), "max_s": float(r["max"]),
                                  "compile_s": compile_s.get(rank, 0.0), "compiles": compile_n.get(rank, 0),
                                  "slow_steps": int(r["slow"])})
    end_s = max([data["run"]["duration_s"] or 0.0] + ([float(st["end_s"].max())] if len(st) else [])
                + [c["end_s"] for c in compiles])
    log = run.log
    log_tail = [{"t_s": (int(r.t) - t0) / 1e9, "stream": r.stream, "text": _clip(r.text, 500)}
                for r in log.tail(MAX_LOG_LINES).itertuples()] if len(log) else []
    data.update({
        "timeline": {"end_s": end_s, "ranks": {r: _bin_steps(rows) for r, rows in step_rows.items()},
                     "ranks_total": data["stats"]["ranks"],
                     "cause_counts": x["cause_counts"], "gaps": x["gaps"][:200],
                     # start-up and gaps taking most of the run squeeze the steps: show them by step
                     "default_view": "step" if end_s and ((data["stats"]["startup_s"] or 0)
                                                          + data["stats"]["gap_s"]) > 0.5 * end_s else "time",
                     "bin_size": max((math.ceil(len(r) / MAX_STEP_BARS) for r in step_rows.values()), default=1),
                     "losses": x["losses"] if len(x["losses"]) <= MAX_STEP_BARS else {}},
        "compiles": compiles[:MAX_COMPILE_ROWS],
        "compiles_total": len(compiles),
        "compile_groups": compile_groups(compiles),
        "gil": _worst_rank_first(gil_view(run), x["worst"]),
        "lanes": thread_lanes(run, t0, x["worst"], compiles, step_rows),
        "gpu": gpu_view(run, t0),
        "ranks_summary": ranks_summary,
        "log_tail": log_tail,
        "comparison": comparison_view(comparison),
    })
    return data
