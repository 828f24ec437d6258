"""The run record's tables built from its evidence (traindx.derive.run.RunRecord's properties
call these): the steps, the job's log and the steps it printed, py-spy dump snapshots, the
shim's CPU-thread pictures and the stacks of processes killed by a signal. Pure functions of
frames and files; no judgement.
"""

from __future__ import annotations

import bisect
import glob
import os
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from traindx.common import untrusted
from traindx.profiler.columnar import CorruptEvidenceWarning, TruncatedEvidenceWarning
from traindx.profiler.logparse import CustomRegexTimeout, compile_custom, parse_line
from traindx.profiler.rolling import read_text

STEP_COLUMNS = ["rank", "step", "start_ns", "end_ns", "duration_s"]
COMPILE_COLUMNS = [
    "rank",
    "kind",
    "kernel",
    "start_ns",
    "end_ns",
    "duration_s",
    "thread",
    "is_main_thread",
    "step",
    "caller",
    "key",
    "key_fields",
    "detail",
]
LOG_STEP_COLUMNS = ["t", "step", "loss", "step_time_s", "format", "tokens"]
DUMP_COLUMNS = [
    "t",
    "rank",
    "thread_name",
    "thread_id",
    "active",
    "owns_gil",
    "frames",
    "os_thread_id",
    "trigger",
]

_WRAPPED_VALUE = re.compile(r"loss\w*:\s*$")
_VALUE_LINE = re.compile(
    r"^[\s\d:.,/%•-]*\s[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?\s*$|"
    r"^\s*[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?\s*$"
)


def is_nan(value: object) -> bool:
    return isinstance(value, float) and value != value


def none_if_nan(value: Any) -> Any:
    return None if value is None or is_nan(value) else value


# -- steps ---------------------------------------------------------------------------------------
def _times(events: pd.DataFrame, column: str) -> pd.DataFrame:
    """rank, step and `column` (the event's t) of step_begin/step_end events, plain dtypes."""
    return pd.DataFrame(
        {
            "rank": pd.Series(events["rank"].to_numpy(object), dtype=object),
            "step": events["step"].astype(np.int64).to_numpy(),
            column: events["t"].astype(np.int64).to_numpy(),
        }
    )


def _paired_starts(ends: pd.DataFrame, begins: pd.DataFrame) -> np.ndarray[Any, Any]:
    """Each end's start: the latest begin of the same rank and step at or before it
    (merge_asof); NaN (a float array) where an end has none, else an int64 array."""
    begins["t"] = begins["start_ns"]
    begins["_begin"] = np.arange(len(begins), dtype=np.float64)
    ends["t"] = ends["end_ns"]
    ends["_row"] = np.arange(len(ends))
    paired = pd.merge_asof(
        ends,
        begins.drop(columns=["start_ns"]),
        on="t",
        by=["rank", "step"],
        direction="backward",
        allow_exact_matches=True,
    )
    which = paired.sort_values("_row", kind="stable")["_begin"].to_numpy(np.float64)
    found = ~np.isnan(which)
    start_ns = begins["start_ns"].to_numpy(np.int64)[np.where(found, which, 0).astype(np.int64)]
    if found.all():
        return np.where(found, start_ns, 0)
    return np.where(found, start_ns.astype(np.float64), np.nan)


def steps_table(step_end: pd.DataFrame, step_begin: pd.DataFrame) -> pd.DataFrame:
    """One row per completed optimizer step of each rank (STEP_COLUMNS): each step_end paired
    with the latest step_begin of the same rank and step number before it."""
    if not len(step_end):
        return pd.DataFrame(columns=STEP_COLUMNS)
    ends = _times(step_end, "end_ns")
    if len(step_begin):
        start = _paired_starts(ends, _times(step_begin, "start_ns"))
    else:
        start = np.full(len(ends), np.nan)
    out = pd.DataFrame(
        {
            "rank": pd.Series(ends["rank"].to_numpy(object), dtype=object),
            "step": ends["step"].to_numpy(),
            "start_ns": start,
            "end_ns": ends["end_ns"].to_numpy(),
        }
    )
    # exact ns difference; a step without its begin: NaN (start_ns then a float column)
    out["duration_s"] = (
        (out["end_ns"] - out["start_ns"]) / 1e9
        if start.dtype == np.int64
        else (out["end_ns"].astype(np.float64) - start) / 1e9
    )
    # rank order (as groupby gives it), t order within a rank
    codes, _ = pd.factorize(out["rank"], sort=True)
    out = out.iloc[np.argsort(codes, kind="stable")]
    return out.reset_index(drop=True)[STEP_COLUMNS]


