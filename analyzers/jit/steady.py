"""jit's steady recompiles from the shim's compile events: a kernel compiled again after the step
it first compiled in, with the key field that changes, the thread that compiled and its hold on
the GIL; an FA4 kernel whose key holds a tensor max_seqlen is the FA4 leak (jit_fa4)."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

from traindx.analyzers.core.findings import Finding, Prescription
from traindx.analyzers.jit import pyspy_signatures as sig
from traindx.analyzers.jit.common import (
    SINGLE_BLOCK_FIELDS,
    col,
    compile_severity,
    frame_where,
    is_tensor_field,
    key_history,
    ledger_cost,
    precompile_prescription,
    steps_after,
)
from traindx.analyzers.jit.fa4 import (
    fa4_calls,
    leak_prescriptions,
    tensor_max_seqlen_call,
    tensor_origin_event,
    tensor_origin_text,
)

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

if TYPE_CHECKING:  # annotations only
    pass


def _tensor_fields(group: pd.DataFrame) -> Any:
    out = set()
    for row in group.itertuples():
        fields, types = col(row, "key_fields"), col(row, "key_types") or {}
        if isinstance(fields, dict):
            out |= {k for k, v in fields.items() if is_tensor_field(v, types.get(k))}
    return out


def _threads(group: pd.DataFrame) -> Any:
    names = collections.Counter(str(t) for t in group["thread"])
    main = bool(group["is_main_thread"].fillna(True).astype(bool).all())
    return names, main


def _gil_evidence(run: RunRecord, rank: str, thread_name: str) -> Any:
    """What py-spy saw of the compiling thread: its GIL share while compiling, and dump
    snapshots where it held the GIL while the main thread did not run."""
    out = {}
    recording = run.pyspy.get((str(rank), "gil")) or run.pyspy.get((rank, "gil"))
    if recording:
        shares = sig.gil_share_compiling(recording, thread_name)
        if shares and shares[1] > 0:
            out["gil_seconds_compiling"] = round(shares[0], 3)
            out["gil_share_compiling"] = round(shares[0] / shares[1], 3)
    dumps = run.dumps
    if len(dumps):
        dumps = dumps[dumps["rank"] == str(rank)]
        held = waiting = 0
        for _, snap in dumps.groupby("t"):
            holder = snap[(snap["thread_name"] == thread_name) & (snap["owns_gil"] == True)]  # noqa: E712
            if not len(holder):
                continue
            frames = holder["frames"].iloc[0] or []
            if not any(sig.COMPILER_PATH.search(f.get("filename") or "") for f in frames):
                continue
            held += 1
            main = snap[snap["thread_name"] == "MainThread"]
            if len(main) and not bool(main["owns_gil"].iloc[0]):
                waiting += 1
        if held:
            out["dump_snapshots_compiling_with_gil"] = held
            out["dump_snapshots_main_thread_waiting"] = waiting
    return out


def _recompile_cost(
    run: RunRecord, rank: str, later: pd.DataFrame, steps: pd.DataFrame, first_step: int
) -> tuple[int, float | None, float | None, float | None]:
    """(steps after the first, seconds lost per step, its share of a step, the median step
    after the first) of the compiles after a kernel's first step."""
    after = steps_after(steps, first_step)
    n_after = max(len(after), len(set(later["step"])))
    lost = float(later["duration_s"].sum()) / n_after if n_after else None
    median_after = float(after["duration_s"].median()) if len(after) else None
    if lost is not None and len(after):
        # a step cannot lose more than it lasted (nested or overlapping compile events)
        lost = min(lost, float(after["duration_s"].mean()))
    share = (lost / median_after) if lost is not None and median_after else None
    if share is not None:
        share = min(share, 1.0)
    lost, share = ledger_cost(run, rank, after, lost, share, "compile")
    return n_after, lost, share, median_after


def _fa4_site(
    run: RunRecord,
    rank: str,
    group: pd.DataFrame,
    fa4: dict[str, Any],
    tensor_call: dict[str, Any] | None,
    evidence: dict[str, Any],
) -> tuple[Any, str | None, Any, dict[str, Any] | None]:
    """(caller, where, its source, the tensor's origin) of an FA4 kernel's recompiles; what
    they show goes into `evidence`."""
    evidence["fa4_function"] = fa4.get("function")
    evidence["fa4_max_seqlen"] = fa4.get("max_seqlen")
    site = next(
        (col(r, "fa4_call_site") for r in group.itertuples() if isinstance(col(r, "fa4_call_site"), dict)),
        None,
    )
    caller = (tensor_call or {}).get("caller") or site
    source = (tensor_call or {}).get("source")
    if caller is None:
        caller = next(
            (col(r, "caller") for r in group.itertuples() if isinstance(col(r, "caller"), dict)), None
        )
    where = frame_where(caller, run)
    evidence["caller"] = caller
    evidence["caller_source"] = source
    origin = tensor_origin_event(run, rank)
    if origin:
        evidence["tensor_origin"] = origin
    if tensor_call:
        evidence["fa4_call_arg_types"] = tensor_call["arg_types"]
    return caller, where, source, origin


