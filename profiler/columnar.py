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

from __future__ import annotations

import glob
import json
import os
import shutil
import warnings
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from traindx.common import atomic
from traindx.profiler import eventcache, nodes
from traindx.profiler.eventcache import CACHE_DIR  # noqa: F401  (re-exported: tests read it here)
from traindx.profiler.eventparse import (  # noqa: F401  (re-exported: the run loader reads them here)
    FILE,
    SEQ,
    CorruptEvidenceWarning,
    EventFile,
    FileParse,
    TruncatedEvidenceWarning,
    parse_file,
    valid_event,
)
from traindx.profiler.shim._traindx_shim.roles import parse_process_file

TIME_COLUMNS = ("t", "start")  # ns on the writer's clock: a node's offset applies to these

Array = npt.NDArray[Any]
OrderKeys = tuple[Array, Array]  # a frame's rows' (file, line) keys


def event_files(run_path: str, manifest: dict[str, Any] | None = None) -> list[EventFile]:
    """Every events file of the run: (path, path relative to the run, node, clock offset in ns
    to add to its timestamps): events/*.jsonl (node None, offset 0), or for a merged multi-node
    run each node's events/*.jsonl with that node's offset (traindx.profiler.nodes.parts). A long run's
    later segments (X.s000001[.gz]) belong to their head X and are read with it."""
    return [
        EventFile(p, os.path.relpath(p, run_path), node, int(offset or 0))
        for folder, node, offset in nodes.parts(run_path, manifest or {})
        for p in sorted(glob.glob(os.path.join(folder, "events", "*.jsonl")))
    ]


# -- the run's tables ----------------------------------------------------------------------------
class EventTables:
    """Per-type event tables of one run: `frame(type)` is a pandas DataFrame (one row per
    event, a `rank` column, ordered by t then file order), built on first use and kept."""

    def __init__(
        self,
        files: Sequence[EventFile],
        labels_by_file: list[str | None],
        flat: dict[str, list[Any]],
        nested: dict[str, list[dict[str, Any]]],
        cached: eventcache.CachedPaths | None = None,
        summary: list[Any] | None = None,
        node_tables: list[tuple[int, eventcache.CachedPaths]] | None = None,
        kept: FramesKept | None = None,
    ) -> None:
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
        self.cache_error: str | None = None  # why write_cache failed, when it did
        self._frames: dict[str, pd.DataFrame] = {}
        self._order: dict[str, OrderKeys | None] = {}  # {type: (file, seq) sort keys of the frame}
        self.types = sorted(
            set(flat) | set(nested) | set(cached or {}) | {t for _, paths in self._node_tables for t in paths}
        )

    def frame(self, typ: str) -> pd.DataFrame:
        if typ not in self._frames:
            self._frames[typ] = self._build(typ)
        return self._frames[typ]

    def _build(self, typ: str) -> pd.DataFrame:
        if self._cached is not None:
            return self._read_cached(typ) if typ in self._cached else pd.DataFrame()
        if self._kept is not None and not self._node_tables:
            return self._kept.frame(self, typ)
        return self._build_all(typ)

    def _build_all(self, typ: str) -> pd.DataFrame:
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
        parts += eventcache.node_parts(self._node_tables, typ)
        if not parts:
            return pd.DataFrame()
        df = parts[0] if len(parts) == 1 else pd.concat(parts, ignore_index=True, sort=False)
        return self._place(typ, df)

    def _place(self, typ: str, df: pd.DataFrame) -> pd.DataFrame:
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
        t = _exact_ns(df["t"].to_numpy())
        order = np.lexsort((df[SEQ].to_numpy(np.int64), f, t))
        df = df.iloc[order].reset_index(drop=True)
        self._order[typ] = (df[FILE].to_numpy(np.int64), df[SEQ].to_numpy(np.int64))
        df = df.drop(columns=[FILE, SEQ])
        return _objects(df.dropna(axis=1, how="all"))

    def _place_arrow(self, typ: str, tables: list[Any]) -> pd.DataFrame:
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
        t = _exact_ns(table["t"].to_numpy(zero_copy_only=False))
        seq = table[SEQ].to_numpy().astype(np.int64)
        order = np.lexsort((seq, f, t))
        if (order != np.arange(len(order))).any():
            table = table.take(pa.array(order))
        self._order[typ] = (f[order], seq[order])
        table = table.drop_columns([FILE, SEQ])
        table = table.select([c for c in table.column_names if table[c].null_count < table.num_rows])
        columns = _arrow_columns(table)
        columns["rank"] = rank[order]
        if any(x.node is not None for x in self.files):
            columns["node"] = np.array([x.node for x in self.files] + [None], dtype=object)[f[order]]
        return _arrow_frame(table, columns)

    def ranks(self) -> set[str]:
        """Labels of the rank files that hold any event."""
        return {label for label, (n, _) in zip(self._labels, self._summary) if label is not None and n}

    def t_min(self) -> int | None:
        ts = [
            t + x.offset_ns
            for label, (n, t), x in zip(self._labels, self._summary, self.files)
            if label is not None and n and t is not None
        ]
        return min(ts) if ts else None

    def all_events(self) -> pd.DataFrame:
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
    def write_cache(self, run_path: str, fingerprint: str | None, meta: dict[str, Any]) -> bool:
        """Write every table to the cache, one type at a time, each let go once written and read
        back from Parquet when used: the parse's memory is not held beside the pandas tables.
        The tables go to a temporary folder renamed onto tables/events/ (a folder: no
        traindx.common.atomic), removed whatever fails."""
        folder = os.path.join(run_path, eventcache.CACHE_DIR)
        tmp = folder + f".tmp{os.getpid()}"
        written: eventcache.CachedPaths = {}
        try:
            # a received folder's planted tables/ link: neither emptied nor written into
            atomic.refuse_links(os.path.join(tmp, "index.json"), root=run_path)
            atomic.refuse_links(os.path.join(folder, "index.json"), root=run_path)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            for i, typ in enumerate(self.types):
                written[typ] = self._write_type(typ, os.path.join(tmp, f"{i}.parquet"))
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
            self.cache_error = f"{type(exc).__name__}: {exc}"
            return False
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # renamed already when all went well

    def _write_type(self, typ: str, name: str) -> tuple[str, list[str]]:
        """Write one type's table to `name` and let its frame go: (name, its JSON columns)."""
        df = self.frame(typ)
        out, encoded = eventcache.encode(df)
        f, s = self._order.get(typ) or (np.zeros(len(df), np.int64), np.zeros(len(df), np.int64))
        out[FILE] = f
        out[SEQ] = s
        eventcache.write_table(out, name)
        del out, df
        self._frames.pop(typ, None)
        self._order.pop(typ, None)
        return name, encoded

    def _read_cached(self, typ: str) -> pd.DataFrame:
        path = (self._cached or {}).get(typ)
        if path is None:
            return pd.DataFrame()
        df = eventcache.read_frame(path[0], path[1])
        self._order[typ] = (df.pop(FILE).to_numpy(np.int64), df.pop(SEQ).to_numpy(np.int64))
        return _objects(df)


