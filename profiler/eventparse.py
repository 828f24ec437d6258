"""One events file parsed into per-type Arrow tables without a Python loop per event
(traindx.profiler.columnar's parse; its docstring tells the whole design)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from traindx.common import untrusted
from traindx.profiler.rolling import read_bytes
from traindx.profiler.shim._traindx_shim import schema

FILE = "__file"
SEQ = "__seq"
MAX_NS = 2**63 - 1  # a time every reader can hold as int64 ns

Array = npt.NDArray[Any]
Notes = list[tuple[type[Warning], str]]
# one file parsed: {type: Arrow table of its flat events}, {type: [nested event dicts]}, notes
# (warning class, message), identity (events: process_start/rank_known/training in file order,
# types, first_t, count, t_min)
FileParse = tuple[dict[str, Any], dict[str, list[dict[str, Any]]], Notes, dict[str, Any]]


class EventFile(NamedTuple):
    """One events file of a run (traindx.profiler.columnar.event_files)."""

    path: str
    rel: str  # the path relative to the run folder
    node: str | None  # a merged multi-node run's node, else None
    offset_ns: int  # added to the file's times (its node's clock offset)


class TruncatedEvidenceWarning(UserWarning):
    pass


class CorruptEvidenceWarning(TruncatedEvidenceWarning):
    """A line of an evidence file that is not a JSON object was skipped."""


# -- validity: the fields every reader relies on -------------------------------------------------
def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _is_time(value: Any) -> bool:
    return _is_number(value) and 0 <= value <= MAX_NS


def valid_event(event: dict[str, Any]) -> bool:
    """type (text), t (ns, a number an int64 holds; `start` too when there is one) and a whole
    step number on steps."""
    if not isinstance(event.get("type"), str) or not _is_time(event.get("t")):
        return False
    if event.get("start") is not None and not _is_time(event["start"]):
        return False
    if event["type"] in (schema.STEP_BEGIN, schema.STEP_END):
        step = event.get("step")  # an int64 (10**23 is no step number any table can hold)
        return isinstance(step, int) and not isinstance(step, bool) and -MAX_NS - 1 <= step <= MAX_NS
    return True


# -- one file ----------------------------------------------------------------------------------
def _line_bounds(buf: Array) -> tuple[Array, Array]:
    nl = np.flatnonzero(buf == 10)
    starts = np.concatenate([[0], nl + 1])
    ends = np.concatenate([nl, [len(buf)]])
    return starts, ends


def _count_per_line(buf: Array, char: str, starts: Array) -> Array:
    """How often `char` occurs in each line: its (few) positions binned by line."""
    at = np.flatnonzero(buf == ord(char))
    return np.bincount(np.searchsorted(starts, at, side="right") - 1, minlength=len(starts))


def _times_ok(table: Any) -> bool:
    """t and start, where present, are numbers an int64 ns holds (else: line by line, named
    corrupt)."""
    names = table.column_names
    for name in ("t", "start"):
        if name in names:
            col = table[name]
            if not (
                pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_null(col.type)
            ):
                return False
            if col.length() - col.null_count and (pc.min(col).as_py() < 0 or pc.max(col).as_py() > MAX_NS):
                return False
    return True


def _flat_ok(table: Any) -> bool:
    """Arrow's table of flat lines is usable as is: every row a valid event."""
    names = table.column_names
    if "type" not in names or "t" not in names:
        return False
    typ, t = table["type"].type, table["t"].type
    if not pa.types.is_string(typ) or not (pa.types.is_integer(t) or pa.types.is_floating(t)):
        return False
    if table["type"].null_count or table["t"].null_count:
        return False
    if pa.types.is_floating(t) and pc.any(pc.is_nan(table["t"])).as_py():
        return False
    if not _times_ok(table):
        return False
    is_step = pc.is_in(table["type"], pa.array([schema.STEP_BEGIN, schema.STEP_END]))
    if pc.any(is_step).as_py():
        if "step" not in names or not pa.types.is_integer(table["step"].type):
            return False
        if pc.any(pc.and_(is_step, pc.is_null(table["step"]))).as_py():
            return False
    return True


@dataclass
class _Lines:
    """The lines of a file's bytes: bounds, which are non-empty, which are flat events."""

    starts: Array
    ends: Array
    nonempty: Array
    flat: Array
    last: int  # the last non-empty line, -1 without one

    @classmethod
    def of(cls, buf: Array, whole_lines: bool) -> _Lines:
        starts, ends = _line_bounds(buf)
        nonempty = ends > starts
        idx = np.flatnonzero(nonempty)
        last = int(idx[-1]) if len(idx) else -1
        opens = _count_per_line(buf, "{", starts)
        lists = _count_per_line(buf, "[", starts)
        if len(buf):
            first_c = buf[np.minimum(starts, len(buf) - 1)]
            last_c = buf[np.maximum(ends - 1, 0)]
        else:
            first_c = last_c = np.zeros(len(starts), np.uint8)
        flat = nonempty & (opens == 1) & (lists == 0) & (first_c == ord("{")) & (last_c == ord("}"))
        if last >= 0 and not whole_lines:
            flat[last] = False  # a cut-off last line is told apart by json.loads
        return cls(starts, ends, nonempty, flat, last)


