"""The shim's events as per-type columnar tables, parsed without a Python loop per event.

A run's events are JSONL files (docs/run-record.md); nearly every line is a flat event
(step_begin/step_end/span/gc/alloc: scalars only). Per file, the lines are classified with
numpy over the file's bytes (one '{', no '[', starts with '{' and ends with '}'); the flat ones
go to Arrow's C++ NDJSON reader as one buffer, and only the rare nested lines (process_start's
argv, compile's key_fields/caller...) and a file's last line (it may be cut off) go through
json.loads, so nested fields stay Python dicts and lists as the analyzers read them. A file
whose flat lines Arrow cannot read or type (a corrupt line, a field that is a number in one
line and text in another, an event without type or t) is read line by line with json.loads,
which decides exactly which lines to skip.

Each event type becomes its own table (a step_begin table has step and t, not alloc's eleven
counters): holding every type in one wide frame cost ~7.5 KB per rank-step, mostly empty cells.
Tables are turned into pandas lazily, one type when it is first asked for.

Which files make the run, and each one's node and clock offset, come from `event_files` alone;
ranks, offsets and the (t, file, line) order are applied to every table in `_place`, vectorised.

The parsed tables can be cached as Parquet beside the raw files (tables/events/<type>.parquet,
keyed by the files' names, sizes, mtimes, nodes and offsets); the raw files are never touched.
Nested and mixed-type values are stored there as JSON text and decoded on load.
A node of a multi-node run writes its own (record.write_tables, at its job's end: its own clock,
node-local file indices); a merged run reads them (`node_tables`) through the same `_place`,
which adds each node's offset, so no cache ever holds a shifted copy of a node's times.
"""

import glob
import json
import os
import shutil
import warnings
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from traindx.profiler import nodes
from traindx.profiler.rolling import read_bytes
from traindx.profiler.shim._traindx_shim import schema
from traindx.profiler.shim._traindx_shim.roles import parse_process_file
from traindx.profiler.shim._traindx_shim.segments import segments

CACHE_DIR = os.path.join("tables", "events")
CACHE_VERSION = "3"
CACHE_MIN_BYTES = 32 << 20  # smaller runs parse in well under a second: no cache files
TIME_COLUMNS = ("t", "start")  # ns on the writer's clock: a node's offset applies to these
FILE = "__file"
SEQ = "__seq"

EventFile = namedtuple("EventFile", "path rel node offset_ns")


class TruncatedEvidenceWarning(UserWarning):
    pass


class CorruptEvidenceWarning(TruncatedEvidenceWarning):
    """A line of an evidence file that is not a JSON object was skipped."""


def event_files(run_path, manifest=None):
    """Every events file of the run: (path, path relative to the run, node, clock offset in ns
    to add to its timestamps): events/*.jsonl (node None, offset 0), or for a merged multi-node
    run each node's events/*.jsonl with that node's offset (traindx.profiler.nodes.parts). A long run's
    later segments (X.s000001[.gz]) belong to their head X and are read with it."""
    out = []
    for folder, node, offset in nodes.parts(run_path, manifest or {}):
        for p in sorted(glob.glob(os.path.join(folder, "events", "*.jsonl"))):
            out.append(EventFile(p, os.path.relpath(p, run_path), node, int(offset or 0)))
    return out


# -- validity: the fields every reader relies on -------------------------------------------------
def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


MAX_NS = 2**63 - 1  # a time every reader can hold as int64 ns


def _is_time(value):
    return _is_number(value) and 0 <= value <= MAX_NS


def valid_event(event):
    """type (text), t (ns, a number an int64 holds; `start` too when there is one) and a whole
    step number on steps."""
    if not isinstance(event.get("type"), str) or not _is_time(event.get("t")):
        return False
    if event.get("start") is not None and not _is_time(event["start"]):
        return False
    if event["type"] in (schema.STEP_BEGIN, schema.STEP_END):
        return isinstance(event.get("step"), int)
    return True


