"""Reading the torch.profiler window (`trace/<rank>.json.gz`, Chrome trace JSON) into one table.

Kineto writes `ts`/`dur` in µs relative to `baseTimeNanoseconds`, a `time.time_ns()` value, so
start_ns lands on the run's one clock.
"""
import glob
import gzip
import json
import os

import pandas as pd

from traindx.errors import UserError

TRACE_COLUMNS = ["rank", "cat", "name", "start_ns", "end_ns", "dur_s", "pid", "tid", "py_id",
                 "py_parent", "device", "stream"]


def load_trace(path, rank):
    """The complete ('X') events of one trace file as rows of TRACE_COLUMNS."""
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            doc = json.load(f)
        base = int(doc.get("baseTimeNanoseconds") or 0)
        events = doc["traceEvents"]
    except (OSError, EOFError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path} is not a readable torch.profiler trace "
                        f"({type(exc).__name__}: {exc})") from None
    rows = []
    for e in events:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        start = base + int(round(float(e["ts"]) * 1000))
        dur = float(e.get("dur") or 0.0)
        args = e.get("args") or {}
        rows.append((rank, e.get("cat"), e.get("name", ""), start, start + int(round(dur * 1000)),
                     dur / 1e6, e.get("pid"), e.get("tid"), args.get("Python id"),
                     args.get("Python parent id"), args.get("device"), args.get("stream")))
    return rows


def load_traces(run_path):
    """(table of every rank's events, {path: error} for files that could not be read)."""
    rows, errors = [], {}
    for path in sorted(glob.glob(os.path.join(run_path, "trace", "*.json.gz"))):
        rank = os.path.basename(path)[: -len(".json.gz")]
        try:
            rows.extend(load_trace(path, rank))
        except UserError as exc:
            errors[path] = str(exc)
    return pd.DataFrame(rows, columns=TRACE_COLUMNS), errors
