"""Fast, columnar loading of a run's shim events (events/*.jsonl) into the one `events` table.

Same table as `traindx.record.load_run(...).events`: one row per event, a `rank` column (the
file's rank; a process_start event's own `rank` field wins), rows ordered by `t` with ties kept
in file order, a cut-off last line of a file dropped with a TruncatedEvidenceWarning, a corrupt
line elsewhere a UserError (or, with corrupt="skip", dropped with a warning).

Why it is fast: nearly every line is a flat event (step_begin/step_end/gc/alloc: scalars only).
Those lines are handed, per file, to Arrow's C++ NDJSON reader (pyarrow.json, the GIL released,
files parsed on a thread pool); only the few lines holding nested values (process_start's argv,
compile's key_fields/caller, dataloader's caller...) go through json.loads, so nested fields stay
Python dicts and lists exactly as the analyzers read them. A file whose flat lines Arrow cannot
type (a field that is a number in one line and text in another) falls back to json.loads.

The parsed table can be cached as Parquet beside the raw files (`tables/events.parquet`), keyed
by every raw file's name, size and mtime; the raw files are never touched. Nested values are
stored there as JSON text and decoded on load.
"""
import glob
import json
import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.json as pa_json

from traindx.errors import UserError

CACHE = os.path.join("tables", "events.parquet")
CACHE_VERSION = "1"
_SEQ = "__seq"      # (file index, line number): the tie-break that keeps file order
_NESTED_MARK = "traindx.nested_columns"


class TruncatedEvidenceWarning(UserWarning):
    pass


def _record_warning_class():
    # the loader's own class when it is importable, so callers filter one warning type
    try:
        from traindx.record import TruncatedEvidenceWarning as cls
        return cls
    except ImportError:  # pragma: no cover - record.py always exists in the package
        return TruncatedEvidenceWarning


def _is_flat(line):
    """A line Arrow can take as is: one object of scalars (a '{' or '[' inside a string only
    sends the line to json.loads, which is always correct)."""
    return line.count(b"{") == 1 and b"[" not in line


def _parse_file(index, path, rank, corrupt):
    """(arrow table of flat events or None, [nested event dicts], [warnings]) of one file."""
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    last = len(lines) - 1
    while last >= 0 and not lines[last].strip():
        last -= 1
    notes = []
    flat_idx, flat_lines, nested = [], [], []

    def bad(n):
        if n == last:
            notes.append(f"{path}: last line is truncated (the job was killed mid-write); "
                         "it was skipped")
        elif corrupt == "skip":
            notes.append(f"{path}:{n + 1}: corrupt event line; it was skipped")
        else:
            raise UserError(f"{path}:{n + 1}: corrupt event line")

    for n in range(last + 1):
        line = lines[n].strip()
        if not line:
            continue
        if n == last or not _is_flat(line) or not line.startswith(b"{") or not line.endswith(b"}"):
            try:
                event = json.loads(line.decode("utf-8", errors="replace"))
            except ValueError:
                bad(n)
                continue
            if not isinstance(event, dict):
                bad(n)
                continue
            nested.append((n, event))
        else:
            flat_idx.append(n)
            flat_lines.append(line)
    table = None
    if flat_lines:
        try:
            table = pa_json.read_json(
                pa.py_buffer(b"\n".join(flat_lines)),
                read_options=pa_json.ReadOptions(use_threads=False,
                                                 block_size=max(1 << 20, len(data) + 1)))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            # a corrupt line, or a field whose type changes between lines: json.loads decides
            table = None
            for n, line in zip(flat_idx, flat_lines):
                try:
                    event = json.loads(line.decode("utf-8", errors="replace"))
                except ValueError:
                    bad(n)
                    continue
                nested.append((n, event))
            nested.sort(key=lambda item: item[0])
            flat_idx = []
    if table is not None:
        if "rank" in table.column_names:
            table = table.drop_columns(["rank"])
        table = table.append_column("rank", pa.array([rank] * table.num_rows, pa.string()))
        seq = np.asarray(flat_idx, dtype=np.int64) + (np.int64(index) << 40)
        table = table.append_column(_SEQ, pa.array(seq))
    rows = []
    for n, event in nested:
        event = dict(event)
        if event.get("type") == "process_start":
            event["rank"] = str(event.get("rank", rank))
        else:
            event["rank"] = rank
        event[_SEQ] = (index << 40) + n
        rows.append(event)
    return table, rows, notes


def _raw_files(run_path):
    return sorted(glob.glob(os.path.join(run_path, "events", "*.jsonl")))


def _fingerprint(paths):
    out = []
    for p in paths:
        st = os.stat(p)
        out.append([os.path.basename(p), st.st_size, st.st_mtime_ns])
    return json.dumps({"version": CACHE_VERSION, "files": out}, separators=(",", ":"))


