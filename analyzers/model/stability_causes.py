"""stability's reading of the slow steps: what they hold that the others do not - the shim-timed
checkpoint/file writes with the job's line, the log lines printed in them, full collections, the
job's checkpoint writers in py-spy's samples - and the training thread's wait for a core."""

from __future__ import annotations

import ast
import functools
import re
from collections import Counter
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers.core import evidence as ev
from traindx.derive import ledger
from traindx.profiler.logparse import parse_line

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord


_LOG_INDEX: list[Any] = [None, None]  # (the log DataFrame, its index): every rank asks about the same log


def _log_index(log: pd.DataFrame) -> Any:
    """(sorted t, normalised text) of the log lines other than per-step log lines."""
    if _LOG_INDEX[0] is not log:
        keep = [bool(text.strip()) and not parse_line(text) for text in log["text"]]
        kept = log[keep].sort_values("t", kind="stable")
        codes, names = pd.factorize(
            pd.Series([re.sub(r"\d+", "N", t.strip())[:160] for t in kept["text"]], dtype=object)
        )
        _LOG_INDEX[:] = [log, (kept["t"].to_numpy(), (np.asarray(codes, np.int64), list(names)))]
    return _LOG_INDEX[1]


def _log_in_steps(run: RunRecord, step_rows: pd.DataFrame) -> Any:
    """Lines the job printed inside the given steps, other than its per-step log line.

    The log is sorted and filtered once; each step then takes its lines by binary search on t
    (O((lines + steps) log lines) instead of one scan of the whole log per step)."""
    log = run.log
    if not len(log):
        return Counter()
    times, keys = _log_index(log)
    found = Counter()
    rows = step_rows.dropna(subset=["start_ns", "end_ns"])  # a step without a begin holds no line
    # int64, not float: ns since the epoch lose ~256 ns in a float64
    starts = np.searchsorted(times, rows["start_ns"].to_numpy(dtype="int64"), side="left")
    ends = np.searchsorted(times, rows["end_ns"].to_numpy(dtype="int64"), side="right")
    n = np.maximum(ends - starts, 0)
    total = int(n.sum())
    if not total:
        return found
    codes, names = keys
    # every (step, line) pair at once; a line counts once per step however often it was printed
    step_of = np.repeat(np.arange(len(n)), n)
    line = np.arange(total) - np.repeat(np.cumsum(n) - n, n) + np.repeat(starts, n)
    pairs = np.unique(step_of * len(names) + codes[line])
    counts = np.bincount(pairs % len(names), minlength=len(names))
    for code in np.flatnonzero(counts):
        found[names[code]] = int(counts[code])
    return found


def _io_in_steps(run: RunRecord, rank: str, step_rows: pd.DataFrame) -> Any:
    """The checkpoint/file writes the shim timed inside the given steps, by call and caller:
    [{"call", "caller", "steps", "seconds_per_step"}], most time first."""
    spans = run.spans
    if not len(spans) or not len(step_rows):
        return []
    io = run.rank_rows("spans", rank)
    io = io[io["cat"] == "io"]
    if not len(io):
        return []
    starts = step_rows["start_ns"].to_numpy(np.int64)
    ends = step_rows["end_ns"].to_numpy(np.int64)
    order = np.argsort(starts)
    starts, ends = starts[order], ends[order]
    idx = np.searchsorted(starts, io["start_ns"].to_numpy(np.int64), side="right") - 1
    inside = (idx >= 0) & (io["start_ns"].to_numpy(np.int64) < ends[np.maximum(idx, 0)])
    groups = {}
    for row, step_i in zip(io[inside].itertuples(), idx[inside]):
        caller = row.caller if isinstance(row.caller, dict) else None
        key = (
            row.call if isinstance(row.call, str) else "file write",
            (caller or {}).get("file"),
            (caller or {}).get("line"),
        )
        g = groups.setdefault(
            key, {"call": key[0], "caller": caller, "steps": set(), "ns": 0, "cpu": 0.0, "timed_cpu": True}
        )
        via = getattr(row, "via", None)
        if isinstance(via, dict) and "built" not in g:
            g["built"] = built_site(via)
        g["steps"].add(int(step_i))
        g["ns"] += int(row.end_ns) - int(row.start_ns)
        cpu, runq = getattr(row, "cpu", None), getattr(row, "runq", None)
        if isinstance(cpu, (int, float)) and np.isfinite(cpu):
            # on the thread: running, or runnable and waiting for a core (not for the disk)
            g["cpu"] += float(cpu) + (
                float(runq) if isinstance(runq, (int, float)) and np.isfinite(runq) else 0.0
            )
        else:
            g["timed_cpu"] = False
    out = []
    for g in groups.values():
        item = {
            "call": g["call"],
            "caller": g["caller"],
            "steps": len(g["steps"]),
            "seconds_per_step": round(g["ns"] / 1e9 / len(g["steps"]), 4),
        }
        if g.get("built"):
            item["built"] = g["built"]
        if g["timed_cpu"]:  # the thread's own CPU and run-queue wait (the rest: the disk)
            item["cpu_seconds_per_step"] = round(g["cpu"] / len(g["steps"]), 4)
        out.append(item)
    return sorted(out, key=lambda g: -g["seconds_per_step"] * g["steps"])


