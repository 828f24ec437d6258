"""The run's merged timeline as Chrome trace JSON, for Perfetto (ui.perfetto.dev) or
chrome://tracing: steps, compile events on the thread that ran them, py-spy's thread snapshots
(who held the GIL), GC per step, the job's losses, NVML metrics as counters, and the
torch.profiler window when there is one, all on one clock (µs since the run started).
"""

import glob
import gzip
import json
import os

from traindx.common.errors import UserError

# one Perfetto "process" per rank for traindx's own tracks; torch.profiler's processes are
# moved into their own pid range so they never collide with ours
RANK_PID_BASE = 1_000_000
GPU_PID = 900_000
TORCH_PID_BASE = 2_000_000
STEPS_TID, COMPILES_TID, GC_TID = 1, 2, 3


def _us(ns, t0):
    return (int(ns) - t0) / 1000.0


def _meta(pid, name, tid=None, thread_name=None, sort=None):
    events = [{"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": name}}]
    if sort is not None:
        events.append(
            {"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": sort}}
        )
    return events


def _thread_meta(pid, tid, name, sort=None):
    events = [{"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}]
    if sort is not None:
        events.append(
            {"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": sort}}
        )
    return events


def _rank_index(ranks, rank):
    try:
        return ranks.index(rank)
    except ValueError:
        return len(ranks)


def build_trace(run, include_torch=True):
    """The trace as a dict ({"traceEvents": [...], ...})."""
    t0 = run.manifest.get("start_ns") or (run.t_min or 0)
    ranks = [str(r) for r in run.ranks]
    events = []
    thread_tids = {}

    def rank_pid(rank):
        pid = RANK_PID_BASE + _rank_index(ranks, str(rank))
        if pid not in thread_tids:
            thread_tids[pid] = {}
            events.extend(_meta(pid, f"rank {rank} (traindx)", sort=_rank_index(ranks, str(rank))))
            events.extend(_thread_meta(pid, STEPS_TID, "optimizer steps", sort=0))
            events.extend(_thread_meta(pid, GC_TID, "garbage collection", sort=2))
        return pid

    def thread_tid(pid, name):
        """A track per Python thread, shared by compile events and py-spy snapshots."""
        tids = thread_tids[pid]
        if name not in tids:
            tids[name] = 10 + len(tids)
            events.extend(_thread_meta(pid, tids[name], f"thread {name}", sort=10 + len(tids)))
        return tids[name]

    steps = run.steps
    for s in steps.itertuples() if len(steps) else []:
        if s.start_ns is None or s.start_ns != s.start_ns:
            continue
        pid = rank_pid(s.rank)
        events.append(
            {
                "ph": "X",
                "pid": pid,
                "tid": STEPS_TID,
                "name": f"step {int(s.step)}",
                "cat": "step",
                "ts": _us(s.start_ns, t0),
                "dur": float(s.duration_s) * 1e6,
                "args": {"step": int(s.step), "duration_s": float(s.duration_s)},
            }
        )

    compiles = run.compiles
    for c in compiles.itertuples() if len(compiles) else []:
        start = c.start_ns if c.start_ns == c.start_ns and c.start_ns is not None else None
        end = c.end_ns if c.end_ns == c.end_ns and c.end_ns is not None else None
        if start is None or end is None:
            continue
        pid = rank_pid(c.rank)
        thread = str(c.thread) if isinstance(c.thread, str) and c.thread else "compiles"
        args = {
            "kind": c.kind,
            "kernel": c.kernel,
            "step": None if c.step != c.step else c.step,
            "caller": c.caller if isinstance(c.caller, dict) else None,
        }
        if isinstance(c.key_fields, dict):
            args["key_fields"] = c.key_fields
        events.append(
            {
                "ph": "X",
                "pid": pid,
                "tid": thread_tid(pid, thread),
                "name": f"compile {c.kernel}",
                "cat": f"compile,{c.kind}",
                "ts": _us(start, t0),
                "dur": (int(end) - int(start)) / 1000.0,
                "args": args,
            }
        )

    gc = run.gc
    if len(gc) and len(steps):
        ends = {(str(s.rank), int(s.step)): int(s.end_ns) for s in steps.itertuples()}
        for g in gc.itertuples():
            if g.step != g.step:
                continue
            end = ends.get((str(g.rank), int(g.step)))
            if end is None:
                continue
            pid = rank_pid(g.rank)
            events.append(
                {
                    "ph": "X",
                    "pid": pid,
                    "tid": GC_TID,
                    "cat": "gc",
                    "name": f"gc gen {int(g.generation)} ×{int(g.count)}",
                    "ts": _us(end, t0) - float(g.total_s) * 1e6,
                    "dur": float(g.total_s) * 1e6,
                    "args": {
                        "step": int(g.step),
                        "generation": int(g.generation),
                        "collections": int(g.count),
                        "total_s": float(g.total_s),
                        "note": "per-step total, drawn at the step's end",
                    },
                }
            )

    # py-spy snapshots: each lasts until the next one of the same rank
    dumps = run.dumps
    if len(dumps):
        for rank, d in dumps.groupby("rank"):
            pid = rank_pid(rank)
            times = sorted({int(t) for t in d["t"]})
            nxt = dict(zip(times, times[1:]))
            gap = (times[-1] - times[0]) / max(1, len(times) - 1) if len(times) > 1 else 1e9
            for r in d.itertuples():
                name = (
                    r.thread_name
                    if isinstance(r.thread_name, str) and r.thread_name
                    else f"thread {r.thread_id}"
                )
                frames = r.frames if isinstance(r.frames, list) else []
                state = "holds GIL" if r.owns_gil else ("running" if r.active else "idle")
                top = frames[0].get("name", "?") if frames else "?"
                dur = (nxt.get(int(r.t), int(r.t) + gap) - int(r.t)) / 1000.0
                events.append(
                    {
                        "ph": "X",
                        "pid": pid,
                        "tid": thread_tid(pid, name),
                        "cat": "py-spy",
                        "name": f"{state}: {top}",
                        "ts": _us(r.t, t0),
                        "dur": dur,
                        "args": {
                            "owns_gil": bool(r.owns_gil),
                            "active": bool(r.active),
                            "stack": [
                                f"{f.get('name')} ({f.get('filename')}:{f.get('line')})" for f in frames[:30]
                            ],
                        },
                    }
                )

    ls = run.log_steps
    if len(ls):
        pid = rank_pid(ranks[0] if ranks else "0")
        for s in ls.itertuples():
            if s.loss == s.loss and s.loss is not None:
                events.append(
                    {
                        "ph": "C",
                        "pid": pid,
                        "tid": 0,
                        "name": "loss",
                        "ts": _us(s.t, t0),
                        "args": {"loss": float(s.loss)},
                    }
                )

    gpu = run.gpu
    if len(gpu):
        events.extend(_meta(GPU_PID, "GPUs (NVML)", sort=-1))
        for r in gpu.itertuples():
            index = int(r.gpu) if r.gpu == r.gpu else 0
            for col, label in (("util", "util %"), ("sm_clock_mhz", "SM clock MHz"), ("power_w", "power W")):
                value = getattr(r, col, None)
                if value is not None and value == value:
                    events.append(
                        {
                            "ph": "C",
                            "pid": GPU_PID,
                            "tid": 0,
                            "name": f"GPU {index} {label}",
                            "ts": _us(r.t, t0),
                            "args": {label: float(value)},
                        }
                    )

    if include_torch:
        events.extend(_torch_profiler_events(run.path, t0, ranks))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "traindx_run": run.path,
            "time_origin_ns": t0,
            "command": " ".join(str(c) for c in run.command),
        },
    }