def _leak_reasons(
    tensor_fields: set[str],
    identical_pairs: Any,
    single_block: list[str],
    tensor_max_seqlen: bool,
    thread_name: str,
    evidence: dict[str, Any],
) -> list[str]:
    """Why the recompiles are the FA4 leak, as the record shows it."""
    why = []
    if tensor_fields:
        why.append(f"the key holds tensors ({', '.join(sorted(tensor_fields))})")
    if identical_pairs:
        why.append("consecutive keys differ only by object identity")
    if single_block:
        why.append(f"{'/'.join(single_block)} change on every call")
    if tensor_max_seqlen:
        why.append("max_seqlen reaches FA4 as a Tensor")
    if "gil_share_compiling" in evidence:
        why.append(
            f"py-spy: '{thread_name}' held the GIL in "
            f"{evidence['gil_share_compiling']:.0%} of the GIL samples while compiling"
            + (
                f", the main thread waiting in {evidence['dump_snapshots_main_thread_waiting']}"
                f" of {evidence['dump_snapshots_compiling_with_gil']} snapshots"
                if evidence.get("dump_snapshots_compiling_with_gil")
                else ""
            )
        )
    return why


def _kernel_sites(group: pd.DataFrame) -> list[Any]:
    """The recompiling kernel's own call sites (one per file:line)."""
    if "caller" not in group:
        return []
    return list(
        {
            (c.get("file"), c.get("line")): c
            for c in group["caller"]
            if isinstance(c, dict) and c.get("file")
        }.values()
    )


@dataclass(frozen=True)
class _Recompiled:
    """What a steady recompile's text says of it."""

    kernel: str
    count: int  # compiles after the first step
    first_step: int
    thread_text: str
    lost: float | None
    share: float | None
    field_text: str

    def head(self) -> str:
        return (
            f"{self.kernel} compiled {self.count} more time(s) after step {self.first_step} "
            f"{self.thread_text}, {self.lost:.2f} s per step"
        )


def _thread_text(on_main: bool, thread_name: str) -> str:
    if on_main:
        return "on the main thread"
    return f"on thread '{thread_name}' (not the main thread; the main thread waits)"


def _leak_text(
    said: _Recompiled, fa4_function: str | None, why: list[str], origin_text: str
) -> tuple[str, str]:
    """(title, summary) of the FA4 leak."""
    title = (
        f"FA4 {fa4_function} recompiles every step: max_seqlen passed as a tensor "
        f"leaks into its compile key ({said.field_text})"
    )
    summary = f"{said.head()} ({(said.share or 0):.0%} of a step). Why: {'; '.join(why)}. " + origin_text
    return title, summary


def _fa4_facts(run: RunRecord, rank: str, group: pd.DataFrame) -> tuple[Any, dict[str, Any] | None, bool]:
    """(the FA4 call the compiles record, the first recorded FA4 call given a tensor max_seqlen,
    whether a compile's FA4 arguments hold one)."""
    fa4 = next((r.fa4 for r in group.itertuples() if isinstance(col(r, "fa4"), dict)), None)
    calls = fa4_calls(run, rank)
    tensor_call = tensor_max_seqlen_call(calls) if len(calls) else None
    tensor_in_args = any(
        isinstance(col(r, "fa4"), dict)
        and any((v or {}).get("type") == "Tensor" for v in (r.fa4.get("max_seqlen") or {}).values())
        for r in group.itertuples()
    )
    return fa4, tensor_call, tensor_in_args


def _compile_counts(group: pd.DataFrame, later: pd.DataFrame, first_step: int) -> dict[str, Any]:
    recompiles = group.iloc[1:]
    return {
        "compiles": int(len(group)),
        "recompiles": int(len(recompiles)),
        "steady_recompiles": int(len(later)),
        "first_step": first_step,
        "recompile_seconds": round(float(later["duration_s"].sum()), 3),
        "recompile_seconds_each": [round(float(x), 3) for x in later["duration_s"]],
    }