# -- one file ----------------------------------------------------------------------------------
def _line_bounds(buf):
    nl = np.flatnonzero(buf == 10)
    starts = np.concatenate([[0], nl + 1])
    ends = np.concatenate([nl, [len(buf)]])
    return starts, ends


def _count_per_line(buf, char, starts):
    """How often `char` occurs in each line: its (few) positions binned by line."""
    at = np.flatnonzero(buf == ord(char))
    return np.bincount(np.searchsorted(starts, at, side="right") - 1, minlength=len(starts))


def _flat_ok(table):
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
    for name in ("t", "start"):  # times an int64 ns holds (else: line by line, named corrupt)
        if name in names:
            col = table[name]
            if not (
                pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_null(col.type)
            ):
                return False
            if col.length() - col.null_count and (pc.min(col).as_py() < 0 or pc.max(col).as_py() > MAX_NS):
                return False
    is_step = pc.is_in(table["type"], pa.array([schema.STEP_BEGIN, schema.STEP_END]))
    if pc.any(is_step).as_py():
        if "step" not in names or not pa.types.is_integer(table["step"].type):
            return False
        if pc.any(pc.and_(is_step, pc.is_null(table["step"]))).as_py():
            return False
    return True


def _parse_file(index, path, data=None, whole_lines=False):
    """{type: arrow table of flat events}, {type: [nested event dicts]}, notes, identity:
    the process_start/rank_known/training events in file order, types present, first t.
    Every row carries FILE (index) and SEQ (line number) for `_place`. data: these bytes
    instead of the file's (the part appended since the last read: traindx.derive.so_far.EventsSoFar);
    whole_lines: they end on a whole line, so the last one is not told apart as a cut-off one."""
    if data is None:
        data = read_bytes(path)  # the head and a long run's segments (profiler/rolling.py)
    buf = np.frombuffer(data, dtype=np.uint8)
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
    flat_tables, nested, notes = {}, {}, []
    table = None
    flat_lines = np.flatnonzero(flat)
    if len(flat_lines):
        # Arrow skips blank lines: blank out the others in a copy, so row i is flat line i
        text = buf.copy()
        for n in np.flatnonzero(nonempty & ~flat).tolist():
            text[starts[n] : ends[n]] = 32
        try:
            table = pa_json.read_json(
                pa.py_buffer(text),
                read_options=pa_json.ReadOptions(use_threads=False, block_size=max(1 << 20, len(data) + 1)),
            )
            if table.num_rows != len(flat_lines) or not _flat_ok(table):
                table = None
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            table = None
        del text
        if table is None:  # line by line: json.loads decides what is an event
            flat[:] = False
            flat_lines = flat_lines[:0]
    slow = np.flatnonzero(nonempty & ~flat)
    bad = []
    for n in slow.tolist():
        text = data[starts[n] : ends[n]].decode("utf-8", errors="replace")
        if not text.strip():
            continue
        try:
            event = json.loads(text)
        except ValueError:
            event = None
        if isinstance(event, dict) and valid_event(event):
            event[FILE] = index
            event[SEQ] = n
            nested.setdefault(event["type"], []).append(event)
        elif n == last and not bad:
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
    first_t = None
    first_seq = None
    if table is not None and table.num_rows:
        table = table.append_column(FILE, pa.array(np.full(table.num_rows, index, np.int32)))
        table = table.append_column(SEQ, pa.array(flat_lines.astype(np.int64)))
        first_t, first_seq = table["t"][0].as_py(), int(flat_lines[0])
        enc = pc.dictionary_encode(table["type"]).combine_chunks()
        codes = enc.indices.to_numpy(zero_copy_only=False)
        types = enc.dictionary.to_pylist()
        if len(types) == 1:
            flat_tables[types[0]] = table
        else:
            order = np.argsort(codes, kind="stable")
            counts = np.bincount(codes, minlength=len(types))
            taken = table.take(pa.array(order))  # one gather; each type is then a slice
            off = 0
            for i, typ in enumerate(types):
                part = taken.slice(off, int(counts[i]))
                off += int(counts[i])
                flat_tables[typ] = part.select(
                    [c for c in part.column_names if part[c].null_count < part.num_rows]
                )
    for rows in nested.values():
        if rows and (first_seq is None or rows[0][SEQ] < first_seq):
            first_t, first_seq = rows[0]["t"], rows[0][SEQ]
    identity = []
    for typ in (schema.PROCESS_START, schema.RANK_KNOWN, schema.TRAINING):
        identity += list(nested.get(typ, ()))
        if typ in flat_tables:
            identity += flat_tables[typ].to_pylist()
    identity.sort(key=lambda e: e[SEQ])
    types = set(flat_tables) | set(nested)
    count = (table.num_rows if table is not None else 0) + sum(len(r) for r in nested.values())
    mins = [e["t"] for rows in nested.values() for e in rows]
    if table is not None and table.num_rows:
        mins.append(pc.min(table["t"]).as_py())
    return (
        flat_tables,
        nested,
        notes,
        {
            "events": identity,
            "types": types,
            "first_t": first_t,
            "count": count,
            "t_min": min(mins) if mins else None,
        },
    )


