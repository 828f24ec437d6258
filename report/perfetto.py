"""The run's merged timeline as Chrome trace JSON, for Perfetto (ui.perfetto.dev) or
chrome://tracing: steps, compile events on the thread that ran them, py-spy's thread snapshots
(who held the GIL), GC per step, the job's losses, NVML metrics as counters, and the
torch.profiler window when there is one, all on one clock (µs since the run started).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from typing import TYPE_CHECKING, Any

from traindx.common.atomic import replace_with
from traindx.common.errors import UserError

if TYPE_CHECKING:
    from traindx.derive.run import RunRecord

# one Perfetto "process" per rank for traindx's own tracks; torch.profiler's processes are
# moved into their own pid range so they never collide with ours
RANK_PID_BASE = 1_000_000
GPU_PID = 900_000
TORCH_PID_BASE = 2_000_000
STEPS_TID, COMPILES_TID, GC_TID = 1, 2, 3


Event = dict[str, Any]


def _us(ns: float, t0: int) -> float:
    return (int(ns) - t0) / 1000.0


def _meta(pid: int, name: str, sort: int | None = None, tid: int = 0) -> list[Event]:
    """The name and sort index of a process (tid 0) or of one of its threads."""
    what = "thread" if tid else "process"
    events: list[Event] = [
        {"ph": "M", "pid": pid, "tid": tid, "name": f"{what}_name", "args": {"name": name}}
    ]
    if sort is not None:
        events.append(
            {"ph": "M", "pid": pid, "tid": tid, "name": f"{what}_sort_index", "args": {"sort_index": sort}}
        )
    return events


def _rank_index(ranks: list[str], rank: str) -> int:
    try:
        return ranks.index(rank)
    except ValueError:
        return len(ranks)


def _missing(value: Any) -> bool:
    return value is None or value != value  # None or NaN


class _Trace:
    """The events so far; a rank's process and a thread's track are declared (their metadata
    events) where they are first used, so the order of the events is the order of first use."""

    def __init__(self, t0: int, ranks: list[str]) -> None:
        self.t0 = t0
        self.ranks = ranks
        self.events: list[Event] = []
        self.thread_tids: dict[int, dict[str, int]] = {}

    def us(self, ns: float) -> float:
        return _us(ns, self.t0)

    def span(self, pid: int, tid: int, name: str, cat: str, ts: float, dur: float, args: Event) -> None:
        """A complete event ("X"): ts and dur in µs."""
        event = {
            "ph": "X",
            "pid": pid,
            "tid": tid,
            "name": name,
            "cat": cat,
            "ts": ts,
            "dur": dur,
            "args": args,
        }
        self.events.append(event)

    def rank_pid(self, rank: object) -> int:
        pid = RANK_PID_BASE + _rank_index(self.ranks, str(rank))
        if pid not in self.thread_tids:
            self.thread_tids[pid] = {}
            self.events.extend(_meta(pid, f"rank {rank} (traindx)", sort=_rank_index(self.ranks, str(rank))))
            self.events.extend(_meta(pid, "optimizer steps", sort=0, tid=STEPS_TID))
            self.events.extend(_meta(pid, "garbage collection", sort=2, tid=GC_TID))
        return pid

    def thread_tid(self, pid: int, name: str) -> int:
        """A track per Python thread, shared by compile events and py-spy snapshots."""
        tids = self.thread_tids[pid]
        if name not in tids:
            tids[name] = 10 + len(tids)
            self.events.extend(_meta(pid, f"thread {name}", sort=10 + len(tids), tid=tids[name]))
        return tids[name]


def build_trace(run: RunRecord, include_torch: bool = True) -> dict[str, Any]:
    """The trace as a dict ({"traceEvents": [...], ...})."""
    t0 = run.manifest.get("start_ns") or (run.t_min or 0)
    trace = _Trace(t0, [str(r) for r in run.ranks])
    _add_steps(trace, run.steps)
    _add_compiles(trace, run.compiles)
    _add_gc(trace, run.gc, run.steps)
    _add_pyspy_snapshots(trace, run.dumps)
    _add_losses(trace, run.log_steps)
    _add_gpu_counters(trace, run.gpu)
    events = trace.events
    if include_torch:
        events.extend(_torch_profiler_events(run.path, t0, trace.ranks))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "traindx_run": run.path,
            "time_origin_ns": t0,
            "command": " ".join(str(c) for c in run.command),
        },
    }


def _add_steps(trace: _Trace, steps: Any) -> None:
    for s in steps.itertuples() if len(steps) else []:
        if _missing(s.start_ns):
            continue
        args = {"step": int(s.step), "duration_s": float(s.duration_s)}
        pid, dur = trace.rank_pid(s.rank), float(s.duration_s) * 1e6
        trace.span(pid, STEPS_TID, f"step {int(s.step)}", "step", trace.us(s.start_ns), dur, args)


def _add_compiles(trace: _Trace, compiles: Any) -> None:
    for c in compiles.itertuples() if len(compiles) else []:
        if _missing(c.start_ns) or _missing(c.end_ns):
            continue
        start, end = c.start_ns, c.end_ns
        pid = trace.rank_pid(c.rank)
        thread = str(c.thread) if isinstance(c.thread, str) and c.thread else "compiles"
        args = {
            "kind": c.kind,
            "kernel": c.kernel,
            "step": None if c.step != c.step else c.step,
            "caller": c.caller if isinstance(c.caller, dict) else None,
        }
        if isinstance(c.key_fields, dict):
            args["key_fields"] = c.key_fields
        tid, dur = trace.thread_tid(pid, thread), (int(end) - int(start)) / 1000.0
        trace.span(pid, tid, f"compile {c.kernel}", f"compile,{c.kind}", trace.us(start), dur, args)


def _add_gc(trace: _Trace, gc: Any, steps: Any) -> None:
    """GC per step: a per-step total, drawn as one span ending at the step's end."""
    if not (len(gc) and len(steps)):
        return
    ends = {(str(s.rank), int(s.step)): int(s.end_ns) for s in steps.itertuples()}
    for g in gc.itertuples():
        if g.step != g.step:
            continue
        end = ends.get((str(g.rank), int(g.step)))
        if end is None:
            continue
        args = {
            "step": int(g.step),
            "generation": int(g.generation),
            "collections": int(g.count),
            "total_s": float(g.total_s),
            "note": "per-step total, drawn at the step's end",
        }
        name, dur = f"gc gen {int(g.generation)} ×{int(g.count)}", float(g.total_s) * 1e6
        trace.span(trace.rank_pid(g.rank), GC_TID, name, "gc", trace.us(end) - dur, dur, args)