def compiles_table(compile_events: pd.DataFrame) -> pd.DataFrame:
    """The compile and autotune events (COMPILE_COLUMNS, and whatever else they carry)."""
    if not len(compile_events):
        return pd.DataFrame(columns=COMPILE_COLUMNS)
    df = compile_events.rename(columns={"t": "end_ns", "start": "start_ns"}).reset_index(drop=True)
    for col in COMPILE_COLUMNS:
        if col not in df:
            df[col] = None
    return df


def _read_lines(path: str, what: str, stacklevel: int = 4) -> list[str]:
    """The lines of a rolling line file read as untrusted input (profiler/rolling.read_text); a
    file or segment not read (a link, a FIFO, a decompression bomb) left out with one warning."""
    notes: list[str] = []
    try:
        text = read_text(path, notes)
    except OSError as exc:
        notes, text = [f"{path}: not read ({exc.strerror}); {what} left out"], ""
    for note in notes:
        warnings.warn(note, CorruptEvidenceWarning, stacklevel=stacklevel)
    return text.split("\n")


# -- the job's log ---------------------------------------------------------------------------
def log_table(path: str) -> pd.DataFrame:
    """The job's output (log.txt): t (ns), stream ('o'|'e'), text."""
    rows: list[tuple[int, str, str]] = []
    if os.path.lexists(path):
        skipped = 0
        for line in _read_lines(path, "the job's log"):  # a long run's segments too
            t, _, rest = line.partition(" ")
            stream, _, text = rest.partition(" ")
            if t.isdigit() and stream in ("o", "e"):
                rows.append((int(t), stream, text))
            elif line.strip():
                skipped += 1
        if skipped:  # garbage (a disk fault, a bad copy): the readable lines still count
            warnings.warn(
                f"{path}: {skipped} line{'s' if skipped > 1 else ''} without the "
                "launcher's time and stream skipped",
                CorruptEvidenceWarning,
                stacklevel=3,
            )
    return pd.DataFrame(rows, columns=["t", "stream", "text"])


def log_steps_table(
    log: pd.DataFrame, log_regex: str | None, step_end_times: Callable[[], list[int]]
) -> pd.DataFrame:
    """Steps and losses the job printed itself (LOG_STEP_COLUMNS; the formats: profiler/logparse.py;
    log_regex: `diagnose --log-regex`, the job's own). A line without a step (HF Trainer's dicts)
    gets the number of optimizer steps the shim had seen end when it was printed (step_end_times:
    their sorted times, asked for only then), else its position among such lines."""
    try:
        custom = compile_custom(log_regex) if log_regex else None
    except ValueError as exc:
        warnings.warn(str(exc), TruncatedEvidenceWarning, stacklevel=3)
        custom = None
    rows = []
    texts = list(log["text"])
    streams = list(log["stream"]) if "stream" in log else [None] * len(texts)
    following = _next_of_same_stream(streams)
    for i, (t, text) in enumerate(zip(log["t"], texts)):
        j = following[i]
        if j is not None and _WRAPPED_VALUE.search(text) and _VALUE_LINE.match(texts[j]):
            # rich (Lightning's progress bar) wraps the bar's columns onto the next line of
            # its stream (a stderr line can land between the two): the metric's value is that
            # line's last number (after the times it pushed down)
            text = text.rstrip() + " " + texts[j].split()[-1]
        try:
            parsed = parse_line(text, custom)
        except CustomRegexTimeout as exc:  # the note, then the built-in formats for the rest
            warnings.warn(str(exc), TruncatedEvidenceWarning, stacklevel=3)
            custom = None
            parsed = parse_line(text)
        if parsed:
            parsed["t"] = t
            rows.append(parsed)
    if any(r["step"] is None for r in rows):
        ends = step_end_times()
        unnumbered = 0
        placed = []
        for r in rows:
            if r["step"] is None:
                unnumbered += 1
                r["step"] = bisect.bisect_right(ends, int(r["t"])) if ends else unnumbered
                placed.append(r)
        spread_coalesced(placed)
    return pd.DataFrame(rows, columns=LOG_STEP_COLUMNS)