def _to_pandas(tables, rows):
    """One frame of the flat (Arrow) and nested (dict) events, ordered by (t, file order).

    Built column by column, each column let go of as soon as it is placed, so the peak is
    about one copy of the table rather than the three a whole-frame concat + reorder needs."""
    flat = nested = None
    if tables:
        table = pa.concat_tables(tables, promote_options="permissive")
        tables.clear()
        flat = table.to_pandas()
        del table
    if rows:
        nested = pd.DataFrame(rows)
    parts = [p for p in (flat, nested) if p is not None]
    if not parts:
        return pd.DataFrame()
    seq = np.concatenate([p[_SEQ].to_numpy(dtype=np.int64) for p in parts])
    if any("t" in p for p in parts):
        t = np.concatenate([pd.to_numeric(p["t"], errors="coerce").to_numpy(dtype=np.float64)
                            if "t" in p else np.full(len(p), np.nan) for p in parts])
        if not np.isnan(t).any():  # exact ns order (float64 would round ns since the epoch)
            t = np.concatenate([p["t"].to_numpy(dtype=np.int64) for p in parts])
        order = np.lexsort((seq, t))
    else:
        order = np.argsort(seq, kind="stable")
    del seq
    names = list(dict.fromkeys(c for p in parts for c in p.columns if c != _SEQ))
    out = {}
    for col in names:
        pieces = [p[[col]] if col in p else pd.DataFrame(index=p.index) for p in parts]
        column = (pieces[0] if len(pieces) == 1 else
                  pd.concat(pieces, ignore_index=True, sort=False))[col]
        for p in parts:
            if col in p:
                del p[col]  # this column is placed: let the source go
        column = column.take(order).reset_index(drop=True)
        if column.dtype == object:
            # NaN (not None) marks a field an event does not have, as pandas builds it from dicts
            column = column.where(column.notna(), np.nan)
        out[col] = column
    return pd.DataFrame(out, copy=False)


def _write_cache(run_path, df, fingerprint, notes):
    """Parquet beside the raw files; nested values (dicts, lists) as JSON text."""
    path = os.path.join(run_path, CACHE)
    nested_cols = []
    out = df.copy()
    for col in out.columns:
        if out[col].dtype == object and out[col].map(lambda v: isinstance(v, (dict, list))).any():
            nested_cols.append(col)
            out[col] = out[col].map(lambda v: json.dumps(v) if v is not None and v == v else None)
        elif out[col].dtype == object:
            # mixed scalars (text and numbers) cannot share a Parquet column: keep them as JSON
            kinds = {type(v) for v in out[col] if v is not None and v == v}
            if len(kinds) > 1 or (kinds and kinds != {str}):
                nested_cols.append(col)
                out[col] = out[col].map(lambda v: json.dumps(v) if v is not None and v == v else None)
    table = pa.Table.from_pandas(out, preserve_index=False)
    meta = dict(table.schema.metadata or {})
    meta[b"traindx.fingerprint"] = fingerprint.encode()
    meta[_NESTED_MARK.encode()] = json.dumps(nested_cols).encode()
    meta[b"traindx.warnings"] = json.dumps(notes).encode()
    table = table.replace_schema_metadata(meta)
    import pyarrow.parquet as pq

    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + f".tmp{os.getpid()}"
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except OSError:  # a read-only run folder: the cache is an optimisation, never required
        pass


def _read_cache(run_path, fingerprint):
    """(df, warnings) from a cache that matches the raw files, else None."""
    path = os.path.join(run_path, CACHE)
    if not os.path.exists(path):
        return None
    import pyarrow.parquet as pq

    try:
        meta = pq.read_schema(path).metadata or {}
        if meta.get(b"traindx.fingerprint", b"").decode() != fingerprint:
            return None
        df = pq.read_table(path).to_pandas()
        nested_cols = json.loads(meta.get(_NESTED_MARK.encode(), b"[]"))
        notes = json.loads(meta.get(b"traindx.warnings", b"[]"))
    except (OSError, ValueError, pa.ArrowException):
        return None  # a damaged cache is rebuilt from the raw files
    for col in nested_cols:
        df[col] = df[col].map(lambda v: json.loads(v) if isinstance(v, str) else np.nan)
    for col in df.columns:
        if df[col].dtype == object:
            df[col] = df[col].where(df[col].notna(), np.nan)
    return df, notes


def load_events(run_path, cache=False, corrupt="error", threads=None):
    """The `events` table of a run folder (see the module doc).

    cache: read tables/events.parquet when it matches the raw files, else parse and write it.
    corrupt: "error" (a UserError, as record.load_run) or "skip" (a warning) for a corrupt line
    that is not a file's last one. threads: parser threads (default: the CPUs, at most 8).
    """
    paths = _raw_files(run_path)
    fingerprint = _fingerprint(paths) if cache else None
    warn_cls = _record_warning_class()
    if cache:
        hit = _read_cache(run_path, fingerprint)
        if hit is not None:
            df, notes = hit
            for note in notes:
                warnings.warn(note, warn_cls, stacklevel=2)
            return df
    ranks = [os.path.basename(p)[: -len(".jsonl")] for p in paths]
    workers = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(lambda a: _parse_file(a[0], a[1], a[2], corrupt),
                                [(i, p, r) for i, (p, r) in enumerate(zip(paths, ranks))]))
    tables = [t for t, _, _ in results if t is not None]
    rows = [row for _, rs, _ in results for row in rs]
    notes = [note for _, _, ns in results for note in ns]
    for note in notes:
        warnings.warn(note, warn_cls, stacklevel=2)
    df = _to_pandas(tables, rows)
    if cache:
        _write_cache(run_path, df, fingerprint, notes)
    return df
