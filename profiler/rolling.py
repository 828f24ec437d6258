"""Keeps a long run's evidence within its disk budget (docs/long-runs.md).

Line files (events, the job's log, py-spy dumps) are written in segments (the head kept whole,
segments.py for the names). The launcher's roller keeps the last `keep` closed segments plain and
gzips the older ones (lossless); when a file's family is over its share of the budget, the oldest
gzipped segment is thinned (events: each step's spans merged per category and thread; log: the
job's step/loss lines; dumps: each thread's top frames), and past that dropped, each thinning and
drop written down in `<head>.rolled.json` (a dropped events segment: its step range). py-spy records in windows: the first
(start-up, compiles) and the last `keep` stay whole, the others are folded into
`<rank>-<flavour>.rolled.speedscope.json` (each distinct stack once, weights summed), so the
whole run's proportions stay. Every change is written beside and renamed into place: a kill at
any moment leaves complete files, at worst one segment counted twice, never a lost one.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from traindx.common import atomic, untrusted
from traindx.common.errors import UserError
from traindx.profiler.diskfloor import FLOOR_CHECK_S, folder_bytes, under_floor
from traindx.profiler.logparse import CustomRegexTimeout, compile_custom, parse_line
from traindx.profiler.shim._traindx_shim.segments import segment_path, segments, summary_path
from traindx.profiler.speedscope import ThreadSamples, load

# thin(lines, note): the lines a rolled segment keeps, filling in `note` for its summary
Thin = Callable[[Iterable[str], dict[str, Any]], Iterator[str]]
# {thread: {stack: seconds}} of folded py-spy windows
Totals = dict[str, dict[Any, float]]

MB = 1 << 20
# a budget this small (a small disk's share) is settled at every floor check: a few seconds of
# the job's output would otherwise overshoot it several times
SMALL_BUDGET_BYTES = 256 * MB
MIN_SEGMENT_BYTES = 4096
# shares of the per-rank budget (the log is the job's, counted once); py-spy's windows fold
# early when over theirs; nvml.csv is not rolled (a fixed ~120 B/s per GPU: docs/long-runs.md)
EVENTS_SHARE, DUMPS_SHARE, LOG_SHARE, PYSPY_SHARE = 0.6, 0.1, 0.1, 0.2


@dataclass
class Budget:
    """The disk budget of one run: `rank_bytes` per training process, rolling windows of
    `window_s`, the last `keep` windows/segments kept whole."""

    rank_bytes: int = 2048 * MB
    window_s: float = 600.0
    keep: int = 3
    # the first window is short: py-spy writes a window's samples only when it ends, and the
    # live judgement reads them then (a GIL held by another thread is seen in the recording)
    first_window_s: float = 20.0

    def window_length(self, n: int) -> float:
        """Seconds window `n` records for."""
        return min(self.first_window_s, self.window_s) if n == 0 else self.window_s

    def startup_windows(self) -> int:
        """Windows kept whole from the start (start-up, the first compiles): window 0, and
        window 1 too when window 0 was the short first one."""
        return 2 if self.window_length(0) < self.window_s else 1

    def cap(self, share: float) -> int:
        return int(self.rank_bytes * share)

    def segment_bytes(self, share: float) -> int:
        # head + the kept segments + the live one take at most half the family's cap; the
        # rolled (gzipped, thinned) segments the other half
        return max(MIN_SEGMENT_BYTES, self.cap(share) // (2 * (self.keep + 2)))

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank_bytes": self.rank_bytes,
            "window_s": self.window_s,
            "keep": self.keep,
            "first_window_s": self.first_window_s,
            "events_segment_bytes": self.segment_bytes(EVENTS_SHARE),
        }


# -- line files ------------------------------------------------------------------------------
def _open_own(path: str, mode: str) -> IO[str]:
    """A text file of the run folder for writing ("w" or "a"), never through a symbolic link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if mode == "a" else os.O_TRUNC)
    return os.fdopen(os.open(path, flags, 0o644), mode, encoding="utf-8")


class RollingLines:
    """An append-only line file written in segments of `segment_bytes` (0: one file)."""

    def __init__(self, head: str, segment_bytes: int = 0, mode: str = "w") -> None:
        self.head = head
        self.segment_bytes = segment_bytes
        self._file = _open_own(head, mode)
        self._written = self._file.tell()
        existing = segments(head)
        self._n = existing[-1][0] if existing else 0

    def write(self, text: str) -> None:
        self._file.write(text)
        self._file.flush()
        self._written += len(text.encode("utf-8", "replace"))
        if self.segment_bytes and self._written >= self.segment_bytes and text.endswith("\n"):
            self._n += 1
            self._file.close()
            self._file = _open_own(segment_path(self.head, self._n), "w")
            self._written = 0

    def flush(self) -> None:
        self._file.flush()

    def __enter__(self) -> RollingLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    @property
    def name(self) -> str:
        return self.head