def spread_coalesced(rows: list[dict[str, Any]]) -> None:
    """Lines placed by time (their step: the step ends seen when the launcher stamped them) that
    arrived in one read of the pipe share one stamp, so a line printed at the end of step k can
    land on k + 1 beside the next one. A run of such lines with one stamp and one step N takes
    the steps just before N that the line before them leaves free (one per line, in order)."""
    i = 0
    while i < len(rows):
        j = i
        while (
            j + 1 < len(rows) and rows[j + 1]["t"] == rows[i]["t"] and rows[j + 1]["step"] == rows[i]["step"]
        ):
            j += 1
        # the first run has no line before it to bound it: spread it only when each of its lines
        # is a training loss (one per step: two never belong to one step), from step 0 on
        if j > i and (i > 0 or all(r.get("loss") is not None for r in rows[i : j + 1])):
            last = rows[i]["step"]
            first = max(rows[i - 1]["step"] + 1 if i > 0 else 0, last - (j - i))
            for k in range(i, j + 1):
                rows[k]["step"] = min(first + (k - i), last)
        i = j + 1
    _one_loss_per_step(rows)


MAX_SHARED_LOSS_STEPS = 0.25  # of the loss lines: more share a step, they are per micro-batch


def _one_loss_per_step(rows: list[dict[str, Any]]) -> None:
    """Training losses placed by time are one per step, but a line read late can land on the
    next step beside that step's own although stamped apart (a loaded CI run's HF Trainer dicts:
    steps 1, 2, 3, 5, 5, 6). A stamp is never early, so each loss takes the latest step before
    the next loss's. Lines printed more often than steps (per micro-batch: many share a step),
    or more of them than steps before, are left as placed."""
    losses = [r for r in rows if r.get("loss") is not None]
    shared = sum(a["step"] == b["step"] for a, b in zip(losses, losses[1:]))
    if not shared or shared > MAX_SHARED_LOSS_STEPS * len(losses):
        return
    steps: list[int] = []
    for r in reversed(losses):
        steps.append(int(r["step"]) if not steps else min(int(r["step"]), steps[-1] - 1))
    if steps[-1] < 0:
        return
    for r, step in zip(reversed(losses), steps):
        r["step"] = step


def _next_of_same_stream(streams: list[Any]) -> list[int | None]:
    """For each log line, the index of the next line of the same stream (stdout/stderr), or None."""
    out: list[int | None] = [None] * len(streams)
    last: dict[Any, int] = {}
    for i in range(len(streams) - 1, -1, -1):
        out[i] = last.get(streams[i])
        last[streams[i]] = i
    return out