# -- the run's tables ----------------------------------------------------------------------------
class EventTables:
    """Per-type event tables of one run: `frame(type)` is a pandas DataFrame (one row per
    event, a `rank` column, ordered by t then file order), built on first use and kept."""

    def __init__(
        self, files, labels_by_file, flat, nested, cached=None, summary=None, node_tables=None, kept=None
    ):
        self.files = files
        # FramesKept of the loads before this one (a folder still being written: EventsSoFar):
        # a type's frame is reused when its rows did not change, extended when rows were appended
        self._kept = kept
        # [(index of the node's first file, {type: (parquet path, json columns)})]: the tables a
        # node of a merged run wrote for itself (raw node-clock times, node-local file indices)
        self._node_tables = node_tables or []
        self._summary = summary or [[0, None]] * len(files)  # [event count, min t] per file
        self._labels = labels_by_file  # [label or None] per file index
        self._flat = flat  # {type: [arrow tables]}
        self._nested = nested  # {type: [dicts]}
        self._cached = cached  # {type: parquet path} from a cache hit
        self.cache_error = None  # why write_cache failed, when it did
        self._frames = {}
        self._order = {}  # {type: (file, seq) sort keys of the frame}
        self.types = sorted(
            set(flat) | set(nested) | set(cached or {}) | {t for _, paths in self._node_tables for t in paths}
        )

    def frame(self, typ):
        if typ not in self._frames:
            self._frames[typ] = self._build(typ)
        return self._frames[typ]

    def _build(self, typ):
        if self._cached is not None:
            return self._read_cached(typ) if typ in self._cached else pd.DataFrame()
        if self._kept is not None and not self._node_tables:
            return self._kept.frame(self, typ)
        return self._build_all(typ)

    def _build_all(self, typ):
        if not any(typ in paths for _, paths in self._node_tables):
            tables = _with_scalar_rows(self._flat.get(typ, []), self._nested.get(typ, []))
            if tables:
                self._flat.pop(typ, None)
                self._nested.pop(typ, None)
                return self._place_arrow(typ, tables)
        parts = []
        tables = self._flat.pop(typ, [])
        if tables:
            table = pa.concat_tables(tables, promote_options="permissive")
            tables.clear()
            parts.append(table.to_pandas())
            del table
        rows = self._nested.pop(typ, [])
        if rows:
            parts.append(pd.DataFrame(rows))
        parts += _node_parts(self._node_tables, typ)
        if not parts:
            return pd.DataFrame()
        df = parts[0] if len(parts) == 1 else pd.concat(parts, ignore_index=True, sort=False)
        return self._place(typ, df)

    def _place(self, typ, df):
        """The one vectorised pass: the file's rank label (rows of non-rank processes dropped),
        its clock offset on every timestamp, then order by (t, file, line)."""
        f = df[FILE].to_numpy(np.int64)
        labels = np.array(self._labels + [None], dtype=object)
        rank = labels[f]
        keep = pd.notna(rank)
        offsets = np.array([x.offset_ns for x in self.files] + [0], dtype=np.int64)
        if not keep.all():
            df, f, rank = df[keep], f[keep], rank[keep]
        if offsets.any():
            shift = offsets[f]
            for col in TIME_COLUMNS:
                if col in df:
                    df[col] = df[col] + shift
        df = df.drop(columns=[c for c in ("rank",) if c in df])
        df["rank"] = rank
        if any(x.node is not None for x in self.files):  # a merged multi-node run
            df["node"] = np.array([x.node for x in self.files] + [None], dtype=object)[f]
        t = df["t"].to_numpy()
        if (
            t.dtype != np.int64
            and not np.isnan(t.astype(np.float64)).any()
            and (t.astype(np.float64) == np.floor(t.astype(np.float64))).all()
        ):
            t = df["t"].astype(np.int64).to_numpy()  # exact ns order
        order = np.lexsort((df[SEQ].to_numpy(np.int64), f, t))
        df = df.iloc[order].reset_index(drop=True)
        self._order[typ] = (df[FILE].to_numpy(np.int64), df[SEQ].to_numpy(np.int64))
        df = df.drop(columns=[FILE, SEQ])
        return _objects(df.dropna(axis=1, how="all"))

    def _place_arrow(self, typ, tables):
        """`_place` of a type whose rows are all flat (the common case), done on the Arrow
        table before one conversion: the same frame, without pandas' fixed cost per operation
        (a few ms each, whatever the rows: what a live pass on a short record is made of)."""
        table = tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="permissive")
        tables.clear()
        f = table[FILE].to_numpy().astype(np.int64)
        rank = np.array(self._labels + [None], dtype=object)[f]
        keep = pd.notna(rank)
        if not keep.all():
            table, f, rank = table.filter(pa.array(keep)), f[keep], rank[keep]
        offsets = np.array([x.offset_ns for x in self.files] + [0], dtype=np.int64)
        if offsets.any():
            shift = pa.array(offsets[f])
            for col in TIME_COLUMNS:
                if col in table.column_names:
                    i = table.column_names.index(col)
                    table = table.set_column(i, col, pc.add(table[col], shift))
        if "rank" in table.column_names:
            table = table.drop_columns(["rank"])
        t = table["t"].to_numpy(zero_copy_only=False)
        if (
            t.dtype != np.int64
            and not np.isnan(t.astype(np.float64)).any()
            and (t.astype(np.float64) == np.floor(t.astype(np.float64))).all()
        ):
            t = t.astype(np.int64)  # exact ns order
        seq = table[SEQ].to_numpy().astype(np.int64)
        order = np.lexsort((seq, f, t))
        if (order != np.arange(len(order))).any():
            table = table.take(pa.array(order))
        self._order[typ] = (f[order], seq[order])
        rank = rank[order]
        table = table.drop_columns([FILE, SEQ])
        table = table.select([c for c in table.column_names if table[c].null_count < table.num_rows])
        columns = {}
        for name, col in zip(table.column_names, table.columns):
            if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                # plain object arrays of shared str objects, NaN where the field is absent
                enc = pc.dictionary_encode(col).combine_chunks()
                values = np.empty(len(enc.dictionary) + 1, dtype=object)
                values[:-1] = enc.dictionary.to_pylist()
                values[-1] = np.nan
                codes = enc.indices.fill_null(len(enc.dictionary)).to_numpy()
                columns[name] = values[codes]
            else:
                columns[name] = col.to_pandas()
        columns["rank"] = rank
        if any(x.node is not None for x in self.files):
            columns["node"] = np.array([x.node for x in self.files] + [None], dtype=object)[
                self._order[typ][0]
            ]
        # object arrays stay object (a DataFrame of str arrays would infer pandas' str dtype)
        df = pd.DataFrame(
            {
                k: (
                    pd.Series(v, dtype=object, copy=False)
                    if isinstance(v, np.ndarray) and v.dtype == object
                    else v
                )
                for k, v in columns.items()
            },
            copy=False,
        )
        objects = [
            c
            for c in df.columns
            if df[c].dtype == object
            and c in table.column_names
            and not (pa.types.is_string(table[c].type) or pa.types.is_large_string(table[c].type))
        ] + (["node"] if "node" in columns else [])  # None -> NaN, as _place gives it
        floats = [c for c in df.columns if df[c].dtype.kind == "f" and df[c].isna().all()]
        if floats:
            df = df.drop(columns=floats)
        return _objects(df, objects) if objects else df

    def ranks(self):
        """Labels of the rank files that hold any event."""
        return {label for label, (n, _) in zip(self._labels, self._summary) if label is not None and n}

    def t_min(self):
        ts = [
            t + x.offset_ns
            for label, (n, t), x in zip(self._labels, self._summary, self.files)
            if label is not None and n and t is not None
        ]
        return min(ts) if ts else None

    def order_keys(self, typ):
        self.frame(typ)
        return self._order.get(typ)

    def all_events(self):
        """Every type in one wide frame (the old `events` table): t order, ties in file order.
        Wide and mostly empty: only for callers that need every type at once."""
        frames, keys = [], []
        for typ in self.types:
            df = self.frame(typ)
            if not len(df):
                continue
            frames.append(df)
            keys.append(
                self._order.get(typ) or (np.zeros(len(df), np.int64), np.arange(len(df), dtype=np.int64))
            )
        if not frames:
            return pd.DataFrame()
        df = pd.concat(frames, ignore_index=True, sort=False)
        f = np.concatenate([k[0] for k in keys])
        s = np.concatenate([k[1] for k in keys])
        t = df["t"].to_numpy()
        order = np.lexsort((s, f, t))
        return df.iloc[order].reset_index(drop=True)

    # -- the Parquet cache ---------------------------------------------------------------------
    def write_cache(self, run_path, fingerprint, meta):
        """Write every table to the cache, one type at a time, each let go once written and read
        back from Parquet when used: the parse's memory is not held beside the pandas tables."""
        folder = os.path.join(run_path, CACHE_DIR)
        tmp = folder + f".tmp{os.getpid()}"
        written = {}
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            import pyarrow.parquet as pq

            for i, typ in enumerate(self.types):
                df = self.frame(typ)
                out, encoded = _encode(df)
                f, s = self._order.get(typ) or (np.zeros(len(df), np.int64), np.zeros(len(df), np.int64))
                out[FILE] = f
                out[SEQ] = s
                name = os.path.join(tmp, f"{i}.parquet")
                pq.write_table(pa.Table.from_pandas(out, preserve_index=False), name)
                del out, df
                written[typ] = (name, encoded)
                self._frames.pop(typ, None)
                self._order.pop(typ, None)
            index = dict(
                meta,
                fingerprint=fingerprint,
                types=self.types,
                json_columns={t: enc for t, (_, enc) in written.items()},
            )
            with open(os.path.join(tmp, "index.json"), "w", encoding="utf-8") as fh:
                json.dump(index, fh)
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
            self._cached = {
                t: (os.path.join(folder, os.path.basename(p)), enc) for t, (p, enc) in written.items()
            }
            return True
        except (OSError, ValueError, pa.ArrowException) as exc:
            # a read-only run folder, or a value Parquet cannot hold: the cache is optional;
            # tables already let go come back from what was written before it failed
            cached, self._cached = self._cached, written
            try:
                for typ in written:
                    self._frames[typ] = self._read_cached(typ)
            finally:
                self._cached = cached
                shutil.rmtree(tmp, ignore_errors=True)
            self.cache_error = f"{type(exc).__name__}: {exc}"
            return False

    def _read_cached(self, typ):
        path = self._cached.get(typ)
        if path is None:
            return pd.DataFrame()
        import pyarrow.parquet as pq

        df = pq.read_table(path[0]).to_pandas()
        for col in path[1]:
            df[col] = df[col].map(lambda v: json.loads(v) if isinstance(v, str) else np.nan)
        self._order[typ] = (df.pop(FILE).to_numpy(np.int64), df.pop(SEQ).to_numpy(np.int64))
        return _objects(df)