def call_text(io: Any) -> str:
    built = io.get("built")
    if built:  # a framework object the job built made the call: the job's line leads
        args = ", ".join(f"{k}={v}" for k, v in built["keywords"].items())
        return f"{io['call']} from its {built['class']} built at {built['file']}:{built['line']}" + (
            f" ({args})" if args else ""
        )
    caller = io.get("caller") or {}
    where = f" at {caller.get('file')}:{caller.get('line')}" if caller.get("file") else ""
    return f"{io['call']}{where}"


def built_site(via: dict[str, Any]) -> dict[str, Any] | None:
    """The job's line that built the framework object that made a call (the shim's `via`: the
    job's frame and the classes whose methods ran between it and the call, innermost first):
    the innermost of those classes the job's file constructs, other than the object whose
    method the job called itself (its trainer, its loop), with that construction's keyword
    arguments as written (a checkpoint callback's frequency)."""
    job, objects, called = via.get("job") or {}, via.get("objects") or [], via.get("called") or ["", ""]
    names = [str(o[1]).rsplit(".", 1)[-1] for o in objects if isinstance(o, (list, tuple)) and len(o) == 2]
    own_call = str(called[-1]).rsplit(".", 1)[-1]  # the job's own call: its trainer, its loop
    if not job.get("file") or not names:
        return None
    built = _constructions(str(job["file"]))
    for name in names:
        if name in built and name != own_call:
            line, keywords = built[name]
            return {"class": name, "file": job["file"], "line": line, "keywords": keywords}
    return None


