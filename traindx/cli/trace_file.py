"""`diagnose analyze trace-X.parquet`: the what-if analysis across ranks of an op-level trace
(the straggler study's format, with its meta-X.yaml beside it). Reads, derives, judges, presents;
decides nothing itself."""

from __future__ import annotations

import os

from traindx.analyzers.findings import Finding
from traindx.analyzers.whatif import judge
from traindx.common.errors import UserError
from traindx.derive import depmodel, optable, whatif
from traindx.profiler import straggler_trace


def is_trace(path: str) -> bool:
    return straggler_trace.is_trace(path)


def analyze_trace(path: str) -> tuple[whatif.WhatIf, list[Finding]]:
    trace = straggler_trace.read(path)
    meta = trace.meta
    try:
        table = optable.normalize(trace.table)
    except ValueError as exc:
        raise UserError(f"{path}: {exc}") from None
    vpp = meta.get("vpp_size")
    dp_sync = None
    if "dp_size" in meta:
        dp_sync = int(meta.get("dp_size", 1)) * int(meta.get("dsp_size", 1)) > 1
    try:
        result = whatif.analyze(table, vpp=int(vpp) if vpp else None, dp_sync=dp_sync)
    except depmodel.ModelError as exc:
        raise UserError(f"{path}: {exc}") from None
    return result, judge(result, source=os.path.basename(path))


def analyze_run(path: str) -> tuple[whatif.WhatIf, list[Finding]]:
    """The what-if analysis of a run folder of several ranks (its spans per rank and step)."""
    from traindx.derive.optable_runs import from_run  # lazy: only `--what-if` reads spans so
    from traindx.derive.run import load_run

    record = load_run(path)
    table = from_run(record)
    if table.empty or table["rank"].nunique() < 2:
        raise UserError(f"{path}: no spans of several ranks in common steps: nothing to replay across ranks")
    try:
        result = whatif.analyze(table)
    except depmodel.ModelError as exc:
        raise UserError(f"{path}: {exc}") from None
    return result, judge(result, source=os.path.basename(os.path.normpath(path)))