# a kept frame is extended by its appended rows only from this size on: a build has a fixed
# cost of some milliseconds whatever its rows (pandas), so below it a whole build is cheaper
EXTEND_MIN_ROWS = 2000


def _with_scalar_rows(tables, rows):
    """The Arrow tables of a type with its JSON-parsed rows as one more, when every value of
    those rows is a scalar (a file's last line, a line Arrow's reader left out for its text):
    what pandas would build from them. None when a row holds a list or a dict (kept Python
    objects, as the analyzers read them) or its columns do not type in Arrow."""
    if not rows:
        return list(tables) or None
    scalar = (str, int, float, bool, type(None))
    if any(not isinstance(v, scalar) for e in rows for v in e.values()):
        return None
    keys = list(dict.fromkeys(k for e in rows for k in e))  # every row's fields, in order
    try:
        part = pa.table({k: pa.array([e.get(k) for e in rows]) for k in keys})
        if any(pa.types.is_boolean(c.type) for c in part.columns) or any(
            c.type != pa.int64() for c in (part[FILE], part[SEQ])
        ):
            return None  # pandas keeps True and 1 apart in an object column: its path
        tables = list(tables) + [part]
        if len(tables) > 1:  # one table: the types must meet (else pandas' object columns)
            tables = [pa.concat_tables(tables, promote_options="permissive")]
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
        return None
    return tables


