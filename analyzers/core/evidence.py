"""Shared reading of the run record for the analyzers: the steady window of steps, the steps the
torch.profiler window slowed down, severities from the share of step time lost, and telling the
job's own code from libraries in py-spy and torch.profiler frames."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

# the steady window is derived (traindx.derive.steady); the analyzers read it as ev.*
from traindx.derive.steady import events_of_type as events_of_type
from traindx.derive.steady import median_step_s as median_step_s
from traindx.derive.steady import profiled_steps as profiled_steps
from traindx.derive.steady import steady_steps as steady_steps
from traindx.derive.steady import step_of as step_of
from traindx.derive.steady import steps_seconds as steps_seconds
from traindx.derive.steady import trace_steps as trace_steps
from traindx.derive.steady import warmup_count as warmup_count
from traindx.profiler import speedscope

# library or the job's own code: one rule set, shared with the shim and the report
from traindx.profiler.code_paths import KNOWN_LIBRARIES as KNOWN_LIBRARIES
from traindx.profiler.code_paths import LOW_LEVEL_PACKAGES as LOW_LEVEL_PACKAGES
from traindx.profiler.code_paths import is_library_path as is_library_path
from traindx.profiler.code_paths import is_library_trace_file as is_library_trace_file

# folders no job's own source lives in (walked for the job's files by analyzers and the fix planner)
SKIP_DIRS = {
    ".git",
    ".hg",
    ".svn",
    "__pycache__",
    ".venv",
    "venv",
    ".tox",
    "node_modules",
    ".pytest_cache",
    ".mypy_cache",
    "wandb",
    ".cache",
}


def python_files(root: str, limit: int = 3000) -> list[str]:
    """The .py files under `root` (hidden and tool folders skipped), stopping past `limit`."""
    out: list[str] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        out += [os.path.join(folder, n) for n in files if n.endswith(".py")]
        if len(out) > limit:
            break
    return out


if TYPE_CHECKING:  # annotations only
    import pandas as pd

    from traindx.derive.run import RunRecord
    from traindx.profiler.speedscope import Frame, Recording, ThreadSamples

# share of step time lost -> severity; below the lowest: "info"
SEVERITY_BY_SHARE = ((0.30, "high"), (0.10, "medium"), (0.03, "low"))


def union_seconds(intervals: Iterable[tuple[int, int]]) -> float:
    """Seconds covered by (start_ns, end_ns) intervals, overlaps counted once."""
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e9


def severity_for_share(share: float | None) -> str:
    for limit, severity in SEVERITY_BY_SHARE:
        if share is not None and share >= limit:
            return severity
    return "info"


# -- frames ----------------------------------------------------------------------------------
# python_function names in torch.profiler traces: "path/relative/to/sys.path(LINE): function"
_TRACE_FRAME = re.compile(r"^(?P<file>.+?)\((?P<line>\d+)\): (?P<function>.+)$")


def parse_trace_frame(name: str | None) -> tuple[str, int, str] | None:
    """(file, line, function) of a torch.profiler python_function event, or None for builtins."""
    m = _TRACE_FRAME.match(name or "")
    if not m:
        return None
    return m["file"], int(m["line"]), m["function"]


def user_frames(stack: Sequence[Frame]) -> list[Frame]:
    """The job's own frames of a py-spy stack (root first), innermost last."""
    return [f for f in stack if not is_library_path(f.file)]


def frame_label(frame: Frame) -> str:
    return f"{frame.name} ({frame.file}:{frame.line})"


# -- py-spy threads ----------------------------------------------------------------------------
def thread_key(name: str) -> tuple[str, str]:
    """(thread id, thread name) of a py-spy thread label like 'Thread 8485 "MainThread"'.
    The --idle and --gil recordings name one thread differently; its id is the same."""
    return speedscope.parse_thread_label(name) or (name, name)


def _name_from_root_frames(samples: Any) -> Any:
    """py-spy 0.4 sometimes leaves 'thread (718): MainThread' as a root frame of the samples."""
    for stack in samples.stacks[:50]:
        for frame in stack[:2]:
            root = speedscope.root_frame(frame.name) if not frame.file else None
            if root and root[1]:
                return root[1]
    return ""


def merge_threads(recording: Recording | None) -> dict[str, tuple[str, ThreadSamples]]:
    """{thread id: (name, ThreadSamples)} with the name of the first non-empty label."""
    out = {}
    for label, samples in (recording or {}).items():
        tid, name = thread_key(label)
        name = name or _name_from_root_frames(samples)
        if tid in out:  # a new object: the recording (cached on the run) stays as it was read
            prev_name, prev = out[tid]
            merged = type(prev)(
                prev.thread,
                list(prev.stacks) + list(samples.stacks),
                list(prev.weights) + list(samples.weights),
            )
            out[tid] = (prev_name or name, merged)
        else:
            out[tid] = (name, samples)
    return out