def steady_finding(
    run: RunRecord, rank: str, kind: str, kernel: str, group: pd.DataFrame, steps: pd.DataFrame
) -> Finding | None:
    """A kernel compiled again after the step it first compiled in: a finding, or None."""
    # (one column, not itertuples: a namedtuple class per call costs ms on wide compile rows)
    first_step = group["step"].iloc[0] if "step" in group else None
    first_step = int(first_step) if first_step is not None and first_step == first_step else 0
    later = group[group["step"].fillna(-1) > first_step]
    if not len(later):
        return None
    n_after, lost, share, median_after = _recompile_cost(run, rank, later, steps, first_step)
    changed, identity, example, identical_pairs = key_history(group)
    tensor_fields = _tensor_fields(group)
    threads, on_main = _threads(group)
    thread_name = threads.most_common(1)[0][0]
    fa4, tensor_call, tensor_in_args = _fa4_facts(run, rank, group)
    fa4_function = fa4.get("function") if fa4 else None
    fields = [f for f, _ in changed.most_common()] or [f for f, _ in identity.most_common()]
    single_block = [f for f in fields if f in SINGLE_BLOCK_FIELDS]
    leak = bool(fa4) and bool(tensor_fields or identity or identical_pairs or tensor_call or tensor_in_args)
    steps_affected = tuple(sorted(int(s) for s in set(later["step"].dropna())))
    evidence: dict[str, Any] = {
        "rank": rank,
        "kind": kind,
        "kernel": kernel,
        **_compile_counts(group, later, first_step),
        "changing_key_fields": fields,
        "key_change_example": example,
        "key_identical_by_text": identical_pairs,
        "tensor_key_fields": sorted(tensor_fields),
        "threads": dict(threads),
        "on_main_thread": on_main,
        "steps_after_first": int(n_after),
        "median_step_after_first_s": median_after,
    }
    caller = where = source = origin = None
    if fa4:
        caller, where, source, origin = _fa4_site(run, rank, group, fa4, tensor_call, evidence)
    if thread_name:
        evidence.update(_gil_evidence(run, rank, thread_name))
    field_text = ", ".join(fields) if fields else "no visible key field"
    said = _Recompiled(
        kernel, len(later), first_step, _thread_text(on_main, thread_name), lost, share, field_text
    )
    if leak:
        why = _leak_reasons(
            tensor_fields,
            identical_pairs,
            single_block,
            bool(tensor_call or tensor_in_args),
            thread_name,
            evidence,
        )
        title, summary = _leak_text(said, fa4_function, why, tensor_origin_text(run, origin, where, source))
        backward_only = fa4_function == "_flash_attn_bwd"
        prescriptions = leak_prescriptions(
            run, where, caller, source, lost, backward_only, origin, _kernel_sites(group)
        )
        finding_id = "jit.fa4_steady_recompile"
    else:
        title = f"{kernel} recompiles after warm-up ({kind}); changing key field(s): {field_text}"
        summary = (
            f"{said.head()}. Key field(s) that change: "
            f"{field_text}" + (f" (e.g. {example})" if example else "") + "."
        )
        prescriptions = _generic_recompile_prescriptions(run, kind, kernel, fields, lost)
        finding_id = "jit.steady_recompile"  # the FA4 id is kept for the tensor leak
    return Finding(
        id=finding_id,
        title=title,
        severity=compile_severity(share, steady=True),
        analyzer="jit",
        summary=summary,
        steps_affected=steps_affected,
        seconds_lost_per_step=lost,
        share_of_step=share,
        evidence=evidence,
        prescriptions=tuple(prescriptions),
        ranks=(rank,),
    )


def _generic_recompile_prescriptions(
    run: RunRecord, kind: str, kernel: Any, fields: Any, gain: float | None
) -> Any:
    out = []
    field_text = ", ".join(fields) or "the key"
    if kind == "cute_dsl":
        out.append(precompile_prescription(run, gain, note=" (every key this run saw)"))
        out.append(
            Prescription(
                kind="code",
                summary=f"keep {field_text} of {kernel} constant across steps (pad or "
                "bucket the value that feeds it)",
                change={
                    "code": {
                        "file": None,
                        "line": None,
                        "before": field_text,
                        "after": "a value from a small fixed set",
                    }
                },
                expected_gain_s_per_step=gain,
            )
        )
    else:
        # no cache directory: a compile cache is read across runs (the first step's compiles),
        # and a kernel compiled again after warm-up has a key the run had not seen
        out.append(
            Prescription(
                kind="code",
                summary=f"keep the specialised arguments of {kernel} ({field_text}) "
                "constant: pad shapes, or mark the argument do_not_specialize",
                expected_gain_s_per_step=gain,
            )
        )
    return out