# -- py-spy dumps ------------------------------------------------------------------------------
def read_jsonl(
    path: str, valid: Callable[[dict[str, Any]], bool] | None = None, stacklevel: int = 3
) -> list[dict[str, Any]]:
    """JSON objects of one JSONL file. A line that is not one (a job killed mid-write leaves a
    cut-off last line; a disk or copy fault can leave one anywhere) is skipped with a warning
    naming the file and the line: the rest of the evidence is still good."""
    events = []
    lines = _read_lines(path, "its lines", stacklevel)  # a long run's segments too (profiler/rolling.py)
    last = len(lines) - 1
    while last >= 0 and not lines[last].strip():
        last -= 1
    bad = []
    for n, line in enumerate(lines[: last + 1]):
        if not line.strip():
            continue
        try:
            event = untrusted.loads(line)  # nesting bounded
        except ValueError:
            event = None
        if isinstance(event, dict) and (valid is None or valid(event)):
            events.append(event)
        elif n == last and not bad:
            warnings.warn(
                f"{path}:{n + 1}: last line is truncated (the job was killed mid-write); it was skipped",
                TruncatedEvidenceWarning,
                stacklevel=stacklevel,
            )
        else:
            bad.append(n + 1)
    if bad:
        where = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        warnings.warn(
            f"{path}: corrupt line{'s' if len(bad) > 1 else ''} {where} skipped",
            CorruptEvidenceWarning,
            stacklevel=stacklevel,
        )
    return events


def _valid_dump(snap: dict[str, Any]) -> bool:
    """A py-spy dump snapshot: a time and a list of threads."""
    t = snap.get("t")
    return isinstance(t, (int, float)) and not isinstance(t, bool) and isinstance(snap.get("threads"), list)


def _thread_row(snap: dict[str, Any], th: dict[str, Any], rank: str) -> dict[str, Any]:
    frames = th.get("frames")
    return {
        "t": snap["t"],
        "rank": rank,
        "thread_name": th.get("thread_name"),
        "thread_id": th.get("thread_id"),
        "active": th.get("active"),
        "owns_gil": th.get("owns_gil"),
        "frames": frames if isinstance(frames, list) else [],
        "os_thread_id": th.get("os_thread_id"),
        "trigger": snap.get("trigger"),
    }


def dumps_table(pyspy_folder: str, rank_of_stem: Callable[[str], str | None]) -> pd.DataFrame:
    """py-spy dump snapshots of pyspy/<stem>-dump.jsonl (DUMP_COLUMNS), one row per thread;
    rank_of_stem: the rank of a file's stem (None: not a rank, left out)."""
    rows = []
    suffix = "-dump.jsonl"
    for path in sorted(glob.glob(os.path.join(pyspy_folder, "*" + suffix))):
        rank = rank_of_stem(os.path.basename(path)[: -len(suffix)])
        if rank is None:
            continue
        for snap in read_jsonl(path, valid=_valid_dump, stacklevel=4):
            rows += [_thread_row(snap, th, rank) for th in snap["threads"] if isinstance(th, dict)]
    return pd.DataFrame(rows, columns=DUMP_COLUMNS)


# -- the shim's pictures and the fault stacks -------------------------------------------------
def latest_cpu_threads(cpu_threads: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """{rank: its latest `cpu_threads` event's fields} (NaN as None)."""
    if not len(cpu_threads):
        return {}
    out = {}
    for row in cpu_threads.sort_values("t", kind="stable").to_dict("records"):
        out[str(row["rank"])] = {
            k: (None if is_nan(v) else v) for k, v in row.items() if k not in ("type", "rank")
        }
    return out


def fault_stacks(folder: str, labels: Mapping[Any, str]) -> dict[str, str]:
    """{label: text} of faults/p<pid>.txt files: label is 'rank L' where the pid's rank label
    is known (labels: {pid: label}), else 'pid N'."""
    found: dict[str, str] = {}
    if not os.path.isdir(folder):
        return found
    for name in sorted(os.listdir(folder)):
        pid = name[1:-4] if name.startswith("p") and name.endswith(".txt") else ""
        try:  # a run folder's file: no link, FIFO or device (untrusted); a long one cut
            with untrusted.open_file(os.path.join(folder, name)) as f:
                text = f.read(200_000).decode("utf-8", errors="replace")
        except OSError:
            continue
        if text.strip() and pid.isdigit():
            label = labels.get(int(pid))
            found[f"rank {label}" if label is not None else f"pid {pid}"] = text
    return found