class FramesKept:
    """The pandas frames of one folder's event types, kept from one load to the next (a record
    still being written): pure functions of the rows parsed so far, the files' labels and
    offsets. A type whose rows did not change is the same frame; one whose files only gained
    rows is the kept frame plus the new rows placed alone, when that is what a whole build gives
    (same columns and dtypes, the new rows after the kept ones in (t, file, line) order); else
    it is built whole. Frames are never changed in place (pandas' copy-on-write)."""

    def __init__(self):
        self._frames = {}  # type -> (files key, {file: (flat rows, nested rows)}, frame, order)

    def forget(self, types) -> None:
        """Drop the frames of `types` (their rows were trimmed: EventsSoFar's window)."""
        for typ in types:
            self._frames.pop(typ, None)

    def frame(self, tables, typ):
        files_key = (
            tuple(x.path for x in tables.files),
            tuple(tables._labels),
            tuple(x.offset_ns for x in tables.files),
        )
        flat, nested = tables._flat.get(typ, []), tables._nested.get(typ, [])
        counts = {}
        for t in flat:
            if t.num_rows:
                f = t[FILE][0].as_py()
                counts[f] = (counts.get(f, (0, 0))[0] + t.num_rows, 0)
        for e in nested:
            n, m = counts.get(e[FILE], (0, 0))
            counts[e[FILE]] = (n, m + 1)
        kept = self._frames.get(typ)
        df = None
        if kept is not None and kept[0] == files_key:
            _, before, old, order = kept
            if counts == before:
                df = old
                tables._flat.pop(typ, None)
                tables._nested.pop(typ, None)
            elif len(old) >= EXTEND_MIN_ROWS and all(
                counts.get(f, (0, 0))[0] >= n and counts.get(f, (0, 0))[1] >= m
                for f, (n, m) in before.items()
            ):
                df, order = self._extended(tables, typ, before, old, order)
        if df is None:
            df = tables._build_all(typ)
            order = tables._order.get(typ)
        tables._order[typ] = order
        self._frames[typ] = (files_key, counts, df, order)
        return df

    def _extended(self, tables, typ, before, old, order):
        """(kept frame + the appended rows, its order keys), or (None, None) when a whole
        build would give something else."""
        new_flat = []
        for t in tables._flat.get(typ, []):
            if t.num_rows:
                n = before.get(t[FILE][0].as_py(), (0, 0))[0]
                if t.num_rows > n:
                    new_flat.append(t.slice(n))
        new_nested, seen = [], {}
        for e in tables._nested.get(typ, []):
            seen[e[FILE]] = seen.get(e[FILE], 0) + 1
            if seen[e[FILE]] > before.get(e[FILE], (0, 0))[1]:
                new_nested.append(e)
        part = EventTables(
            tables.files,
            tables._labels,
            {typ: new_flat} if new_flat else {},
            {typ: new_nested} if new_nested else {},
        )
        new = part._build_all(typ)
        if not len(new) or order is None or not len(old):
            return (old, order) if not len(new) else (None, None)
        new_order = part._order.get(typ)
        same = set(new.columns) == set(old.columns) and all(new[c].dtype == old[c].dtype for c in old.columns)
        if not same or new_order is None:
            return None, None
        last = (old["t"].iat[-1], order[0][-1], order[1][-1])
        first = (new["t"].iat[0], new_order[0][0], new_order[1][0])
        if first < last:  # a row appended to one file sorts before one of another's kept rows
            return None, None
        tables._flat.pop(typ, None)
        tables._nested.pop(typ, None)
        df = pd.concat([old, new[list(old.columns)]], ignore_index=True)
        return df, (np.concatenate([order[0], new_order[0]]), np.concatenate([order[1], new_order[1]]))