IMPORT_FRAME_FILES = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")


def is_import_sample(stack: Sequence[Frame]) -> bool:
    """A sample taken while Python imports modules: start-up, not training."""
    return any(f.file in IMPORT_FRAME_FILES for f in stack)


def training_weight(
    samples: ThreadSamples, keep: Callable[[Sequence[Frame]], bool] = lambda stack: True
) -> float:
    """Seconds of samples (py-spy weights are seconds) outside imports that satisfy `keep`."""
    total = 0.0
    for stack, weight in zip(samples.stacks, samples.weights):
        if not is_import_sample(stack) and keep(stack):
            total += weight
    return total


def hottest_frames(
    samples: ThreadSamples, limit: int = 5, keep: Callable[[Sequence[Frame]], bool] = lambda stack: True
) -> list[tuple[Frame, float]]:
    """[(Frame, seconds)] per function of the innermost own-code frame (falling back to the
    leaf) of the samples kept, hottest first; the Frame carries the function's hottest line."""
    by_function, by_line = {}, {}
    for stack, weight in zip(samples.stacks, samples.weights):
        if is_import_sample(stack) or not stack or not keep(stack):
            continue
        own = user_frames(stack)
        frame = own[-1] if own else stack[-1]
        key = (frame.name, frame.file)
        by_function[key] = by_function.get(key, 0.0) + weight
        by_line[frame] = by_line.get(frame, 0.0) + weight
    hottest_line = {}
    for frame, seconds in by_line.items():
        key = (frame.name, frame.file)
        if key not in hottest_line or seconds > by_line[hottest_line[key]]:
            hottest_line[key] = frame
    ranked = sorted(by_function.items(), key=lambda kv: -kv[1])[:limit]
    return [(hottest_line[key], seconds) for key, seconds in ranked]


def hottest_leaves(
    samples: ThreadSamples, limit: int = 5, keep: Callable[[Sequence[Frame]], bool] = lambda stack: True
) -> list[tuple[Frame, float]]:
    """[(Frame, seconds)] of the innermost frames, libraries included."""
    counts = {}
    for stack, weight in zip(samples.stacks, samples.weights):
        if is_import_sample(stack) or not stack or not keep(stack):
            continue
        counts[stack[-1]] = counts.get(stack[-1], 0.0) + weight
    return sorted(counts.items(), key=lambda kv: -kv[1])[:limit]


def frames_evidence(hot: Iterable[tuple[Frame, float]]) -> list[dict[str, Any]]:
    return [
        {"frame": frame_label(f), "function": f.name, "file": f.file, "line": f.line, "seconds": round(s, 3)}
        for f, s in hot
    ]


def main_thread_id(recording_all: Recording | None, recording_gil: Recording | None) -> str | None:
    """The py-spy id of the main thread: the one the --gil recording names MainThread, else the
    one with the most samples in the --idle recording (it lives for the whole job)."""
    for recording in (recording_gil, recording_all):
        for tid, (name, _) in merge_threads(recording).items():
            if name == "MainThread":
                return tid
    threads = merge_threads(recording_all)
    if not threads:
        return None
    return max(threads, key=lambda tid: sum(threads[tid][1].weights))


def own_thread(name: str | None) -> bool:
    """traindx's own threads (the shim's writer) are never the job's problem."""
    return (name or "").startswith("traindx-")


# -- torch.profiler ----------------------------------------------------------------------------
def enclosing_user_function(py_events: pd.DataFrame, thread: Any, t_ns: int) -> tuple[str, int, str] | None:
    """The innermost python_function event of the job's own code on `thread` that encloses
    time t_ns: (file, def line, function) or None. py_events: that rank's python_function rows."""
    rows = py_events[
        (py_events["tid"] == thread) & (py_events["start_ns"] <= t_ns) & (py_events["end_ns"] >= t_ns)
    ]
    best = None
    for row in rows.itertuples():
        parsed = parse_trace_frame(row.name)
        if not parsed or is_library_trace_file(parsed[0]):
            continue
        if best is None or row.start_ns >= best[0]:
            best = (row.start_ns, parsed)
    return None if best is None else best[1]


def enclosing_frames(py_events: pd.DataFrame, thread: Any, t_ns: int) -> list[str]:
    """Names of the python_function events on `thread` that enclose t_ns, innermost first."""
    rows = py_events[
        (py_events["tid"] == thread) & (py_events["start_ns"] <= t_ns) & (py_events["end_ns"] >= t_ns)
    ]
    return list(rows.sort_values("start_ns", ascending=False)["name"])


def job_scripts(run: RunRecord) -> list[str]:
    """The job's own Python files named by its command (relative to the run's cwd)."""
    cwd = run.manifest.get("cwd") or os.getcwd()
    out = []
    for token in list(run.command or [])[:6]:
        token = str(token)
        if token.endswith(".py") and not token.startswith("-"):
            path = os.path.join(cwd, token)
            if os.path.isfile(path) and not is_library_path(path):
                out.append(os.path.abspath(path))
    return out


