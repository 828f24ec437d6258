"""torch.compile (dynamo) recompiles: which compile is a first graph, a backward or a mode
change, and which is a recompile of a frame, with the guard that failed and the call site."""

from __future__ import annotations

import ast
import collections
import re
from typing import TYPE_CHECKING, Any

import pandas as pd

from traindx.analyzers import codefix
from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.findings import Finding, Prescription
from traindx.analyzers.jit.common import col, compile_severity, frame_where, ledger_cost, steps_after

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

_VALUES = re.compile(r"\. expected \d+, actual \d+")

_SIZE_MISMATCH = re.compile(
    r"tensor '(?P<name>[^']+)' (size|stride) mismatch at index (?P<dim>\d+)"
    r"(\. expected (?P<expected>\d+), actual (?P<actual>\d+))?"
)
_COMPILE_ID = re.compile(r"(?P<frame>\d+)/(?P<count>\d+)")
# a guard on a mode, not on data: grad mode (no_grad evaluation before training), train/eval
# (module.training), autocast, deterministic algorithms. Each mode compiles its own graph once;
# switching back and forth reuses them, so it is never a steady cost.
_MODE_CHANGE = re.compile(
    r"GLOBAL_STATE changed|grad_mode|is_grad_enabled|___check_global_state"
    r"|\.training\b|\btraining\b.*(?:mismatch|changed|==)|autocast"
    r"|deterministic_algorithms",
    re.IGNORECASE,
)


def dynamo_compile_kind(row: Any) -> str:
    """What one dynamo compile event is: 'first' (the frame's first graph), 'backward' (the
    backward graph AOTAutograd builds at the first backward: not a recompile), 'mode' (a graph
    for another grad/train/autocast mode: once per mode, not a recompile), or 'recompile' (a
    guard on the data failed: a shape, a dtype, a Python value).

    Read defensively: `graph`, `kernel`, `recompile_reason`, `compile_id` or `key` ('F/N')."""
    kernel = str(col(row, "kernel") or "")
    if col(row, "graph") == "backward" or kernel.endswith("(backward graph)") or kernel in ("", "None"):
        return "backward"  # (AOTAutograd's backward compile has no code object of its own)
    reason = col(row, "recompile_reason")
    reason = reason if isinstance(reason, str) else ""
    m = _COMPILE_ID.search(str(col(row, "compile_id") or col(row, "key") or ""))
    again = bool(reason) or bool(m and int(m["count"]) > 0)
    if not again:
        return "first"
    if reason and _MODE_CHANGE.search(reason) and not _SIZE_MISMATCH.search(reason):
        return "mode"
    return "recompile"


def _strip_compile_id(reason: Any) -> Any:
    """ "0/1: tensor 'x' size mismatch ..." -> "tensor 'x' size mismatch ..." (first line)."""
    return re.sub(r"^\s*\[?[\d/!]+\]?:\s*", "", str(reason).strip().splitlines()[0])


def _call_site(recompiles: pd.DataFrame) -> Any:
    """The job's line that calls the compiled function with the changing input: the shim's
    `call_site` (the caller when the compile started) when recorded, else the compiled
    function's own definition (`caller`)."""
    for name in ("call_site", "caller"):
        for r in recompiles.itertuples():
            value = col(r, name)
            if isinstance(value, dict) and value.get("file") and not ev.is_library_path(value["file"]):
                return name, value
    return None, None


def _mark_dynamic_change(site: Any, name: Any, dim: Any) -> Any:
    """A real code change at the call site: mark the argument's dimension dynamic on the line
    before the call. Needs the call's source line; None otherwise."""
    source = (site or {}).get("source")
    if not source or not site.get("line"):
        return None, None

    try:
        call = next((n for n in ast.walk(ast.parse(source.strip())) if isinstance(n, ast.Call)), None)
    except SyntaxError:
        return None, None
    if call is None:
        return None, None
    names = [a.id for a in call.args if isinstance(a, ast.Name)]
    arg = name if name in names else (names[0] if names else None)
    if arg is None:
        return None, None
    indent = source[: len(source) - len(source.lstrip())]
    after = f"{indent}torch._dynamo.mark_dynamic({arg}, {dim})\n{source.rstrip()}"
    return codefix.code_change(site["file"], int(site["line"]), source.rstrip(), after), arg


def dynamo_kinds(group: pd.DataFrame) -> Any:
    """dynamo_compile_kind of each row; the backward graph of a recompiled frame is
    'recompile_backward' (its cost is the recompile's, its count is not another one)."""
    kinds = [dynamo_compile_kind(r) for r in group.itertuples()]
    ids = [str(col(r, "compile_id") or col(r, "key") or "") for r in group.itertuples()]
    recompiled = {i for i, k in zip(ids, kinds) if k == "recompile" and i}
    return [("recompile_backward" if k == "backward" and i in recompiled else k) for i, k in zip(ids, kinds)]


