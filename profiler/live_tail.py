"""The live judgement's cheap stage: the events files followed as the shim writes them.

`EventTail` reads only the bytes appended since the last poll (offsets kept; only the step,
compile and span lines parsed) and keeps per-step signals: the step time against its running
median, every kernel's compile keys, a per-step line of span shares (compile time included).
It makes no judgement: it says when the record holds something new worth judging (a
*trigger*) and which span category stands out in it (what its pass reads first); traindx.analyzers.live.live
decides what runs when.
"""

from __future__ import annotations

import glob
import math
import os
import re
import statistics
import time
from collections import deque
from collections.abc import Collection
from typing import Any

from traindx.common import untrusted
from traindx.profiler.eventparse import valid_event

# deep capture: a step this many times the running median (of the last ANOMALY_WINDOW steady
# steps, once ANOMALY_MIN_STEPS are known) or a kernel compiled again is an anomaly
ANOMALY_FACTOR = 2.0
ANOMALY_MIN_STEPS = 3
ANOMALY_WINDOW = 64
# the cheap stage's span line: a share that moved this much (per-category median of the last
# LINE_STEPS steps, so that one odd step moves nothing, against the line at the last judgement)
# is worth a judgement
LINE_SHIFT = 0.15
LINE_STEPS = 5
# the spans of the model's own work: a first line with LINE_SHIFT or more outside them (data,
# gc, unmeasured host time, ...) makes the first judgement urgent; else it waits for room
# beside a reserve, like the cadence (so that a later onset finds the budget full)
MODEL_SPANS = ("forward", "backward", "optimizer")
# slow-step triggers of one process judged at most this often: a checkpoint every 5 steps
# would spend the budget on evidence judged already (a kernel's compiles trigger until its
# finding is shown)
TRIGGERS_PER_SOURCE = 6
FILES_EVERY_S = 2.0  # new events files (a rank that started late) and py-spy
# recordings looked for
RECORDING_SETTLE_S = 1.0  # a recording's file unchanged this long is whole
KEYS_KEPT = 4096  # compile keys remembered per kernel (a long run's memory)
READ_BYTES = 256 << 20  # read per file per poll (the rest next poll): a live run's tail is small
# a span line of the shim: '{"cat": "data", "start": <ns>, "t": <ns>, ...' (read without a JSON
# parse: the cheap stage runs at every step end)
_SPAN = re.compile(rb'^\{"cat": "(\w+)", "start": (\d+), "t": (\d+)', re.MULTILINE)