def _add_pyspy_snapshots(trace: _Trace, dumps: Any) -> None:
    """py-spy snapshots: each lasts until the next one of the same rank."""
    if not len(dumps):
        return
    for rank, d in dumps.groupby("rank"):
        pid = trace.rank_pid(rank)
        times = sorted({int(t) for t in d["t"]})
        nxt = dict(zip(times, times[1:]))
        gap = (times[-1] - times[0]) / max(1, len(times) - 1) if len(times) > 1 else 1e9
        for r in d.itertuples():
            name = (
                r.thread_name if isinstance(r.thread_name, str) and r.thread_name else f"thread {r.thread_id}"
            )
            frames = r.frames if isinstance(r.frames, list) else []
            state = "holds GIL" if r.owns_gil else ("running" if r.active else "idle")
            top = frames[0].get("name", "?") if frames else "?"
            dur = (nxt.get(int(r.t), int(r.t) + gap) - int(r.t)) / 1000.0
            args = {
                "owns_gil": bool(r.owns_gil),
                "active": bool(r.active),
                "stack": [f"{f.get('name')} ({f.get('filename')}:{f.get('line')})" for f in frames[:30]],
            }
            trace.span(
                pid, trace.thread_tid(pid, name), f"{state}: {top}", "py-spy", trace.us(r.t), dur, args
            )


def _add_losses(trace: _Trace, log_steps: Any) -> None:
    if not len(log_steps):
        return
    pid = trace.rank_pid(trace.ranks[0] if trace.ranks else "0")
    trace.events.extend(
        {
            "ph": "C",
            "pid": pid,
            "tid": 0,
            "name": "loss",
            "ts": trace.us(s.t),
            "args": {"loss": float(s.loss)},
        }
        for s in log_steps.itertuples()
        if s.loss == s.loss and s.loss is not None
    )


def _add_gpu_counters(trace: _Trace, gpu: Any) -> None:
    if not len(gpu):
        return
    trace.events.extend(_meta(GPU_PID, "GPUs (NVML)", sort=-1))
    for r in gpu.itertuples():
        index = int(r.gpu) if r.gpu == r.gpu else 0
        for col, label in (("util", "util %"), ("sm_clock_mhz", "SM clock MHz"), ("power_w", "power W")):
            value = getattr(r, col, None)
            if value is not None and value == value:
                trace.events.append(
                    {
                        "ph": "C",
                        "pid": GPU_PID,
                        "tid": 0,
                        "name": f"GPU {index} {label}",
                        "ts": trace.us(r.t),
                        "args": {label: float(value)},
                    }
                )


def _torch_profiler_events(run_path: str, t0: int, ranks: list[str]) -> list[Event]:
    """Kineto's own events, shifted onto the run's clock: its ts is µs after baseTimeNanoseconds,
    a time.time_ns() value."""
    out: list[Event] = []
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
        pid_map: dict[Any, int] = {}
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


def export_trace(run: RunRecord, path: str) -> str:
    """Write the merged timeline to `path` (gzip-compressed when it ends in .gz)."""
    trace = build_trace(run)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UserError(f"cannot write {path}: no such folder {parent}")
    opener = gzip.open if path.endswith(".gz") else open

    def write(tmp: str) -> None:
        with opener(tmp, "wt", encoding="utf-8") as f:
            json.dump(trace, f, separators=(",", ":"), default=str)

    replace_with(path, write, user_path=True)
    return path