def step_runq_s(
    run: RunRecord, rank: Sequence[Any], step: Sequence[Any], end_s: Sequence[Any], duration_s: Sequence[Any]
) -> Any:
    """Per step (parallel arrays, one rank's steps in order within each rank) the training
    thread's run-queue wait inside the step: the shim's `cpu` event of that step
    (thread_runq_s) covers one step end to the next, gaps between steps included, so the step's
    part is taken as spread evenly over that time. NaN where a step has no such record; None
    when the run has none (recorded without the run-queue delay)."""
    cpu = run.of_type("cpu")
    if not len(cpu) or "thread_runq_s" not in cpu or cpu["thread_runq_s"].isna().all():
        return None
    cpu = cpu[cpu["thread_runq_s"].notna()]
    cpu = cpu.assign(rank=cpu["rank"].astype(str), step=cpu["step"].astype("int64"))
    cpu = cpu.drop_duplicates(["rank", "step"], keep="last")
    frame = pd.DataFrame(
        {
            "rank": np.asarray(rank).astype(str),
            "step": np.asarray(step, np.int64),
            "end_s": np.asarray(end_s, float),
            "wall": np.asarray(duration_s, float),
        }
    )
    runq = frame.merge(cpu[["rank", "step", "thread_runq_s"]], on=["rank", "step"], how="left")[
        "thread_runq_s"
    ].to_numpy(float)
    covered = (frame["end_s"] - frame.groupby("rank", sort=False)["end_s"].shift()).to_numpy(float)
    wall = frame["wall"].to_numpy(float)
    part = np.where(
        np.isfinite(covered) & (covered > 0), np.minimum(1.0, wall / np.where(covered > 0, covered, 1.0)), 1.0
    )
    return np.minimum(wall, runq * part)


def gc_core_waits(run: RunRecord) -> Any:
    """(rank, start_ns, end_ns, wait_s) of each shim-timed GC pause that carries the training
    thread's CPU time inside it (`span` events, cat gc, cpu): a collection holds the GIL and never
    sleeps, so its wall time less that CPU is time the thread waited for a core. Empty for runs
    recorded without it."""
    spans = run.of_type("span")
    cols = ["rank", "start_ns", "end_ns", "wait_s"]
    if not len(spans) or "cpu" not in spans or "cat" not in spans:
        return pd.DataFrame(columns=cols)
    g = spans[(spans["cat"] == "gc") & spans["cpu"].notna()]
    if not len(g):
        return pd.DataFrame(columns=cols)
    start, end = g["start"].astype("int64"), g["t"].astype("int64")
    wait = ((end - start) / 1e9 - g["cpu"].astype(float)).clip(lower=0.0)
    return pd.DataFrame(
        {
            "rank": g["rank"].astype(str).to_numpy(object),
            "start_ns": start.to_numpy(),
            "end_ns": end.to_numpy(),
            "wait_s": wait.to_numpy(float),
        }
    )


def waits_inside(
    waits: pd.DataFrame, rank: Sequence[Any], start_ns: Sequence[Any], end_ns: Sequence[Any]
) -> Any:
    """Seconds of gc_core_waits inside each (rank, start_ns, end_ns) window, a pause cut by a
    window's edge counted by its overlap (its wait taken as spread evenly over it)."""
    ranks = np.asarray(rank).astype(str)
    a, b = np.asarray(start_ns, np.int64), np.asarray(end_ns, np.int64)
    out = np.zeros(len(ranks))
    for r, s, e, w in waits.itertuples(index=False):  # pauses >= 1 ms: a few per step at most
        mine = ranks == r
        ov = np.minimum(b, e) - np.maximum(a, s)
        hit = mine & (ov > 0)
        if hit.any() and e > s:
            out[hit] += w * ov[hit] / (e - s)
    return out


def ledger_step_runq_s(run: RunRecord, rank: str, steps: Sequence[Any]) -> Any:
    """step_runq_s of the given steps of one rank's ledger rows (its gaps measured over all of
    them, start-up row included), or None where the run has no such record or one of the
    steps lacks it."""
    rows = run.rank_rows("ledger", rank).sort_values("start_ns")
    runq = step_runq_s(run, rows["rank"], rows["step"], rows["end_ns"].to_numpy(float) / 1e9, rows["wall_s"])
    if runq is None:
        return None
    by_step = pd.Series(runq, index=rows["step"].astype("int64").to_numpy())
    by_step = by_step[~by_step.index.duplicated(keep="last")]
    mine = by_step.reindex(np.asarray(steps, np.int64))
    return None if mine.isna().any() else mine.to_numpy(float)
