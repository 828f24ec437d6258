"""Gradients all-reduced more often than the optimizer steps: a DistributedDataParallel job that
accumulates gradients over micro-batches without no_sync() all-reduces every bucket in every
backward, though only the sum at the last micro-batch before optimizer.step() is ever used.

Mechanism (the shim's backward spans, profiler/shim/_traindx_shim/spans.py): DDP prepares its
reducer at a forward with grad enabled outside no_sync(), and the backward after it all-reduces
the gradients (`grad_sync`); optimizer spans mark the steps. A synced backward followed by
another synced backward before any optimizer step reduced gradients nobody read. Its price: the
time that backward waited for the all-reduce after its own gradients were ready (the span's end
less grads_ready), the part the overlap with backward did not hide.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding, Prescription

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="grad_sync", order=102, ids=("ranks.grad_sync_every_micro_batch",), cross_rank=True
)
MIN_EXTRA = 1.0  # extra all-reduces per optimizer step: below it there is no accumulation pattern


def analyze(run: RunRecord) -> list[Finding]:
    spans = run.of_type("span")
    if not len(spans) or "grad_sync" not in spans or "cat" not in spans:
        return []
    spans = spans[spans["cat"].isin(["backward", "optimizer"])]
    out = []
    for rank, own in spans.groupby(spans["rank"].astype(str), sort=True):
        found = _rank_finding(run, str(rank), own)
        if found is not None:
            out.append(found)
    if not out:
        return []
    # every rank of a DDP job runs the same loop: one finding, at its costliest rank's price
    worst = max(out, key=lambda f: f.seconds_lost_per_step or 0.0)
    return [dataclasses.replace(worst, ranks=tuple(r for f in out for r in f.ranks))]


def _extra_syncs(own: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """The synced backwards whose all-reduce no optimizer step read (another synced backward
    came before the next optimizer step), and the number of optimizer steps."""
    own = own.sort_values("start")
    synced = (own["cat"] == "backward") & (own["grad_sync"].astype(object) == True)  # noqa: E712
    marks = own[synced | (own["cat"] == "optimizer")]
    nxt = marks["cat"].shift(-1)
    extra = marks[(marks["cat"] == "backward") & (nxt == "backward")]
    return extra, int((own["cat"] == "optimizer").sum())


def _in_steps(run: RunRecord, rank: str, own: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    led = run.rank_rows("ledger", rank).sort_values("start_ns")
    if not len(led):
        return own.iloc[0:0], 0
    begin, end = led["start_ns"].to_numpy(np.int64), led["end_ns"].to_numpy(np.int64)
    s = own["start"].to_numpy(np.int64)
    i = np.searchsorted(begin, s, side="right") - 1
    inside = (i >= 0) & (s < end[np.maximum(i, 0)])
    return own[inside], len(led)


def _rank_finding(run: RunRecord, rank: str, own: pd.DataFrame) -> Finding | None:
    own, n_steps = _in_steps(run, rank, own)
    extra, n_opt = _extra_syncs(own)
    if not n_opt or not n_steps or len(extra) / n_opt < MIN_EXTRA:
        return None
    ready = pd.to_numeric(extra.get("grads_ready"), errors="coerce")
    tails = (extra["t"].astype("int64") - ready).where(ready.notna(), np.nan) / 1e9
    extra_s = float(np.nansum(tails.to_numpy(float))) if ready.notna().any() else 0.0
    per_step = extra_s / n_steps
    step_s = float(run.rank_rows("ledger", rank)["wall_s"].mean())
    share = per_step / step_s if step_s else 0.0
    site = _backward_site(run, rank)
    where = f"{os.path.basename(site['file'])}:{site['line']}" if site else "the backward"
    per_opt = len(extra) / n_opt
    summary = (
        f"DistributedDataParallel all-reduced the gradients in every backward: {len(extra) + n_opt} "
        f"all-reduces for {n_opt} optimizer steps ({per_opt:.0f} extra a step) on rank {rank}. "
        f"The backward at {where} accumulates gradients over micro-batches without no_sync(), so "
        f"each micro-batch's backward waits for a gradient all-reduce whose result only the last "
        f"micro-batch's needs; {per_step * 1e3:.1f} ms a step ({share:.0%}) waited after the "
        "gradients were ready (the part backward's overlap did not hide)."
    )
    return Finding(
        id="ranks.grad_sync_every_micro_batch",
        title=f"Gradients all-reduced every micro-batch at {where}: {per_opt:.0f} extra all-reduce(s) a step",
        severity=ev.severity_for_share(share) if per_step > 0 else "low",
        analyzer="grad_sync",
        summary=summary,
        seconds_lost_per_step=per_step,
        share_of_step=share,
        evidence=_evidence(rank, site, len(extra), n_opt, per_step),
        prescriptions=(_prescription(where, per_step),),
        ranks=(rank,),
    )


def _prescription(where: str, per_step: float) -> Prescription:
    return Prescription(
        kind="code",
        summary=f"wrap the forward and backward of every micro-batch but the last in `with "
        f"model.no_sync():` at {where} (or let the framework accumulate: accelerate's "
        "`accelerator.accumulate(model)`, Lightning's `accumulate_grad_batches`), so the "
        "gradients are all-reduced once per optimizer step",
        expected_gain_s_per_step=per_step,
    )


def _backward_site(run: RunRecord, rank: str) -> dict[str, Any] | None:
    """The job's line of its backward calls (the shim's accumulation check records it)."""
    events = run.of_type("grad_accum")
    if not len(events) or "sites" not in events:
        return None
    for sites in events[events["rank"].astype(str) == rank]["sites"]:
        site = sites.get("backward") if isinstance(sites, dict) else None
        if isinstance(site, dict) and site.get("file"):
            return site
    return None


def _evidence(
    rank: str, site: dict[str, Any] | None, extra: int, n_opt: int, per_step: float
) -> dict[str, Any]:
    return {
        "rank": rank,
        "file": site.get("file") if site else None,
        "line": site.get("line") if site else None,
        "function": site.get("function") if site else None,
        "grad_all_reduces": extra + n_opt,
        "optimizer_steps": n_opt,
        "extra_all_reduces": extra,
        "seconds_per_step": round(per_step, 6),
    }
