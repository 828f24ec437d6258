"""The parsed event tables cached as Parquet beside the raw files (tables/events/<type>.parquet
and index.json, keyed by the files' names, sizes, mtimes, nodes and offsets: `fingerprint`);
the raw files are never touched. Nested and mixed-type values are stored as JSON text and
decoded on load. traindx.profiler.columnar.EventTables writes and reads them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from traindx.common import untrusted
from traindx.profiler.eventparse import FILE, EventFile
from traindx.profiler.shim._traindx_shim.segments import segments

CACHE_DIR = os.path.join("tables", "events")
CACHE_VERSION = "3"
CACHE_MIN_BYTES = 32 << 20  # smaller runs parse in well under a second: no cache files

# {type: (parquet path, [columns stored as JSON text])}
CachedPaths = dict[str, tuple[str, list[str]]]


def _parquet() -> Any:
    """pyarrow.parquet, imported only when a cache is read or written (~0.1 s of import)."""
    import pyarrow.parquet as pq

    return pq


def fingerprint(files: Sequence[EventFile]) -> str:
    out = []
    for x in files:
        for _, path, _ in [(0, x.path, False)] + segments(x.path):
            st = os.stat(path)
            out.append([x.rel + path[len(x.path) :], st.st_size, st.st_mtime_ns, x.node, x.offset_ns])
    return json.dumps({"version": CACHE_VERSION, "files": out}, separators=(",", ":"))


def read_cache(run_path: str, fp: str | None) -> tuple[dict[str, Any], CachedPaths] | None:
    """(index dict, {type: (parquet path, json columns)}) when the cache matches, else None."""
    folder = os.path.join(run_path, CACHE_DIR)
    try:  # a received folder's tables are untrusted input too: no link, FIFO or device
        index = untrusted.load_json(os.path.join(folder, "index.json"), bounded=False)
    except (OSError, ValueError):
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
    pq = _parquet()
    for p, _ in paths.values():
        try:
            with untrusted.open_file(p) as f:
                pq.read_metadata(f)  # the footer only: a garbage or cut file fails here
        except (OSError, ValueError, pa.ArrowException):
            return None
    return index, paths


def may_read_cache(cache: bool | None) -> bool:
    """Tables already written are read unless the caller or TRAINDX_CACHE=0 says no."""
    return cache is not False and os.environ.get("TRAINDX_CACHE") != "0"


def use_cache(files: Sequence[EventFile], cache: bool | None) -> bool:
    """cache: True/False, or None: only when the events are large (env TRAINDX_CACHE=0|1 wins)."""
    env = os.environ.get("TRAINDX_CACHE")
    if env in ("0", "1"):
        return env == "1"
    if cache is not None:
        return bool(cache)
    return sum(os.path.getsize(x.path) for x in files) >= CACHE_MIN_BYTES


def encode(df: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
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


def decode(df: pd.DataFrame, encoded: list[str]) -> pd.DataFrame:
    """The JSON-text columns of a frame read back as values (NaN where there was none)."""
    for col in encoded:
        df[col] = df[col].map(lambda v: untrusted.loads(v) if isinstance(v, str) else np.nan)
    return df


def write_table(df: pd.DataFrame, path: str) -> None:
    _parquet().write_table(pa.Table.from_pandas(df, preserve_index=False), path)


def read_frame(path: str, encoded: list[str]) -> pd.DataFrame:
    with untrusted.open_file(path) as f:  # checked again: the folder may have changed since
        return decode(_parquet().read_table(f).to_pandas(), encoded)


def node_parts(node_tables: list[tuple[int, CachedPaths]], typ: str) -> list[pd.DataFrame]:
    """pandas parts of `typ` from the nodes' own tables, shaped as a parse gives them (FILE is
    the run-wide file index, no rank column: `_place` labels, shifts and orders them with the
    parsed ones). Nodes whose table has no JSON-text column are read into one Arrow table."""
    pq = _parquet()
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
            parts.append(decode(table.to_pandas(), encoded))
        else:
            plain.append(table)
    if plain:
        table = pa.concat_tables(plain, promote_options="permissive")
        del plain
        parts.insert(0, table.to_pandas())
    return parts
