"""The files `diagnose analyze` reads without a run folder around them, and `diagnose analyze RUN
--what-if`: an op-level trace (trace-X.parquet in the straggler study's format, with its
meta-X.yaml beside it), Megatron's per-rank timers in a training log and a run folder's spans give
the what-if analysis across ranks; a py-spy recording on its own (a speedscope .json or a raw
collapsed file) gives the JIT compiles found in its stacks. Reads, derives, judges; decides
nothing itself."""

from __future__ import annotations

import os

from traindx.analyzers.core.findings import Finding, rank_findings
from traindx.analyzers.jit.jit import analyze_recording
from traindx.analyzers.ranks.whatif import judge
from traindx.common.errors import UserError
from traindx.derive import depmodel, optable, whatif
from traindx.profiler import megatron_timers, speedscope, straggler_trace


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
    except (depmodel.ModelError, ValueError, KeyError, IndexError) as exc:  # a trace of another shape
        raise UserError(f"{path}: cannot replay this trace ({type(exc).__name__}: {exc})") from None
    return result, judge(result, source=os.path.basename(path))


def analyze_run(path: str) -> tuple[whatif.WhatIf, list[Finding]]:
    """The what-if analysis of a run folder of several ranks (its spans per rank and step)."""
    from traindx.derive.optable_runs import (  # lazy: only `--what-if` reads spans so
        from_run,
        nonblocking_sends,
        runq_share,
    )
    from traindx.derive.run import load_run

    record = load_run(path)
    table = from_run(record)
    if table.empty or table["rank"].nunique() < 2:
        raise UserError(f"{path}: no spans of several ranks in common steps: nothing to replay across ranks")
    try:
        result = whatif.analyze(table, serial=True, oneway_sends=nonblocking_sends(record))
    except depmodel.ModelError as exc:
        raise UserError(f"{path}: {exc}") from None
    result.runq_share = runq_share(record)
    return result, judge(result, source=os.path.basename(os.path.normpath(path)))


def analyze_megatron_log(path: str, tp: int, pp: int) -> tuple[whatif.WhatIf, list[Finding]]:
    """The what-if analysis of Megatron's per-rank timers in a training log."""
    log = megatron_timers.read(path)
    if log.rows.empty:
        hint = " (printed with --timing-log-option minmax: rerun with --timing-log-option all)"
        raise UserError(f"{path}: no per-rank Megatron timer block" + (hint if log.minmax_blocks else ""))
    table = optable.from_timers(log.rows, tp=tp, pp=pp)
    if table.empty or table["rank"].nunique() < 2:
        raise UserError(f"{path}: the timer blocks name no forward/backward/optimizer times of several ranks")
    try:
        result = whatif.analyze(table)
    except depmodel.ModelError as exc:
        raise UserError(f"{path}: {exc}") from None
    return result, judge(result, source=os.path.basename(path))


def analyze_file(path: str, rate_hz: float) -> list[Finding]:
    """The ranked findings of the recording; `rate_hz`: samples per second of a raw file,
    which counts samples instead of seconds."""
    if os.path.getsize(path) == 0:
        raise UserError(f"{path} is empty: not a py-spy recording")
    # a file the user names may be a link of theirs (a run folder's own never is)
    recording = speedscope.load(os.path.realpath(path))
    if not recording or not any(s.stacks for s in recording.values()):
        raise UserError(f"{path} holds no py-spy samples")
    with open(path, encoding="utf-8", errors="replace") as f:
        is_raw = not f.read(4096).lstrip().startswith("{")
    if is_raw:  # collapsed stacks count samples: seconds = samples / rate
        for samples in recording.values():
            samples.weights = [w / rate_hz for w in samples.weights]
    return rank_findings(analyze_recording(recording, source=f"py-spy file {os.path.basename(path)}"))