def _read_flat(buf: Array, size: int, lines: _Lines) -> Any:
    """Arrow's table of the flat lines (row i: flat line i), or None when Arrow cannot read or
    type them (every line then goes through json.loads: lines.flat cleared)."""
    # Arrow skips blank lines: blank out the others in a copy, so row i is flat line i
    text = buf.copy()
    for n in np.flatnonzero(lines.nonempty & ~lines.flat).tolist():
        text[lines.starts[n] : lines.ends[n]] = 32
    try:
        table = pa_json.read_json(
            pa.py_buffer(text),
            read_options=pa_json.ReadOptions(use_threads=False, block_size=max(1 << 20, size + 1)),
        )
        if table.num_rows != int(lines.flat.sum()) or not _flat_ok(table):
            table = None
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        table = None
    del text
    if table is None:  # line by line: json.loads decides what is an event
        lines.flat[:] = False
    return table


def _read_slow(
    data: bytes, lines: _Lines, index: int, path: str
) -> tuple[dict[str, list[dict[str, Any]]], Notes]:
    """The lines that are not flat events, through json.loads: ({type: [event dicts]}, notes
    on the lines skipped)."""
    nested: dict[str, list[dict[str, Any]]] = {}
    notes: Notes = []
    bad = []
    for n in np.flatnonzero(lines.nonempty & ~lines.flat).tolist():
        text = data[lines.starts[n] : lines.ends[n]].decode("utf-8", errors="replace")
        if not text.strip():
            continue
        try:
            event = untrusted.loads(text)  # nesting bounded: a line 200,000 deep is corrupt
        except ValueError:
            event = None
        if isinstance(event, dict) and valid_event(event):
            event[FILE] = index
            event[SEQ] = n
            nested.setdefault(event["type"], []).append(event)
        elif n == lines.last and not bad:
            notes.append(
                (
                    TruncatedEvidenceWarning,
                    f"{path}:{n + 1}: last line is truncated (the job was killed mid-write); it was skipped",
                )
            )
        else:
            bad.append(n + 1)
    if bad:
        where = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        notes.append(
            (CorruptEvidenceWarning, f"{path}: corrupt line{'s' if len(bad) > 1 else ''} {where} skipped")
        )
    return nested, notes


def _split_types(table: Any, index: int, flat_lines: Array) -> dict[str, Any]:
    """{type: its rows of the flat table, with FILE and SEQ; its all-null columns left out}."""
    table = table.append_column(FILE, pa.array(np.full(table.num_rows, index, np.int32)))
    table = table.append_column(SEQ, pa.array(flat_lines.astype(np.int64)))
    enc = pc.dictionary_encode(table["type"]).combine_chunks()
    codes = enc.indices.to_numpy(zero_copy_only=False)
    types = enc.dictionary.to_pylist()
    if len(types) == 1:
        return {types[0]: table}
    flat_tables = {}
    order = np.argsort(codes, kind="stable")
    counts = np.bincount(codes, minlength=len(types))
    taken = table.take(pa.array(order))  # one gather; each type is then a slice
    off = 0
    for i, typ in enumerate(types):
        part = taken.slice(off, int(counts[i]))
        off += int(counts[i])
        flat_tables[typ] = part.select([c for c in part.column_names if part[c].null_count < part.num_rows])
    return flat_tables


def _identity(
    table: Any, flat_tables: dict[str, Any], nested: dict[str, list[dict[str, Any]]], flat_lines: Array
) -> dict[str, Any]:
    """The file's identity events (process_start, rank_known, training) in file order, its
    types, first t, event count and min t."""
    first_t = None
    first_seq = None
    if table is not None and table.num_rows:
        first_t, first_seq = table["t"][0].as_py(), int(flat_lines[0])
    for rows in nested.values():
        if rows and (first_seq is None or rows[0][SEQ] < first_seq):
            first_t, first_seq = rows[0]["t"], rows[0][SEQ]
    identity = []
    for typ in (schema.PROCESS_START, schema.RANK_KNOWN, schema.TRAINING):
        identity += list(nested.get(typ, ()))
        if typ in flat_tables:
            identity += flat_tables[typ].to_pylist()
    identity.sort(key=lambda e: e[SEQ])
    count = (table.num_rows if table is not None else 0) + sum(len(r) for r in nested.values())
    mins = [e["t"] for rows in nested.values() for e in rows]
    if table is not None and table.num_rows:
        mins.append(pc.min(table["t"]).as_py())
    return {
        "events": identity,
        "types": set(flat_tables) | set(nested),
        "first_t": first_t,
        "count": count,
        "t_min": min(mins) if mins else None,
    }


def parse_file(index: int, path: str, data: bytes | None = None, whole_lines: bool = False) -> FileParse:
    """{type: arrow table of flat events}, {type: [nested event dicts]}, notes, identity:
    the process_start/rank_known/training events in file order, types present, first t.
    Every row carries FILE (index) and SEQ (line number) for `_place`. data: these bytes
    instead of the file's (the part appended since the last read: traindx.derive.so_far.EventsSoFar);
    whole_lines: they end on a whole line, so the last one is not told apart as a cut-off one."""
    read_notes: list[str] = []
    if data is None:
        try:  # the head and a long run's segments (profiler/rolling.py), as untrusted input
            data = read_bytes(path, read_notes)
        except OSError as exc:
            note = (CorruptEvidenceWarning, f"{path}: not read ({exc.strerror}); its events are left out")
            return {}, {}, [note], _identity(None, {}, {}, np.zeros(0, np.int64))
    buf = np.frombuffer(data, dtype=np.uint8)
    lines = _Lines.of(buf, whole_lines)
    table = _read_flat(buf, len(data), lines) if lines.flat.any() else None
    flat_lines = np.flatnonzero(lines.flat)
    nested, notes = _read_slow(data, lines, index, path)
    notes += [(CorruptEvidenceWarning, note) for note in read_notes]
    flat_tables = _split_types(table, index, flat_lines) if table is not None and table.num_rows else {}
    return flat_tables, nested, notes, _identity(table, flat_tables, nested, flat_lines)