# a kept frame is extended by its appended rows only from this size on: a build has a fixed
# cost of some milliseconds whatever its rows (pandas), so below it a whole build is cheaper
EXTEND_MIN_ROWS = 2000


def _with_scalar_rows(tables: list[Any], rows: list[dict[str, Any]]) -> list[Any] | None:
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

    def __init__(self) -> None:
        self._frames: dict[
            str, tuple[Any, Any, pd.DataFrame, OrderKeys | None]
        ] = {}  # type -> (files key, {file: (flat rows, nested rows)}, frame, order)

    def forget(self, types: Iterable[str]) -> None:
        """Drop the frames of `types` (their rows were trimmed: EventsSoFar's window)."""
        for typ in types:
            self._frames.pop(typ, None)

    def frame(self, tables: EventTables, typ: str) -> pd.DataFrame:
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

    def _extended(
        self,
        tables: EventTables,
        typ: str,
        before: dict[int, tuple[int, int]],
        old: pd.DataFrame,
        order: OrderKeys | None,
    ) -> tuple[pd.DataFrame | None, OrderKeys | None]:
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

    def __init__(self, tables: EventTables | RankSubset, ranks: set[str]) -> None:
        self._tables, self._ranks = tables, ranks
        self._frames: dict[str, pd.DataFrame] = {}
        self.types: list[str] = tables.types
        self.files: Sequence[EventFile] = tables.files

    def frame(self, typ: str) -> pd.DataFrame:
        if typ not in self._frames:
            df = self._tables.frame(typ)
            self._frames[typ] = df[df["rank"].isin(self._ranks).to_numpy()] if len(df) else df
        return self._frames[typ]

    def ranks(self) -> set[str]:
        return self._tables.ranks() & self._ranks

    def t_min(self) -> int | None:
        return self._tables.t_min()

    def all_events(self) -> pd.DataFrame:
        df = self._tables.all_events()
        return df[df["rank"].isin(self._ranks).to_numpy()] if len(df) else df


def _exact_ns(t: Array) -> Array:
    """Times as int64 when they are whole numbers in a float column: exact ns order."""
    if (
        t.dtype != np.int64
        and not np.isnan(t.astype(np.float64)).any()
        and (t.astype(np.float64) == np.floor(t.astype(np.float64))).all()
    ):
        return t.astype(np.int64)
    return t


def _arrow_columns(table: Any) -> dict[str, Any]:
    """{name: values} of an Arrow table: text as plain object arrays of shared str objects
    (NaN where the field is absent), the rest as pandas gives it."""
    columns = {}
    for name, col in zip(table.column_names, table.columns):
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            enc = pc.dictionary_encode(col).combine_chunks()
            values = np.empty(len(enc.dictionary) + 1, dtype=object)
            values[:-1] = enc.dictionary.to_pylist()
            values[-1] = np.nan
            codes = enc.indices.fill_null(len(enc.dictionary)).to_numpy()
            columns[name] = values[codes]
        else:
            columns[name] = col.to_pandas()
    return columns


def _arrow_frame(table: Any, columns: dict[str, Any]) -> pd.DataFrame:
    """The frame of _arrow_columns (+ rank, node): as _place builds it from pandas."""
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


def _objects(df: pd.DataFrame, columns: Iterable[str] | None = None) -> pd.DataFrame:
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


def parse_files(
    files: Sequence[EventFile], threads: int | None = None, indices: Sequence[int] | None = None
) -> list[FileParse]:
    """Per file: (flat tables by type, nested rows by type, notes, identity); on a thread
    pool (Arrow and numpy release the GIL). indices: each file's run-wide index (default:
    its position)."""
    workers = threads or min(4, os.cpu_count() or 1)
    indices = range(len(files)) if indices is None else indices
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda a: parse_file(a[0], a[1].path), zip(indices, files)))


def warn_all(notes: Iterable[tuple[type[Warning], str]], stacklevel: int = 3) -> None:
    for cls, message in notes:
        warnings.warn(message, cls, stacklevel=stacklevel)


def process_pid(rel: str) -> int | None:
    return parse_process_file(os.path.basename(rel), ".jsonl")