def read_text(head: str, notes: list[str] | None = None) -> str:
    """The whole text of a rolling line file, segments in order (gzipped ones decompressed);
    the head alone for a short run. Line ends are kept as written: a carriage return inside a
    line (a progress bar's updates, one record line) stays in that line. notes: read_bytes'."""
    return read_bytes(head, notes).decode("utf-8", errors="replace")


def read_bytes(head: str, notes: list[str] | None = None) -> bytes:
    """The head and its segments in order, each ending on a whole line, read as untrusted input
    (traindx.common.untrusted: no link, FIFO or device, a gzipped segment's inflated size capped).
    The head not read is an OSError; a segment not read is left out, and why is appended to
    `notes` (a segment removed while we read, rolled into a .gz meanwhile, is not worth one)."""
    parts = [untrusted.read_bytes(head)]
    for _, path, gz in segments(head):
        try:
            parts.append(untrusted.read_gzip(path) if gz else untrusted.read_bytes(path))
        except FileNotFoundError:
            continue
        except OSError as exc:
            if notes is not None:
                notes.append(f"{path}: not read ({exc.strerror}): its lines are left out")
    if len(parts) == 1:
        return parts[0]
    for i in range(len(parts) - 1):
        if parts[i] and not parts[i].endswith(b"\n"):
            parts[i] += b"\n"
    return b"".join(parts)


def family_bytes(head: str) -> int:
    total = _size(head) + _size(summary_path(head))
    return total + sum(_size(path) for _, path, _ in segments(head))


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_summary(head: str) -> dict[str, Any]:
    try:
        data = untrusted.load_json(summary_path(head))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_json_atomic(path: str, data: Any) -> None:
    atomic.write_json(path, data, separators=(",", ":"), default=str)


def _gzip_segment(path: str) -> None:
    """path -> path.gz (written beside, renamed in, then the plain one removed)."""

    def write(tmp: str) -> None:
        with open(path, "rb") as src, gzip.open(tmp, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)

    atomic.replace_with(path + ".gz", write)
    os.remove(path)


def settle(head: str, keep: int, cap: int, thin: Thin | None = None, live: bool = True) -> None:
    """Roll one line file: gzip the closed segments older than the last `keep`, then, while the
    family is over `cap` bytes, thin the oldest gzipped segment (thin(lines, note): a generator
    of the lines kept, filling in `note` for the summary) and past that drop it. live: the newest segment is still being written."""
    segs = segments(head)
    closed = segs[:-1] if live and segs else segs
    for n, path, gz in closed[:-keep] if keep else closed:
        if not gz:
            _gzip_segment(path)
    summary = None
    while family_bytes(head) > cap:
        rolled = [(n, path) for n, path, gz in segments(head) if gz]
        if not rolled:
            break  # head, kept and live segments only: the floor of the budget
        summary = summary if summary is not None else _read_summary(head)
        todo = [(n, p) for n, p in rolled if n > summary.get("thinned_through", 0)]
        if thin is not None and todo:
            n, path = todo[0]
            _merge_note(summary, "thinned", _thin_segment(path, thin))
            summary["thinned_through"] = n
            _write_json_atomic(summary_path(head), summary)
        else:
            n, path = rolled[0]
            # write down what goes before it goes
            _merge_note(summary, "dropped", {"bytes": _size(path), **_describe(path)})
            summary["dropped_through"] = n
            _write_json_atomic(summary_path(head), summary)
            os.remove(path)


def _merge_note(summary: dict[str, Any], key: str, note: dict[str, Any]) -> None:
    """One running total per kind of change, however many segments: the summary stays small."""
    into = summary.setdefault(key, {"segments": 0})
    into["segments"] += 1
    for k, v in note.items():
        if k == "first_step" or k == "first_t":
            into[k] = v if into.get(k) is None else min(into[k], v)
        elif k == "last_step" or k == "last_t":
            into[k] = v if into.get(k) is None else max(into[k], v)
        elif isinstance(v, (int, float)):
            into[k] = into.get(k, 0) + v
        else:
            into[k] = v