class RankSubset:
    """EventTables restricted to some ranks (RunRecord.subset): each table filtered on use."""

    def __init__(self, tables, ranks):
        self._tables, self._ranks, self._frames = tables, ranks, {}
        self.types = tables.types
        self.files = tables.files

    def frame(self, typ):
        if typ not in self._frames:
            df = self._tables.frame(typ)
            self._frames[typ] = df[df["rank"].isin(self._ranks).to_numpy()] if len(df) else df
        return self._frames[typ]

    def ranks(self):
        return self._tables.ranks() & self._ranks

    def t_min(self):
        return self._tables.t_min()

    def all_events(self):
        df = self._tables.all_events()
        return df[df["rank"].isin(self._ranks).to_numpy()] if len(df) else df


def _objects(df, columns=None):
    """Text columns as plain object arrays of shared str objects (8 bytes a row: the few
    distinct values are factorised once), NaN where an event has no such field. pandas'
    Arrow-backed str columns cost a conversion per element on every iteration or to_numpy."""
    for col in df.columns if columns is None else columns:
        dtype = df[col].dtype
        if isinstance(dtype, pd.StringDtype):
            codes, uniques = pd.factorize(df[col])
            values = np.empty(len(uniques) + 1, dtype=object)
            values[:-1] = list(uniques)
            values[-1] = np.nan
            df[col] = pd.Series(values[codes], index=df.index, dtype=object)
        elif dtype == object and col != "rank":  # noqa: E721 (a numpy dtype equals object)
            # NaN (not None) marks a field an event does not have, as pandas builds it
            df[col] = df[col].where(df[col].notna(), np.nan)
    return df


