"""Read an op-level trace in the format of ByteDance's straggler study (OSDI'25,
github.com/ByteDance-Seed/StragglerAnalysis): `trace-NAME.parquet`, one row per recorded op
(dp_rank, stage, rank, step, optype, start_ts, duration, seq_id, mc, gmc, mb_id), and
`meta-NAME.yaml` beside it (dp_size, pp_size, tp_size, dsp_size, vpp_size, world_size).

Record layer: this only reads the files and renames the columns to the op table's
(`traindx.derive.optable.COLUMNS`); nothing is computed here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import yaml

from traindx.common.errors import UserError

RENAMES = {
    "dp_rank": "dp",
    "stage": "pp",
    "start_ts": "start",
    "seq_id": "seq",
    "mc": "chunk",
    "gmc": "gchunk",
    "mb_id": "mb",
}
REQUIRED = ("dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration")


@dataclass
class TraceFile:
    path: str
    table: pd.DataFrame  # op-table column names, not yet normalised
    meta: dict[str, Any] = field(default_factory=dict)  # the meta yaml's keys, {} when absent
    meta_path: str | None = None


def meta_path_for(path: str) -> str | None:
    """meta-NAME.yaml (or .yml) beside trace-NAME.parquet, if there is one."""
    folder, base = os.path.split(path)
    stem = base[: -len(".parquet")] if base.endswith(".parquet") else base
    name = stem[len("trace-") :] if stem.startswith("trace-") else stem
    for candidate in (f"meta-{name}.yaml", f"meta-{name}.yml", f"{stem}.yaml", f"{stem}.yml"):
        full = os.path.join(folder, candidate)
        if os.path.isfile(full):
            return full
    return None


def is_trace(path: str) -> bool:
    """A Parquet file whose columns are this format's."""
    if not path.endswith(".parquet"):
        return False
    try:
        import pyarrow.parquet as pq  # lazy: pyarrow is heavy and only this reader needs it here

        names = set(pq.read_schema(path).names)
    except Exception:  # noqa: BLE001 - any unreadable file simply is not this format
        return False
    return set(REQUIRED) <= names


def read(path: str) -> TraceFile:
    """The trace and its metadata; UserError when the file is not such a trace."""
    try:
        raw = pd.read_parquet(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many kinds for a bad file
        raise UserError(f"{path}: not a readable Parquet file ({type(exc).__name__})") from None
    missing = [c for c in REQUIRED if c not in raw.columns]
    if missing:
        raise UserError(f"{path}: not an op trace (no column {', '.join(missing)})")
    if raw.empty:
        raise UserError(f"{path}: the trace holds no ops")
    table = raw.rename(columns=RENAMES)
    keep = ["rank", "dp", "pp", "step", "mb", "optype", "seq", "start", "duration", "chunk", "gchunk"]
    table = table[[c for c in keep if c in table.columns]]
    meta_path = meta_path_for(path)
    meta: dict[str, Any] = {}
    if meta_path:
        try:
            with open(meta_path, encoding="utf-8") as f:
                loaded = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as exc:
            raise UserError(f"{meta_path}: not readable YAML ({type(exc).__name__})") from None
        if isinstance(loaded, dict):
            meta = loaded
    return TraceFile(path=path, table=table, meta=meta, meta_path=meta_path)
