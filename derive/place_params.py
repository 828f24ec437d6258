"""Work on a whole parameter whose forward read only part of it: a table that a gather op (an
embedding lookup, opwork.GATHERS) reads a few rows of, while its gradient is made and its update
applied over every row each step (a dense gradient: the table zeroed, the rows scattered in,
the optimizer reading and writing all of it).

From the torch.profiler window alone: the forward's gather ops give each table's shape and the
rows their indices name; the GPU events of backward and optimizer ops that take a tensor of the
table's exact shape (an op's own input sizes, a foreach op's tensor lists) are the whole-table
work, a foreach op's share by the table's part of its tensors' elements. A table some other
forward op reads too (a matmul of a tied output layer) is read whole: no row of it is spared.
Derive layer: tables and arithmetic, no judgement.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from traindx.derive import opwork as W

TABLE_COLUMNS = ["module", "line", "call", "shape", "item_bytes", "rows", "rows_read", "gpu_s", "phases"]


def _tensors(dims: Any) -> list[tuple[int, ...]]:
    """Every tensor shape among an op's inputs, a tensor list's members too."""
    out: list[tuple[int, ...]] = []
    for d in dims or []:
        if isinstance(d, list) and d and all(isinstance(x, int) for x in d):
            out.append(tuple(d))
        elif isinstance(d, list):
            out.extend(tuple(m) for m in d if isinstance(m, list) and all(isinstance(x, int) for x in m))
    return out


def op_inputs(rows: pd.DataFrame, args: pd.DataFrame | None) -> pd.DataFrame:
    """cpu_op row position -> (name, dims, types) of the ops whose input sizes were recorded."""
    if args is None or not len(args):
        return pd.DataFrame(columns=["name", "dims", "types"])
    rows = rows.reset_index(drop=True)
    cpu = rows[rows["cat"].to_numpy() == "cpu_op"][["tid", "start_ns"]].reset_index()
    merged = cpu.merge(args, on=["tid", "start_ns"], how="inner")
    return merged.set_index("index")[["name", "dims", "types"]]


def whole_tables(
    ops: pd.DataFrame, contexts: dict[int, Any], events: pd.DataFrame, steps: int
) -> pd.DataFrame:
    """Per table a forward gather reads: its module, line, shape, rows, the rows its gathers
    named a step, and the GPU seconds a step of backward and optimizer work on the whole table."""
    if not len(ops) or not len(events):
        return pd.DataFrame(columns=TABLE_COLUMNS)
    n = max(int(steps), 1)
    tables: dict[tuple[int, ...], dict[str, Any]] = {}
    shapes = {int(p): _tensors(d) for p, d in zip(ops.index, ops["dims"])}
    for pos, name, dims, types in zip(ops.index, ops["name"], ops["dims"], ops["types"]):
        ctx = contexts.get(int(pos))
        lookup = W.gathered(str(name), dims, types)
        if ctx is None or ctx.phase not in ("forward", "recompute") or lookup is None:
            continue
        shape, item, rows_read = lookup
        t = tables.setdefault(shape, {"module": ctx.module, "line": ctx.line, "call": ctx.call, "read": 0})
        t.update(item_bytes=item, rows=shape[0])
        t["read"] += rows_read
    if not tables:
        return pd.DataFrame(columns=TABLE_COLUMNS)
    names = ops["name"].astype(str).to_dict()
    for pos, mine in shapes.items():
        ctx = contexts.get(pos)
        root = names.get(ctx.root, "") if ctx is not None else ""
        if ctx is None or ctx.phase not in ("forward", "recompute") or names[pos] in W.GATHERS:
            continue
        if root not in W.GATHERS:  # an op inside a gather is the gather's own
            for shape in set(mine) & set(tables):
                tables[shape]["whole_read"] = True
    out: list[tuple[Any, ...]] = []
    for shape, t in tables.items():
        if t.get("whole_read"):
            continue
        seconds, phases = _whole_work(shape, shapes, names, events)
        per_step = {p: s / n for p, s in phases.items()}
        out.append(
            (
                t["module"],
                t["line"],
                t["call"],
                shape,
                t["item_bytes"],
                t["rows"],
                t["read"] / n,
                seconds / n,
                per_step,
            )
        )
    return pd.DataFrame(out, columns=TABLE_COLUMNS)


def _whole_work(
    shape: tuple[int, ...],
    shapes: dict[int, list[tuple[int, ...]]],
    names: dict[Any, str],
    events: pd.DataFrame,
) -> tuple[float, dict[str, float]]:
    """GPU seconds of backward and optimizer events whose op takes a tensor of `shape` (an op
    over a tensor list: the shape's share of its elements), by phase; a scatter into the table
    (a sparse update) works on the rows its index names, not on the table."""
    e = events[events["phase"].isin(("backward", "optimizer")).to_numpy()]
    share = np.zeros(len(e))
    for i, op in enumerate(e["op"].to_numpy()):
        mine = shapes.get(int(op), [])
        if shape in mine and names.get(int(op)) not in W.SCATTERS:
            total = sum(math.prod(s) for s in mine)
            share[i] = min(1.0, mine.count(shape) * math.prod(shape) / total) if total else 0.0
    seconds = e["seconds"].to_numpy(float) * share
    by = pd.Series(seconds).groupby(e["phase"].to_numpy()).sum()
    return float(seconds.sum()), {str(k): float(v) for k, v in by.items() if v > 0}


__all__ = ["TABLE_COLUMNS", "op_inputs", "whole_tables"]