def _encode(df):
    """(frame Parquet can hold, [columns stored as JSON text]): dicts, lists and columns that
    mix scalar kinds become JSON text."""
    out = df.copy(deep=False)  # only the encoded columns are replaced: no copy of the rest
    encoded = []
    for col in out.columns:
        if out[col].dtype != object or col == "rank":
            continue
        kind = pd.api.types.infer_dtype(out[col], skipna=True)  # C speed over the column
        if kind not in ("string", "empty"):
            encoded.append(col)
            out[col] = out[col].map(
                lambda v: None if v is None or (isinstance(v, float) and v != v) else json.dumps(v)
            )
    return out, encoded


def _node_parts(node_tables, typ):
    """pandas parts of `typ` from the nodes' own tables, shaped as a parse gives them (FILE is
    the run-wide file index, no rank column: `_place` labels, shifts and orders them with the
    parsed ones). Nodes whose table has no JSON-text column are read into one Arrow table."""
    import pyarrow.parquet as pq

    plain, parts = [], []
    for base, paths in node_tables:
        if typ not in paths:
            continue
        path, encoded = paths[typ]
        table = pq.read_table(path)
        table = table.drop_columns([c for c in ("rank", "node") if c in table.column_names])
        table = table.set_column(
            table.column_names.index(FILE), FILE, pc.add(table[FILE].cast(pa.int64()), base)
        )
        table = table.replace_schema_metadata(None)
        if encoded:
            df = table.to_pandas()
            for col in encoded:
                df[col] = df[col].map(lambda v: json.loads(v) if isinstance(v, str) else np.nan)
            parts.append(df)
        else:
            plain.append(table)
    if plain:
        table = pa.concat_tables(plain, promote_options="permissive")
        del plain
        parts.insert(0, table.to_pandas())
    return parts