@functools.lru_cache(maxsize=64)
def _constructions(path: str) -> dict[str, tuple[int, dict[str, str]]]:
    """{class name: (line, {keyword: source})} of the calls `Name(...)` / `x.Name(...)` of a
    file (the first of each name), or {} where it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return {}
    out: dict[str, tuple[int, dict[str, str]]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = (
            func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        )
        if name and name[:1].isupper() and (name not in out or node.lineno < out[name][0]):
            kw = {k.arg: ast.get_source_segment(text, k.value) or "" for k in node.keywords if k.arg}
            out[name] = (node.lineno, kw)
    return out


# a checkpoint write: torch.save, torch.distributed.checkpoint, safetensors, HF save_pretrained
_SAVE_FRAME = re.compile(
    r"torch[/\\]serialization\.py$|torch[/\\]distributed[/\\]checkpoint[/\\]"
    r"|safetensors[/\\]|[/\\]modeling_utils\.py$"
)
_SAVE_FUNCTIONS = ("save", "_save", "save_file", "save_pretrained", "async_save", "save_state_dict")


def save_sites(run: RunRecord, rank: str) -> list[dict[str, Any]]:
    """[{file, line, function, seconds}] of the job's own lines that write checkpoints, from
    py-spy's main-thread samples inside a checkpoint writer (the job's frame that called it)."""
    recording = run.pyspy.get((rank, "all"))
    if not recording:
        return []
    main = ev.main_thread_id(recording, run.pyspy.get((rank, "gil")))
    threads = ev.merge_threads(recording)
    if main not in threads:
        return []
    samples = threads[main][1]
    sites = {}
    for stack, weight in zip(samples.stacks, samples.weights):
        inside = next(
            (
                i
                for i, f in enumerate(stack)
                if _SAVE_FRAME.search(f.file or "") and f.name.split(".")[-1] in _SAVE_FUNCTIONS
            ),
            None,
        )
        if inside is None:
            continue
        own = ev.user_frames(stack[:inside])
        if own:
            key = (own[-1].file, own[-1].line, own[-1].name)
            sites[key] = sites.get(key, 0.0) + weight
    return [
        {"file": f, "line": line, "function": fn, "seconds": round(sec, 3), "frame": f"{fn} ({f}:{line})"}
        for (f, line, fn), sec in sorted(sites.items(), key=lambda kv: -kv[1])[:3]
    ]


def slow_step_causes(run: RunRecord, rank: str, slow_rows: pd.DataFrame, normal_rows: pd.DataFrame) -> Any:
    """What the slow steps have that the others do not: checkpoint/file writes (the shim's
    timed torch.save/DCP calls, with the job's line), log lines, gen-2 collections."""
    causes: dict[str, Any] = {}
    io = [g for g in _io_in_steps(run, rank, slow_rows) if g["steps"] >= max(2, 0.6 * len(slow_rows))]
    if io:
        causes["io_in_slow_steps"] = io[:3]
    in_slow = _log_in_steps(run, slow_rows)
    in_normal = _log_in_steps(run, normal_rows)
    lines = [
        (text, n)
        for text, n in in_slow.most_common()
        if n >= max(2, 0.6 * len(slow_rows)) and in_normal.get(text, 0) <= 0.2 * len(normal_rows)
    ]
    if lines:
        causes["log_lines_in_slow_steps"] = [{"text": t, "steps": n} for t, n in lines[:3]]
    gc = run.gc
    if len(gc) and "generation" in gc:
        full = run.rank_rows("gc", rank)
        full = full[full["generation"] == 2]
        with_gc = {int(s) for s in full["step"]}
        n = sum(1 for s in slow_rows["step"] if int(s) in with_gc)
        if n >= 0.6 * len(slow_rows):
            causes["gen2_gc_in_slow_steps"] = n
    saves = save_sites(run, rank)
    if saves:
        causes["save_sites"] = saves
    return causes


def run_queue_excess(run: RunRecord, rank: str, slow_rows: pd.DataFrame, normal_rows: pd.DataFrame) -> Any:
    """Seconds the training thread waited for a core in a slow step beyond a normal one (the
    shim's per-step run-queue delay, median of each), or None where it was not recorded."""
    events = run.of_type("cpu")
    cpu = run.rank_rows("cpu_events", rank, events) if len(events) else None
    if (
        cpu is None
        or not len(cpu)
        or "thread_runq_s" not in cpu
        or not len(slow_rows)
        or not len(normal_rows)
    ):
        return None
    waits = cpu.dropna(subset=["thread_runq_s"]).groupby("step")["thread_runq_s"].sum()
    slow = waits.reindex([int(s) for s in slow_rows["step"]]).dropna()
    normal = waits.reindex([int(s) for s in normal_rows["step"]]).dropna()
    if not len(slow) or not len(normal):
        return None
    return round(max(0.0, float(slow.median() - normal.median())), 4)


def io_from_ledger(
    run: RunRecord, rank: str, steady: pd.DataFrame, causes: dict[str, Any], lost: float, share: float
) -> tuple[float, float]:
    """With a timed write behind the slow steps, what removing it saves is the ledger's
    checkpoint/io seconds per steady step (exact, and unchanged by a busy machine); otherwise
    the slow steps' excess over the others stands."""
    if not causes.get("io_in_slow_steps"):
        return lost, share
    led = ledger.rows(run, rank, steady["step"])
    wall = float(led["wall_s"].sum()) if len(led) else 0.0
    if not wall:
        return lost, share
    io_lost = float(led["io_s"].mean())
    causes["io_seconds_per_step"] = round(io_lost, 4)
    if io_lost < 0.5 * lost:
        # the timed call is a small part of what the slow steps add (the job's own writes
        # around it, a copy to remote storage): the excess stands, the call is named
        causes["io_explains_share_of_excess"] = round(io_lost / lost, 3) if lost else None
        return lost, share
    return io_lost, float(led["io_s"].sum()) / wall