def _guard_prescription(
    m: re.Match[str] | None,
    caller: dict[str, Any] | None,
    site_kind: str | None,
    where: str | None,
    top_reason: str,
    lost: float,
) -> Prescription:
    """The fix of the guard that fails: a size mismatch (`m`) marks its dimension dynamic,
    any other guard is made stable."""
    if m:
        name, dim = m["name"], m["dim"]
        short = re.sub(r"^L\['([^']+)'\].*$", r"\1", name)
        change, arg = _mark_dynamic_change(caller if site_kind == "call_site" else None, short, dim)
        at = (
            f" at {where}"
            if site_kind == "call_site"
            else f" (the compiled function: {where})"
            if where
            else ""
        )
        passed = f" ({arg} is passed as {short})" if arg and arg != short else ""
        return Prescription(
            kind="code",
            summary=f"mark dimension {dim} of {short} dynamic before the compiled call"
            f"{at}: torch._dynamo.mark_dynamic({arg or short}, {dim}){passed}; "
            "or compile with torch.compile(..., dynamic=None) (automatic "
            "dynamic shapes: one recompile, then symbolic) or dynamic=True; or pad or bucket "
            f"dimension {dim} of {short} to a few fixed sizes (one compile each). Not a cache "
            "directory: a compile cache is read across runs, and each new size is a new graph",
            change={"code": change} if change else {},
            expected_gain_s_per_step=lost,
        )
    return Prescription(
        kind="code",
        summary="make the guard that fails stable (the value it checks changes "
        f"between calls{(' at ' + where) if where else ''}): "
        f"{top_reason[:160]}",
        expected_gain_s_per_step=lost,
    )


def dynamo_finding(run: RunRecord, rank: str, group: pd.DataFrame, steps: pd.DataFrame) -> Finding | None:
    kinds = dynamo_kinds(group)
    recompiles = group[[k == "recompile" for k in kinds]]
    costs = group[[k in ("recompile", "recompile_backward") for k in kinds]]
    not_recompiles = collections.Counter(k for k in kinds if k in ("backward", "mode"))
    if not len(recompiles):
        return None
    first_step = int(col(next(group.itertuples()), "step") or 0)
    after = steps_after(steps, first_step)
    later = recompiles[recompiles["step"].fillna(-1) > first_step]
    later_costs = costs[costs["step"].fillna(-1) > first_step]
    n_after = max(len(after), 1)
    lost = float(later_costs["duration_s"].sum()) / n_after if len(later) else 0.0
    median_after = float(after["duration_s"].median()) if len(after) else None
    share = min(lost / median_after, 1.0) if median_after else None
    if len(later):
        lost, share = ledger_cost(run, rank, after, lost, share, "compile")
    raw = [_strip_compile_id(r) for r in recompiles["recompile_reason"] if isinstance(r, str) and r]
    reasons = collections.Counter(_VALUES.sub("", r) for r in raw)
    if not reasons:
        reasons["(no reason recorded)"] = len(recompiles)
    top_reason = reasons.most_common(1)[0][0]
    m = next((_SIZE_MISMATCH.search(r) for r in raw if _SIZE_MISMATCH.search(r)), None)
    changes = [
        f"{x['expected']} → {x['actual']}"
        for x in (_SIZE_MISMATCH.search(r) for r in raw)
        if x and x["expected"]
    ]
    site_kind, caller = _call_site(recompiles)
    where = frame_where(caller, run)
    functions = collections.Counter(str(k) for k in recompiles["kernel"])
    prescriptions = [_guard_prescription(m, caller, site_kind, where, top_reason, lost)]
    steady = len(later) >= 2
    severity = compile_severity(share, steady=steady) if len(later) else "low"
    if severity == "info" and len(later):
        severity = "low"
    skipped = ", ".join(
        f"{n} {'backward graph(s)' if k == 'backward' else 'graph(s) for another grad/train mode'}"
        for k, n in sorted(not_recompiles.items())
    )
    return Finding(
        id="jit.dynamo_recompile",
        title=(
            f"torch.compile recompiles {', '.join(functions)} {len(recompiles)} time(s): "
            f"{top_reason[:90]}" + (f" ({', '.join(changes[:4])})" if changes else "")
        ),
        severity=severity,
        analyzer="jit",
        summary=(
            f"{', '.join(functions)} recompiled {len(recompiles)} time(s) on rank {rank}"
            + (f" ({where})" if where else "")
            + f"; reason: {top_reason}"
            + (f"; {lost:.2f} s per step after step {first_step}" if len(later) else "")
            + (f". Not counted: {skipped} (compiled once each)" if skipped else "")
            + "."
        ),
        steps_affected=tuple(sorted(int(s) for s in set(recompiles["step"].dropna()))),
        seconds_lost_per_step=lost if len(later) else None,
        share_of_step=share,
        evidence={
            "rank": rank,
            "recompiles": int(len(recompiles)),
            "reasons": dict(reasons),
            "reasons_each": raw[:20],
            "size_changes": changes[:20],
            "functions": dict(functions),
            "caller": caller,
            "caller_kind": site_kind,
            "not_recompiles": dict(not_recompiles),
            "seconds_each": [round(float(x), 3) for x in recompiles["duration_s"]],
        },
        prescriptions=tuple(prescriptions),
        ranks=(rank,),
    )
