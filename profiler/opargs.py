"""The input shapes and dtypes of the host ops in a torch.profiler window (`trace/<rank>.json.gz`).

The window runs with `with_flops=True`, which makes torch record every op's input sizes and
types ("Input Dims", "Input type" in each cpu_op's args). The main reader (torchtrace.py) keeps
numeric columns only (nested lists would take its Arrow fast path off); this reader takes those
two lists for the cpu_op events, from Kineto's layout (one event over a few lines, its args on
one line), streaming the file line by line. A trace in another layout yields no rows: the
places table then has no FLOPs or bytes, and says so.
"""

from __future__ import annotations

import gzip
import json
import re
from typing import Any

import pandas as pd

from traindx.common.errors import UserError

OPARG_COLUMNS = ["tid", "start_ns", "name", "dims", "types"]
_PH = '"ph": "X"'
_CAT = re.compile(r'"cat": "([^"]*)"')
_NAME = re.compile(r'"name": "((?:[^"\\]|\\.)*)"')
_TID = re.compile(r'"tid": ("[^"]*"|[-0-9]+)')
_TS = re.compile(r'"ts": ([-0-9.eE+]+)')
_DIMS = re.compile(r'"Input Dims": (\[.*?\])(?:, "[A-Z][^"]*":|\s*$)')
_TYPES = re.compile(r'"Input type": (\[.*?\])(?:, "[A-Z][^"]*":|\s*$)')
_BASE = re.compile(r'"baseTimeNanoseconds": (\d+)')
MAX_LINES = 20_000_000  # ~1 GB of JSON: past it the window's shapes are left unread


def _tid(text: str) -> Any:
    text = text.strip('"')
    try:
        return int(text)
    except ValueError:
        return text


def read_op_args(path: str) -> pd.DataFrame:
    """One row per cpu_op with recorded input sizes: tid, start_ns (on the run's clock, as the
    trace table's), name, dims (list per input, [] for a scalar), types (list of dtype names)."""
    rows: list[tuple[Any, float, str, Any, Any]] = []
    base = 0
    event: dict[str, Any] = {}
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i > MAX_LINES:
                    return pd.DataFrame(columns=OPARG_COLUMNS)
                if '"ph": "X"' in line:  # a new event: its keys follow on this line or the next ones
                    event = {"open": True}
                elif not event:
                    if '"baseTimeNanoseconds"' in line:
                        b = _BASE.search(line)
                        base = int(b.group(1)) if b else base
                    continue
                if event.get("cat", "cpu_op") != "cpu_op":
                    continue  # a Python frame, a kernel: no sizes to read
                _keys(line, event)
                if '"Input Dims"' in line:
                    d, ty = _DIMS.search(line), _TYPES.search(line)
                    if d and event.get("cat") == "cpu_op" and "ts" in event and "tid" in event:
                        rows.append(
                            (
                                event["tid"],
                                event["ts"],
                                event.get("name", ""),
                                d.group(1),
                                ty.group(1) if ty else "[]",
                            )
                        )
                    event = {}
    except (OSError, EOFError, ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: the op shapes could not be read ({type(exc).__name__}: {exc})") from None
    if not rows:
        return pd.DataFrame(columns=OPARG_COLUMNS)
    frame = pd.DataFrame(rows, columns=["tid", "ts", "name", "dims", "types"])
    frame["start_ns"] = base + (frame["ts"] * 1000).round().astype("int64")
    frame["dims"] = [_loads(s) for s in frame["dims"]]
    frame["types"] = [_loads(s) for s in frame["types"]]
    return frame[OPARG_COLUMNS]


def _keys(line: str, event: dict[str, Any]) -> None:
    """The event's cat, name, tid and ts where this line holds them (Kineto writes them on one
    line or one a line, by version)."""
    for key, pattern in (("cat", _CAT), ("name", _NAME), ("tid", _TID), ("ts", _TS)):
        if key not in event:
            m = pattern.search(line)
            if m:
                event[key] = (
                    float(m.group(1)) if key == "ts" else _tid(m.group(1)) if key == "tid" else m.group(1)
                )


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return []