def rolled_summaries(run_dir: str) -> dict[str, Any]:
    """{file relative to the run: its <file>.rolled.json} for everything rolling thinned or
    dropped (for the manifest)."""
    out = {}
    for path in glob.glob(os.path.join(run_dir, "**", "*.rolled.json"), recursive=True):
        try:
            out[os.path.relpath(path[: -len(".rolled.json")], run_dir)] = _read_json(path)
        except (OSError, ValueError):
            continue
    return out


def _lines_of(path: str) -> Iterator[str]:
    with gzip.open(path, "rt", encoding="utf-8", errors="replace", newline="\n") as f:  # read_text
        for line in f:
            yield line.rstrip("\n")


def _thin_segment(path: str, thin: Thin) -> dict[str, Any]:
    """Stream the segment through thin(lines, note) (a generator of the lines kept; it fills in
    `note`) into a new gzip renamed over it: memory stays one step's worth, whatever the size."""
    note: dict[str, Any] = {}

    def write(tmp: str) -> None:
        with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=6) as f:
            for line in thin(_lines_of(path), note):
                f.write(line + "\n")

    atomic.replace_with(path, write)
    return note


def _describe(path: str) -> dict[str, Any]:
    """What a dropped segment held: its lines, their time span (log, events, dumps all start
    with a time or carry "t"), and for events the steps that ended in it."""
    note: dict[str, Any] = {"lines": 0}

    def seen(key_first: str, key_last: str, value: int) -> None:
        note[key_first] = min(note.get(key_first, value), value)
        note[key_last] = max(note.get(key_last, value), value)

    for line in _lines_of(path):
        note["lines"] += 1
        head = line.split(" ", 1)[0]
        if head.isdigit():
            seen("first_t", "last_t", int(head))
        elif '"t"' in line:
            try:
                e = json.loads(line)
                if isinstance(e.get("t"), int):
                    seen("first_t", "last_t", e["t"])
                if e.get("type") == "step_end" and isinstance(e.get("step"), int):
                    seen("first_step", "last_step", e["step"])
                    note["steps"] = note.get("steps", 0) + 1
            except (ValueError, AttributeError):
                pass
    return note


# -- what thinning keeps, per file kind (generators: lines in, kept lines out) -----------------
MERGED_SPANS = frozenset({"data", "backward", "optimizer", "sync", "collective"})


def thin_events(lines: Iterable[str], note: dict[str, Any]) -> Iterator[str]:
    """Every event, except that each step's spans of one category on one thread become one span
    (`merged`: how many; from the first's start, as long as their sum): the ledger's per-step
    seconds stay, the per-call detail (a collective's group and seq, each sync's site) goes.
    `io` and `gc` spans are rare and stay as they are."""
    merged: dict[tuple[Any, str, Any], tuple[int, int, int]] = {}
    step = None
    note.update(spans_merged=0, spans_left=0)

    def merged_spans() -> Iterator[str]:
        for (_, cat, tid), (start, total, n) in merged.items():
            note["spans_left"] += 1
            yield json.dumps(
                {"type": "span", "cat": cat, "tid": tid, "start": start, "t": start + total, "merged": n}
            )
        merged.clear()

    for line in lines:
        if '"span"' in line or '"step_begin"' in line:
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a corrupt line: the loader would skip it too
            if e.get("type") == "step_begin":
                yield from merged_spans()
                step = e.get("step")
            elif e.get("type") == "span" and e.get("cat") in MERGED_SPANS:
                try:
                    start, end = int(e["start"]), int(e["t"])
                except (KeyError, TypeError, ValueError):
                    continue
                key = (step, e["cat"], e.get("tid"))
                first, total, n = merged.get(key, (start, 0, 0))
                merged[key] = (min(first, start), total + max(0, end - start), n + 1)
                note["spans_merged"] += 1
                continue
        yield line
    yield from merged_spans()


def thin_log(custom: Any = None, gave_up: Callable[[str], None] | None = None) -> Thin:
    """The job's step/loss lines (profiler/logparse.py's formats, `--log-regex`) and nothing else.
    A --log-regex that runs past its bound is dropped for the rest (said in the note, and to
    `gave_up`)."""
    state = {"custom": custom}

    def thin(lines: Iterable[str], note: dict[str, Any]) -> Iterator[str]:
        note["lines_dropped"] = 0
        for line in lines:
            text = line.split(" ", 2)[2] if line.count(" ") >= 2 else ""
            try:
                parsed = parse_line(text, state["custom"])
            except CustomRegexTimeout as exc:
                note["log_regex"] = str(exc)
                state["custom"] = None
                if gave_up is not None:
                    gave_up(str(exc))
                parsed = parse_line(text)
            if parsed:
                yield line
            else:
                note["lines_dropped"] += 1

    return thin