def fingerprint(files):
    out = []
    for x in files:
        for _, path, _ in [(0, x.path, False)] + segments(x.path):
            st = os.stat(path)
            out.append([x.rel + path[len(x.path) :], st.st_size, st.st_mtime_ns, x.node, x.offset_ns])
    return json.dumps({"version": CACHE_VERSION, "files": out}, separators=(",", ":"))


def read_cache(run_path, fp):
    """(index dict, {type: (parquet path, json columns)}) when the cache matches, else None."""
    folder = os.path.join(run_path, CACHE_DIR)
    try:
        with open(os.path.join(folder, "index.json"), encoding="utf-8") as fh:
            index = json.load(fh)
    except (OSError, ValueError, RecursionError):
        return None
    # a derived copy: anything wrong with it (garbage, a cut write) and the raw events are parsed
    if not isinstance(index, dict) or index.get("fingerprint") != fp:
        return None
    try:
        paths = {
            typ: (os.path.join(folder, f"{i}.parquet"), index["json_columns"].get(typ, []))
            for i, typ in enumerate(index["types"])
        }
        for key in ("summary", "processes", "labels", "labels_by_file", "notes"):
            index[key]
    except (KeyError, TypeError, AttributeError):
        return None
    import pyarrow.parquet as pq

    for p, _ in paths.values():
        try:
            pq.read_metadata(p)  # the footer only: a garbage or cut file fails here
        except (OSError, ValueError, pa.ArrowException):
            return None
    return index, paths


def parse_files(files, threads=None, indices=None):
    """Per file: (flat tables by type, nested rows by type, notes, identity); on a thread
    pool (Arrow and numpy release the GIL). indices: each file's run-wide index (default:
    its position)."""
    workers = threads or min(4, os.cpu_count() or 1)
    indices = range(len(files)) if indices is None else indices
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda a: _parse_file(a[0], a[1].path), zip(indices, files)))


def warn_all(notes, stacklevel=3):
    for cls, message in notes:
        warnings.warn(message, cls, stacklevel=stacklevel)


def may_read_cache(cache):
    """Tables already written are read unless the caller or TRAINDX_CACHE=0 says no."""
    return cache is not False and os.environ.get("TRAINDX_CACHE") != "0"


def use_cache(files, cache):
    """cache: True/False, or None: only when the events are large (env TRAINDX_CACHE=0|1 wins)."""
    env = os.environ.get("TRAINDX_CACHE")
    if env in ("0", "1"):
        return env == "1"
    if cache is not None:
        return bool(cache)
    return sum(os.path.getsize(x.path) for x in files) >= CACHE_MIN_BYTES


def process_pid(rel):
    return parse_process_file(os.path.basename(rel), ".jsonl")