class EventTail:
    """The cheap stage. Follows events/*.jsonl (and node parts' events) as the shim writes
    them, reading only what was appended since the last poll: step count, last step time,
    compiles and their keys, a per-step line of span shares; and the triggers they raise."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.offsets: dict[str, int] = {}
        self.step = 0
        self.last_step_s: float | None = None
        self.compiles = 0
        self.step_ends = 0
        self._durations: dict[str, list[float]] = {}  # per events file (one process)
        self._keys: dict[str, set[Any]] = {}  # kernel -> compile keys seen
        self._span_s: dict[str, dict[str, float]] = {}  # per file: span seconds since its step
        self._lines: dict[str, deque[dict[str, float]]] = {}  # per file: the last steps' share lines
        self._reference: dict[str, dict[str, float]] = {}  # per file: the line last judged
        self._settling: dict[str, int] = {}
        self._fired: dict[tuple[str, str], int] = {}  # (trigger kind, source) -> times raised
        self.judged_kernels: set[str] = set()  # kernels whose recompiles were shown
        self._compile_due: list[tuple[int, str, str]] = []  # (step, kernel, why): until that step ends
        self.recompiled_in: int | None = None  # first step a kernel compiled again in
        self.anomalies: list[tuple[str, str]] = []  # (kind, why) found since the last take
        self.triggers: list[tuple[str, str]] = []  # (kind, why) worth a judgement
        self.categories: set[str] = set()  # span categories standing out in them
        self._files_at = -math.inf
        self._file_list: list[str] = []
        self._recorded: set[str] = set()  # py-spy recordings already announced

    def take_anomalies(self) -> list[tuple[str, str]]:
        found, self.anomalies = self.anomalies, []
        return found

    def take_triggers(self) -> list[tuple[str, str]]:
        self._compile_due = [(s, k, w) for s, k, w in self._compile_due if k not in self.judged_kernels]
        due = [why for s, _, why in self._compile_due if self.step > s]
        if due:  # the step that compiled again has ended: the analyzer judges finished steps
            self._compile_due = [(s, k, w) for s, k, w in self._compile_due if self.step <= s]
            self.triggers += [("compile", why) for why in due]
        found, self.triggers = self.triggers, []
        return found

    def take_categories(self) -> set[str]:
        found, self.categories = self.categories, set()
        return found

    def outside_categories(self) -> set[str]:
        """The categories outside the model's spans with LINE_SHIFT or more of a recent line."""
        return {
            c
            for lines in self._lines.values()
            if lines
            for c, share in _mean_line(lines).items()
            if c not in MODEL_SPANS and share >= LINE_SHIFT
        }

    def outside_model(self) -> float:
        """The largest share outside the model's spans in any process's recent line."""
        return max(
            (line_outside_model(_mean_line(lines)) for lines in self._lines.values() if lines), default=0.0
        )

    def median_step_s(self) -> float | None:
        """The running median of the recent steady steps' times (every process's), or None."""
        seen = sorted(d for durations in self._durations.values() for d in durations)
        return seen[len(seen) // 2] if seen else None

    def mark_judged(self) -> None:
        """The record as it is now was judged: span lines are compared with this one next."""
        for path, lines in self._lines.items():
            if lines:
                if path not in self._reference:  # the first steps still warm up: re-based
                    self._settling[path] = LINE_STEPS  # on the line of the next ones
                self._reference[path] = _mean_line(lines)

    def _on_step(self, path: str, e: dict[str, Any]) -> None:
        spans = self._span_s.pop(path, {})
        d = e.get("duration_s")
        if not isinstance(d, (int, float)) or int(e.get("step", 0)) < 1:
            return  # step 0 is warm-up
        seen = self._durations.setdefault(path, [])
        if len(seen) >= ANOMALY_MIN_STEPS:
            median = sorted(seen)[len(seen) // 2]
            if median > 0 and d >= ANOMALY_FACTOR * median:
                why = (
                    f"step {e.get('step')} took {d:.3g} s, {d / median:.1f}x the running "
                    f"median {median:.3g} s"
                )
                self.anomalies.append(("slow_step", why))
                self._fired[("slow_step", path)] = fired = self._fired.get(("slow_step", path), 0) + 1
                if fired <= TRIGGERS_PER_SOURCE:
                    self.triggers.append(("slow_step", why))
                    top = _top_outside(_line_of(spans, d))
                    if top is not None:
                        self.categories.add(top)
        seen.append(float(d))
        del seen[:-ANOMALY_WINDOW]
        if d > 0:
            line = _line_of(spans, d)
            lines = self._lines.setdefault(path, deque(maxlen=LINE_STEPS))
            lines.append(line)
            ref = self._reference.get(path)
            if self._settling.get(path):  # a move just triggered: its line settles first
                self._settling[path] -= 1
                if not self._settling[path]:
                    self._reference[path] = _mean_line(lines)
            elif ref is not None and len(lines) == LINE_STEPS:
                now = _mean_line(lines)
                moved = max(
                    (abs(now.get(c, 0.0) - ref.get(c, 0.0)) for c in set(now) | set(ref)), default=0.0
                )
                if moved >= LINE_SHIFT:
                    grown = max(now, key=lambda c: now[c] - ref.get(c, 0.0))
                    if grown not in MODEL_SPANS and now[grown] - ref.get(grown, 0.0) >= LINE_SHIFT:
                        self.categories.add(grown)
                    self.triggers.append(
                        ("line", f"a span share moved by {moved:.0%} by step {e.get('step')}")
                    )
                    self._settling[path] = LINE_STEPS  # one trigger per move

    def _on_compile(self, e: dict[str, Any]) -> None:
        kernel = e.get("kernel")
        if kernel is None:
            return
        key = repr(e.get("key"))
        keys = self._keys.get(kernel)
        step = int(e.get("step") or 0)
        if keys is not None and step >= 1:
            self.anomalies.append(("recompile", f"{kernel} compiled again in step {step}"))
            self.recompiled_in = step if self.recompiled_in is None else min(self.recompiled_in, step)
            # every new key until the kernel's finding is shown: its severity grows with them;
            # a key that reads the same compiled again is a cache miss all the same (FA4's
            # tensor max_seqlen: the key holds the tensor's identity, its text does not), once
            # per kernel and step, TRIGGERS_PER_SOURCE times per kernel
            new_key = key not in keys
            same_key_fired = self._fired.get(("same_key", kernel), 0)
            due_already = (step, kernel) in {(s, k) for s, k, _ in self._compile_due}
            if (
                kernel not in self.judged_kernels
                and not due_already
                and (new_key or same_key_fired < TRIGGERS_PER_SOURCE)
            ):
                if not new_key:
                    self._fired[("same_key", kernel)] = same_key_fired + 1
                self._compile_due.append(
                    (
                        step,
                        kernel,
                        f"{kernel} compiled again in step {step}" + (" with a new key" if new_key else ""),
                    )
                )
        seen = self._keys.setdefault(kernel, set())
        if len(seen) < KEYS_KEPT:
            seen.add(key)

    def _files(self) -> list[str]:
        now = time.monotonic()
        if now - self._files_at >= FILES_EVERY_S:
            self._files_at = now
            self._file_list = glob.glob(os.path.join(self.run_dir, "events", "*.jsonl")) + glob.glob(
                os.path.join(self.run_dir, "nodes", "*", "events", "*.jsonl")
            )
            self._recordings()
        return self._file_list

    def _recordings(self) -> None:
        """A py-spy GIL recording written since the last look (py-spy writes a window's samples
        when the window ends: the first one is short) is new evidence: a `recording` trigger
        (a GIL held by another thread is only seen there). Once its file has stood still for
        RECORDING_SETTLE_S: py-spy writes it in one go at the window's end."""
        now = time.time()
        for path in glob.glob(os.path.join(self.run_dir, "pyspy", "*-gil*.speedscope.json")) + glob.glob(
            os.path.join(self.run_dir, "nodes", "*", "pyspy", "*-gil*.speedscope.json")
        ):
            if path in self._recorded or ".rolled." in path:
                continue
            try:
                settled = now - os.path.getmtime(path) >= RECORDING_SETTLE_S
            except OSError:
                continue
            if settled:
                self._recorded.add(path)
                self.triggers.append(("recording", f"py-spy wrote {os.path.basename(path)}"))

    def poll(self) -> bool:
        """True when a step ended since the last poll."""
        before = self.step_ends
        for path in self._files():
            try:  # a run folder's file: no link, FIFO or device; a poll reads at most READ_BYTES
                with untrusted.open_file(path) as f:
                    f.seek(self.offsets.get(path, 0))
                    chunk = f.read(READ_BYTES)
            except OSError:
                continue
            complete = chunk[: chunk.rfind(b"\n") + 1]
            if not complete:
                continue
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            self._read(path, complete)
        return self.step_ends > before

    def _read(self, path: str, complete: bytes) -> None:
        spans = self._span_s.setdefault(path, {})
        if b'"step_end"' not in complete and b'"compile"' not in complete:
            for cat, start, end in _SPAN.findall(complete):  # most chunks: spans only
                c = cat.decode()
                spans[c] = spans.get(c, 0.0) + (int(end) - int(start)) / 1e9
            return
        for line in complete.splitlines():
            if line.startswith(b'{"cat": '):
                m = _SPAN.match(line)
                if m:
                    c = m.group(1).decode()
                    spans = self._span_s.setdefault(path, {})
                    spans[c] = spans.get(c, 0.0) + (int(m.group(3)) - int(m.group(2))) / 1e9
                continue
            if b'"step_end"' not in line and b'"compile"' not in line:
                continue  # most lines are spans: skip their JSON parse
            try:
                e = untrusted.loads(line)
                if isinstance(e, dict) and valid_event(e):
                    self._on_event(path, e)
            except (ValueError, TypeError):  # a line of the wrong types is corrupt: skipped
                continue

    def _on_event(self, path: str, e: dict[str, Any]) -> None:
        if e.get("type") == "step_end":
            self.step_ends += 1
            self.step = max(self.step, int(e.get("step", -1)) + 1)
            d = e.get("duration_s")
            self.last_step_s = d if isinstance(d, (int, float)) and math.isfinite(d) else None
            self._on_step(path, e)
        elif e.get("type") == "compile":
            self.compiles += 1
            self._on_compile(e)
            start, end = e.get("start"), e.get("t")
            if isinstance(start, (int, float)) and isinstance(end, (int, float)) and end > start:
                # a compile pauses the step as a span does: its time is the line's `compile`
                spans = self._span_s.setdefault(path, {})
                spans["compile"] = spans.get("compile", 0.0) + (end - start) / 1e9


def _line_of(spans: dict[str, float], duration_s: float) -> dict[str, float]:
    """A step's span line: each category's share of the step, `other` what no span covers.
    An optimizer step's closure (Lightning's training_step) nests forward and backward inside
    the optimizer's span: as in the ledger, the closure's time outside them is the job's own
    host code (`other`) and the optimizer's line is its time outside the closure."""
    spans = dict(spans)
    closure = spans.pop("closure", 0.0)
    if closure:
        spans["optimizer"] = max(0.0, spans.get("optimizer", 0.0) - closure)
    line = {cat: min(s / duration_s, 1.0) for cat, s in spans.items()}
    line["other"] = max(0.0, 1.0 - sum(line.values()))
    return line


def _top_outside(line: dict[str, float]) -> str | None:
    """The category outside the model's spans with the largest share of a step, if any has
    LINE_SHIFT or more."""
    outside = {c: v for c, v in line.items() if c not in MODEL_SPANS}
    top = max(outside, key=lambda c: outside[c], default=None)
    return top if top is not None and outside[top] >= LINE_SHIFT else None


def _mean_line(lines: Collection[dict[str, float]]) -> dict[str, float]:
    """Per category, the median share of the steps' lines (one odd step of LINE_STEPS moves
    nothing). Of an even count, the mean of the middle two: the upper one of every category
    summed to more than the step (of two lines, a cold first step's forward and the next
    step's GC each counted whole: 9 % outside the model where half the time was)."""
    cats = set().union(*lines)
    return {c: statistics.median(line.get(c, 0.0) for line in lines) for c in cats}


def line_outside_model(line: dict[str, float] | None) -> float:
    """The share of a span line outside the model's own forward/backward/optimizer spans."""
    if not line:
        return 0.0
    return 1.0 - min(1.0, float(sum(line.get(c, 0.0) for c in MODEL_SPANS)))