def thin_dumps(lines: Iterable[str], note: dict[str, Any], frames: int = 3) -> Iterator[str]:
    """Each snapshot with its threads' top `frames` frames: the GIL timeline stays."""
    note["snapshots"] = 0
    for line in lines:
        try:
            snap = json.loads(line)
            for th in snap.get("threads", []):
                th["frames"] = (th.get("frames") or [])[:frames]
        except (ValueError, AttributeError, TypeError):
            continue
        note["snapshots"] += 1
        yield json.dumps(snap)


# -- py-spy windows --------------------------------------------------------------------------
_WINDOW = re.compile(r"^(?P<base>.+?)(?:\.w(?P<n>\d{6})|\.(?P<rolled>rolled))?$")
SPEEDSCOPE = ".speedscope.json"


def window_path(out_dir: str, stem_flavour: str, n: int) -> str:
    """Window n's speedscope file: window 0 keeps the name of a run without windows."""
    suffix = "" if n == 0 else f".w{n:06d}"
    return os.path.join(out_dir, f"{stem_flavour}{suffix}{SPEEDSCOPE}")


def rolled_window_path(out_dir: str, stem_flavour: str) -> str:
    return os.path.join(out_dir, f"{stem_flavour}.rolled{SPEEDSCOPE}")


def fold_windows(out_dir: str, stem_flavour: str, through: int, first: int = 1) -> None:
    """Fold windows `first`..`through` into the rolled summary (the windows before `first` are
    start-up, kept whole): per thread, each distinct stack once
    with its summed weight (seconds), then remove their files. The summary says the last window
    it holds (`traindx_folded_through`: they roll off in order), so a window still present after a
    kill between the two steps is not read twice, and the summary does not grow with the run."""
    rolled = rolled_window_path(out_dir, stem_flavour)
    totals: Totals = {}
    folded_through = first - 1
    if os.path.exists(rolled):
        try:
            folded_through = int(_read_json(rolled).get("traindx_folded_through", first - 1))
            _add(totals, load(rolled))
        except Exception:  # an unreadable summary is not silently replaced: keep it aside
            os.replace(rolled, rolled + ".bad")
            totals, folded_through = {}, first - 1
    done = [window_path(out_dir, stem_flavour, n) for n in range(first, folded_through + 1)]
    for n in range(folded_through + 1, through + 1):
        path = window_path(out_dir, stem_flavour, n)
        if os.path.exists(path):
            try:
                _add(totals, load(path))
            except Exception:
                pass  # py-spy left no valid file for this window (killed): nothing to fold
        done.append(path)
    if through > folded_through:
        _write_speedscope(rolled, totals, through, first)
    for path in done:
        if os.path.exists(path):
            os.remove(path)


def _read_json(path: str) -> Any:
    return untrusted.load_json(path, bounded=False)  # a speedscope document: its known fields read


def _add(totals: Totals, threads: dict[str, ThreadSamples]) -> None:
    for name, ts in threads.items():
        per = totals.setdefault(name, {})
        for stack, weight in zip(ts.stacks, ts.weights):
            per[stack] = per.get(stack, 0) + weight


def _write_speedscope(path: str, totals: Totals, folded_through: int, folded_from: int = 1) -> None:
    frames: list[dict[str, Any]] = []
    index: dict[Any, int] = {}
    profiles: list[dict[str, Any]] = []
    for name, stacks in totals.items():
        samples, weights = [], []
        for stack, weight in stacks.items():
            ids = []
            for fr in stack:
                if fr not in index:
                    index[fr] = len(frames)
                    frames.append({"name": fr.name, "file": fr.file, "line": fr.line})
                ids.append(index[fr])
            samples.append(ids)
            weights.append(weight)
        total = sum(weights)
        profiles.append(
            {
                "type": "sampled",
                "name": name,
                "unit": "seconds",
                "startValue": 0,
                "endValue": total,
                "samples": samples,
                "weights": weights,
            }
        )
    doc = {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": frames},
        "profiles": profiles,
        "name": "traindx: py-spy windows rolled off (each distinct stack once)",
        "exporter": "traindx",
        "traindx_folded_through": folded_through,
        "traindx_folded_from": folded_from,
    }
    _write_json_atomic(path, doc)


