"""The live judgement's read of a run folder still being written: only what was appended since
the last load is parsed, and a long run keeps a rolling window of its per-step events.

`EventsSoFar` is carried from one `load_run(path, so_far=...)` to the next. With `keep_steps`,
each events file keeps the rows of its per-step event types (PER_STEP_TYPES: steps, spans, GC
pauses, host samples, ...) from its last `keep_steps` steps only (trimmed once the file holds
TRIM_SLACK more: the window is keep_steps to keep_steps * (1 + TRIM_SLACK) steps); every other
event (who a process is, its DataLoaders, its compiles, the sampled frames' names) is kept
whole. A days-long run then costs the live judgement a bounded memory and a bounded pass: a
pass judges the record of the window, what the batch analysis of those rows gives
(tests/test_live.py). Running totals of what was trimmed are kept (`dropped`, `steps_dropped`).
Derive layer: no judgement here.
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from traindx.common import untrusted
from traindx.profiler import columnar
from traindx.profiler.columnar import FileParse
from traindx.profiler.shim._traindx_shim import schema
from traindx.profiler.shim._traindx_shim.segments import segments

# event types written once a step or more (a long run's growth); the rest are a few rows a
# process (identity, DataLoader sites, sampled frames' names, compiles and their keys)
PER_STEP_TYPES = frozenset(
    {
        schema.STEP_BEGIN,
        schema.STEP_END,
        schema.SPAN,
        schema.GC,
        schema.ALLOC,
        schema.CPU,
        schema.HOST_SAMPLES,
        schema.GPU_TIME,
        schema.FA4_CALL,
    }
)
TRIM_SLACK = 0.25


class EventsSoFar:
    """The parsed events of a run folder still being written, kept from one load to the next
    (`load_run(path, so_far=...)`: the live judgement's incremental read): each events file is
    parsed again only from the byte where the last load stopped, its complete lines only; the
    rows already parsed are kept (with `keep_steps`: those of the file's last keep_steps steps,
    for the per-step event types). A file that shrank or rolled into segments is parsed whole.
    The tables it gives are the batch parse's of the rows kept (same rows, same FILE/SEQ keys)."""

    def __init__(self, keep_steps: int | None = None) -> None:
        self.keep_steps = keep_steps
        self._files: dict[
            str, tuple[int, int, tuple[Any, Any, Any, Any, int]]
        ] = {}  # path -> (bytes parsed, lines parsed, that part's parse result)
        self.frames = columnar.FramesKept()  # the pandas tables of the last load, per type
        self.dropped: dict[str, int] = {}  # rows trimmed off so far, per event type
        self.steps_dropped = 0  # step_end rows trimmed off so far (all files)

    def kept_rows(self) -> int:
        """Rows held now, every file and type (what the window bounds)."""
        n = 0
        for _, _, (flat, nested, _, _, _) in self._files.values():
            n += sum(t.num_rows for t in flat.values()) + sum(len(r) for r in nested.values())
        return n

    def parse(self, files: list[columnar.EventFile], indices: list[int]) -> list[FileParse]:
        out = []
        for i, x in zip(indices, files):
            try:
                out.append(self._parse_one(i, x.path))
            except (OSError, ValueError, pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                self._files.pop(x.path, None)
                out.append(columnar.parse_file(i, x.path))
        return out

    def _parse_one(self, index: int, path: str) -> FileParse:
        size = os.path.getsize(path)
        done, lines, old = self._files.get(path, (0, 0, None))
        if size < done or segments(path) or (old is not None and old[4] != index):
            if old is not None:  # the frames kept were of rows that are no longer the file's
                self.frames = columnar.FramesKept()
            done, lines, old = 0, 0, None  # shrank, rolled, or another file index: whole
        with untrusted.open_file(path) as f:  # a run folder's file: no link, FIFO or device
            f.seek(done)
            data = f.read(size - done)
        data = data[: data.rfind(b"\n") + 1]  # complete lines only: the rest comes next time
        if not data and old is not None:
            return old[:4]
        new = columnar.parse_file(index, path, data=data, whole_lines=True)
        merged = new if old is None else _merge_parts(old[:4], _shift_seq(new, lines))
        if self.keep_steps:
            merged = self._trim(merged)
        self._files[path] = (done + len(data), lines + data.count(b"\n"), (*merged, index))
        return merged

    def _trim(self, part: FileParse) -> FileParse:
        """The part without its per-step rows before its last keep_steps steps, once it holds
        TRIM_SLACK more steps than that."""
        flat, nested, notes, ident = part
        begins = _times(flat, nested, schema.STEP_BEGIN)
        keep = int(self.keep_steps or 0)
        if len(begins) <= keep + max(1, int(keep * TRIM_SLACK)):
            return part
        begins.sort()
        cutoff = begins[-keep]
        flat, nested = dict(flat), dict(nested)
        trimmed = set()
        for typ in PER_STEP_TYPES & set(flat):
            tab = flat[typ]
            kept = (
                tab.filter(pc.fill_null(pc.greater_equal(tab["t"], pa.scalar(cutoff, tab["t"].type)), True))
                if "t" in tab.schema.names
                else tab
            )
            if kept.num_rows < tab.num_rows:
                self._count(typ, tab.num_rows - kept.num_rows)
                flat[typ] = kept
                trimmed.add(typ)
        for typ in PER_STEP_TYPES & set(nested):
            rows = nested[typ]
            kept = [e for e in rows if not isinstance(e.get("t"), (int, float)) or e["t"] >= cutoff]
            if len(kept) < len(rows):
                self._count(typ, len(rows) - len(kept))
                nested[typ] = kept
                trimmed.add(typ)
        # a kept frame of a trimmed type is of rows no longer held: built again
        self.frames.forget(trimmed)
        return flat, nested, notes, ident

    def _count(self, typ: str, n: int) -> None:
        self.dropped[typ] = self.dropped.get(typ, 0) + n
        if typ == schema.STEP_END:
            self.steps_dropped += n


def _times(flat: dict[str, Any], nested: dict[str, list[dict[str, Any]]], typ: str) -> list[Any]:
    out = []
    tab = flat.get(typ)
    if tab is not None and "t" in tab.schema.names:
        out += [t for t in tab["t"].to_pylist() if t is not None]
    out += [e["t"] for e in nested.get(typ, ()) if isinstance(e.get("t"), (int, float))]
    return out


def _shift_seq(part: FileParse, lines: int) -> FileParse:
    """A parse of appended bytes with its line numbers counted from the file's start."""
    flat, nested, notes, ident = part
    flat = {
        t: tab.set_column(
            tab.schema.get_field_index(columnar.SEQ),
            columnar.SEQ,
            pc.add(tab[columnar.SEQ], pa.scalar(lines, pa.int64())),
        )
        for t, tab in flat.items()
    }
    shifted = set()
    for rows in nested.values():
        for e in rows:
            e[columnar.SEQ] += lines
            shifted.add(id(e))
    for e in ident["events"]:  # the nested ones are the same objects: shifted once
        if id(e) not in shifted:
            e[columnar.SEQ] += lines
    return flat, nested, notes, ident


def _merge_parts(old: FileParse, new: FileParse) -> FileParse:
    """One file's parse result from its earlier part's and its appended part's."""
    (f0, n0, notes0, i0), (f1, n1, notes1, i1) = old, new
    flat = dict(f0)
    for t, tab in f1.items():
        flat[t] = pa.concat_tables([flat[t], tab], promote_options="permissive") if t in flat else tab
    nested = {t: list(rows) for t, rows in n0.items()}
    for t, rows in n1.items():
        nested.setdefault(t, []).extend(rows)
    mins = [t for t in (i0["t_min"], i1["t_min"]) if t is not None]
    ident = {
        "events": i0["events"] + i1["events"],
        "types": i0["types"] | i1["types"],
        "first_t": i0["first_t"] if i0["first_t"] is not None else i1["first_t"],
        "count": i0["count"] + i1["count"],
        "t_min": min(mins) if mins else None,
    }
    return flat, nested, notes0 + notes1, ident
