"""Buffered JSONL event writer of one process: `events/p<pid>.jsonl`, no other process appends.

Hooks run on the job's hot path, so appending must be cheap and must never raise: they append
to a deque and a daemon thread writes it out every FLUSH_INTERVAL_S. Rare events that say what a
process is (process_start, training, rank_known) or that cost seconds anyway (compile, the
torch.profiler window) are written through at once, with everything queued before them, so a
job killed by a signal (default disposition: no atexit, no handler of ours) loses at most the
last FLUSH_INTERVAL_S of step events. Writing every step through instead costs 68-200 µs a step
on the job's thread vs 5-38 µs queued (bench/writer_cost.py, 3 events a step, on the shared
2-core CI machine, quiet to loaded): 0.3-1 % of a 20 ms step. The interval bounds the cost per
second, not per step.

A long run's file rolls over: past TRAINDX_EVENTS_SEGMENT_BYTES (set by the launcher from its
disk budget) the writer continues in the next segment (segments.py); the launcher compresses,
thins or drops the closed middle segments out of this process (profiler/rolling.py), so the job
never pays for that.

A deferred writer (a multiprocessing child that has not shown training evidence yet: possibly a
DataLoader worker) keeps its events in memory and writes nothing unless it is undeferred.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import threading
import time

from .roles import events_file, open_exclusive_text, report_cpu, start_thread
from .segments import segment_bytes_from_env, segment_path

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

FLUSH_INTERVAL_S = 0.25
MAX_DEFERRED = 10_000
WRITE_THROUGH = frozenset(
    {
        "process_start",
        "training",
        "rank_known",
        "optimizer_created",
        "compile",
        "stop_requested",
        "torch_profile_start",
        "torch_profile",
        "torch_profile_skipped",
    }
)


# traindx/common/redact.py (standard library only), found from this file: in an installed traindx
# the profiler package sits beside common/ (traindx/profiler/shim/...); in a source tree profiler/
# sits beside traindx/ (profiler/shim/...)
_PROFILER_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REDACT_CANDIDATES = (
    os.path.join(os.path.dirname(_PROFILER_DIR), "common", "redact.py"),
    os.path.join(os.path.dirname(_PROFILER_DIR), "traindx", "common", "redact.py"),
)


def utf8_paths(value: Any) -> Any:
    """`value` with every string's undecoded bytes decoded as UTF-8. Under a C/POSIX locale
    without UTF-8 mode the interpreter keeps a non-ASCII path's bytes as lone surrogates
    ('/tmp/\\udcd0\\udcbf...'), while py-spy and a UTF-8 reader name the same file '/tmp/п...':
    written as UTF-8 text, the run's files name one file one way (bytes that are not UTF-8 stay
    as they were)."""
    if isinstance(value, str):
        try:
            return value.encode("utf-8", "surrogateescape").decode("utf-8", "surrogateescape")
        except UnicodeError:  # a surrogate that is no escaped byte
            return value
    if isinstance(value, dict):
        return {utf8_paths(k): utf8_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [utf8_paths(v) for v in value]
    return value


def load_redactor(env: Mapping[str, str], argv: list[str]) -> Any:
    """traindx.common.redact.Redactor of this process's secrets (its environment and arguments), loaded
    from its file (the job's interpreter need not be able to import traindx); None if it cannot
    be (the caller then writes no argument values at all)."""
    import importlib.util  # only where a job writes argument values: the shim's start stays small

    for path in REDACT_CANDIDATES:
        if not os.path.isfile(path):
            continue
        try:
            spec: Any = importlib.util.spec_from_file_location("_traindx_redact", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module.Redactor.for_job(dict(env), list(argv))
        except Exception:
            return None
    return None


def redacted_argv(redactor: Any, argv: list[str]) -> list[str]:
    """argv for an event: secrets hidden; without a redactor only the program name is kept."""
    argv = [str(a) for a in argv]
    if redactor is None:
        return argv[:1] + (["<redacted: traindx's redactor could not be loaded>"] if argv[1:] else [])
    return redactor.argv(argv)


class EventWriter:
    def __init__(self, events_dir: str, deferred: bool = False) -> None:
        self.events_dir = events_dir
        self.pid = os.getpid()
        self.rank = "0"  # the best-known rank label, for other files of this process (traces)
        self.path: Any = None  # the first segment's, once open
        self.deferred = deferred
        self.dropped = 0
        self.tick_hooks = []  # called from the flush thread (cheap checks, e.g. a process group)
        self._queue = collections.deque()
        self._lock = threading.Lock()
        self._file: Any = None  # the open segment
        self._thread: threading.Thread | None = None
        self._segment_bytes = segment_bytes_from_env()
        self._segment = 0
        self._written = 0
        self._wake = threading.Event()  # set by close(): the flush thread ends at once
        atexit.register(self.close)
        if not deferred:
            self._start()

    def _start(self) -> None:
        for attempt in range(100):  # "x": a reused pid never appends to an earlier process's file
            path = os.path.join(self.events_dir, events_file(self.pid, attempt))
            try:
                self._file = open_exclusive_text(path)
                self.path = path
                break
            except FileExistsError:
                continue
        self._thread = threading.Thread(target=self._loop, name="traindx-writer", daemon=True)
        start_thread(self._thread)

    def undefer(self) -> None:
        """This process trains after all: open its file and write what it kept."""
        if self.deferred and os.getpid() == self.pid:
            self.deferred = False
            self._start()
            self.flush()

    def emit(self, type_: str, **fields: Any) -> None:
        if os.getpid() != self.pid:  # a forked child (DataLoader worker) is not this process
            return
        fields["type"] = type_
        fields.setdefault("t", time.time_ns())
        if self.deferred and len(self._queue) >= MAX_DEFERRED:
            self.dropped += 1
            return
        self._queue.append(fields)
        if type_ in WRITE_THROUGH and not self.deferred:
            self.flush()

    def _loop(self) -> None:
        ident = threading.get_ident()
        while not self._wake.wait(FLUSH_INTERVAL_S):
            for hook in self.tick_hooks:
                try:
                    hook()
                except Exception:
                    pass
            self.flush()
            report_cpu(ident, "traindx-writer")  # its CPU for the shim's own cost (selfcost.py)

    def close(self) -> None:
        """At exit (atexit: after the handlers registered later, which may still emit): end the
        flush thread and wait for it, then write what is queued. No thread of ours is then
        mid-write when CPython finalizes and stops daemon threads where they stand (a thread
        stopped inside a buffered write would keep the file's lock for good). The file stays
        open: a handler that runs after this one still writes through flush()."""
        if os.getpid() != self.pid:
            return
        self._wake.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout=2.0)
        self.flush()

    def flush(self) -> None:
        if os.getpid() != self.pid or self.deferred or self._file is None:
            return
        with self._lock:
            lines = []
            while self._queue:
                event = self._queue.popleft()
                try:
                    line = json.dumps(event, default=repr)
                    if "\\udc" in line:  # a path the interpreter could not decode (rare)
                        line = json.dumps(utf8_paths(json.loads(line)))
                    lines.append(line)
                except Exception as exc:  # an unserialisable field: keep the event, say why
                    lines.append(
                        json.dumps(
                            {
                                "type": "shim_error",
                                "t": event.get("t"),
                                "error": f"unserialisable {event.get('type')}: {exc!r}",
                            }
                        )
                    )
            if lines:
                try:
                    self._write(lines)
                except Exception:
                    pass

    def _write(self, lines: list[str]) -> None:
        if not self._segment_bytes:
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()
            return
        # a segment ends on a whole line at its size, however much one flush carries
        chunk, size = [], self._written
        for line in lines:
            chunk.append(line)
            size += len(line) + 1
            if size >= self._segment_bytes:
                self._file.write("\n".join(chunk) + "\n")
                self._file.flush()
                self._next_segment()
                chunk, size = [], 0
        if chunk:
            self._file.write("\n".join(chunk) + "\n")
            self._file.flush()
        self._written = size

    def _next_segment(self) -> None:
        """Close this segment (whole lines only) and continue in the next one."""
        for _ in range(1000):
            self._segment += 1
            try:
                new = open_exclusive_text(segment_path(self.path, self._segment))
            except FileExistsError:
                continue
            self._file.close()
            self._file, self._written = new, 0
            return