def load_pyspy(pyspy_dir: str) -> dict[tuple[str, str], tuple[dict[str, ThreadSamples], list[str]]]:
    """{(file stem, 'all'|'gil'): ({thread: ThreadSamples}, [error])}: window 0, the rolled
    summary, then the kept windows in order, each thread's samples concatenated."""
    groups: dict[tuple[str, str], list[tuple[int | None, str]]] = {}
    for path in glob.glob(os.path.join(pyspy_dir, "*" + SPEEDSCOPE)):
        m = _WINDOW.match(os.path.basename(path)[: -len(SPEEDSCOPE)])
        assert m is not None  # the pattern matches any name
        stem, _, source = m["base"].rpartition("-")
        groups.setdefault((stem, source), []).append((None if m["rolled"] else int(m["n"] or 0), path))
    out = {}
    for key, files in sorted(groups.items()):
        threads: dict[str, ThreadSamples] = {}
        errors: list[str] = []
        first, folded = 1, 0
        for n, path in files:
            if n is None:  # the summary: the windows it holds, read in their place
                try:
                    doc = _read_json(path)
                    first = int(doc.get("traindx_folded_from", 1))
                    folded = int(doc.get("traindx_folded_through", 0))
                except (OSError, ValueError):
                    pass
        ordered = sorted(files, key=lambda f: first - 0.5 if f[0] is None else f[0])
        for n, path in ordered:
            if n is not None and first <= n <= folded:
                continue
            try:
                part = load(path)
            except UserError as exc:
                errors.append(str(exc))
                continue
            for name, ts in part.items():
                into = threads.setdefault(name, ThreadSamples(name))
                into.stacks.extend(ts.stacks)
                into.weights.extend(ts.weights)
        if threads or errors:
            out[key] = (threads, errors)
    return out


# -- the launcher's roller -------------------------------------------------------------------
class Roller:
    """Settles every rolling file of a run folder now and then, in the launcher (never in the
    job's processes)."""

    def __init__(self, run_dir: str, budget: Budget, log_regex: str | None = None) -> None:
        self.run_dir = run_dir
        self.budget = budget
        self.log_regex = log_regex
        self.errors: list[str] = []
        self.shed_bytes = 0  # evidence shed under the free-space floor (-1: the floor hit, nothing to shed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # how often: what the job writes between two settles is the budget's overshoot
        self.interval_s = max(0.25, min(5.0, (budget.window_s or 20) / 4))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="traindx-roller", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        waited = 0.0
        while not self._stop.wait(FLOOR_CHECK_S):
            waited += FLOOR_CHECK_S
            if under_floor(self.run_dir):
                self.shed()
            elif waited >= self.interval_s or self.budget.rank_bytes < SMALL_BUDGET_BYTES:
                waited = 0.0
                self.settle_all(live=True)

    def shed(self) -> None:
        """Free space under the floor: every rolled segment goes (what each held is written
        down in its family's rolled.json); only the heads and the last segments stay."""
        before = folder_bytes(self.run_dir)
        self.settle_all(live=True, caps_scale=0.0)
        freed = max(0, before - folder_bytes(self.run_dir))
        if not self.shed_bytes and not freed:
            self.shed_bytes = -1  # said once even when nothing could go
        self.shed_bytes = max(self.shed_bytes, 0) + freed

    def settle_all(self, live: bool, caps_scale: float = 1.0) -> None:
        b = self.budget
        try:
            custom = None
            if self.log_regex:
                custom = compile_custom(self.log_regex)
        except ValueError:
            custom = None
        families: list[tuple[str, int, Thin]] = [
            (path, b.cap(EVENTS_SHARE), thin_events)
            for path in glob.glob(os.path.join(self.run_dir, "events", "*.jsonl"))
        ]
        families += [
            (path, b.cap(DUMPS_SHARE), thin_dumps)
            for path in glob.glob(os.path.join(self.run_dir, "pyspy", "*-dump.jsonl"))
        ]
        log = os.path.join(self.run_dir, "log.txt")
        if os.path.exists(log):
            families.append((log, b.cap(LOG_SHARE), thin_log(custom, self._regex_gave_up)))
        for head, cap, thin in families:
            try:
                settle(head, b.keep, int(cap * caps_scale), None if caps_scale == 0 else thin, live=live)
            except Exception as exc:  # rolling must never stop the run; the loss is said
                if len(self.errors) < 20:
                    self.errors.append(f"rolling {os.path.basename(head)}: {type(exc).__name__}: {exc}")

    def _regex_gave_up(self, message: str) -> None:
        """A --log-regex past its bound: not tried again in this run (each try costs the bound)."""
        self.log_regex = None
        if message not in self.errors:
            self.errors.append(message)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.settle_all(live=False)