def _torch_profiler_events(run_path, t0, ranks):
    """Kineto's own events, shifted onto the run's clock: its ts is µs after baseTimeNanoseconds,
    a time.time_ns() value."""
    out = []
    for n, path in enumerate(sorted(glob.glob(os.path.join(run_path, "trace", "*.json*")))):
        rank = os.path.basename(path).split(".")[0]
        try:
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rt", encoding="utf-8") as f:
                doc = json.load(f)
            base = int(doc.get("baseTimeNanoseconds") or 0)
            trace_events = doc["traceEvents"]
        except (OSError, EOFError, ValueError, KeyError, TypeError):
            continue  # a broken optional trace must not cost the rest of the export
        shift_us = (base - t0) / 1000.0
        pid_map = {}
        for e in trace_events:
            if not isinstance(e, dict):
                continue
            e = dict(e)
            pid = e.get("pid", 0)
            if pid not in pid_map:
                pid_map[pid] = TORCH_PID_BASE + n * 1000 + len(pid_map)
                out.extend(
                    _meta(
                        pid_map[pid], f"rank {rank} torch.profiler ({pid})", sort=100 + n * 10 + len(pid_map)
                    )
                )
            e["pid"] = pid_map[pid]
            if e.get("ph") == "M" and e.get("name") == "process_name":
                continue
            if "ts" in e:
                try:
                    e["ts"] = float(e["ts"]) + shift_us
                except (TypeError, ValueError):
                    continue
            out.append(e)
    return out


def export_trace(run, path):
    """Write the merged timeline to `path` (gzip-compressed when it ends in .gz)."""
    trace = build_trace(run)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UserError(f"cannot write {path}: no such folder {parent}")
    tmp = path + ".tmp"
    opener = gzip.open if path.endswith(".gz") else open
    with opener(tmp, "wt", encoding="utf-8") as f:
        json.dump(trace, f, separators=(",", ":"), default=str)
    os.replace(tmp, path)
    return path
