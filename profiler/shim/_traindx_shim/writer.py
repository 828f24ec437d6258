"""Buffered JSONL event writer: hooks append to a deque, a daemon thread flushes every 0.5 s.

Hooks run on the job's hot path, so appending must be cheap and must never raise.
"""
import atexit
import collections
import json
import os
import threading
import time

FLUSH_INTERVAL_S = 0.5


class EventWriter:
    def __init__(self, path, rank):
        self.path = path
        self.rank = rank
        self.pid = os.getpid()
        self._queue = collections.deque()
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8")
        self._thread = threading.Thread(target=self._loop, name="traindx-writer", daemon=True)
        self._thread.start()
        atexit.register(self.flush)

    def emit(self, type_, **fields):
        if os.getpid() != self.pid:  # a forked child (DataLoader worker) is not this rank
            return
        fields["type"] = type_
        fields.setdefault("t", time.time_ns())
        self._queue.append(fields)

    def _loop(self):
        while True:
            time.sleep(FLUSH_INTERVAL_S)
            self.flush()

    def flush(self):
        if os.getpid() != self.pid:
            return
        with self._lock:
            lines = []
            while self._queue:
                event = self._queue.popleft()
                try:
                    lines.append(json.dumps(event, default=repr))
                except Exception as exc:  # an unserialisable field: keep the event, say why
                    lines.append(json.dumps({"type": "shim_error", "t": event.get("t"),
                                             "error": f"unserialisable {event.get('type')}: {exc!r}"}))
            if lines:
                try:
                    self._file.write("\n".join(lines) + "\n")
                    self._file.flush()
                except Exception:
                    pass
