"""JIT compiles: cold starts, steady recompiles with the key field that changes, Triton
autotuning, torch.compile recompiles; and FA4's max_seqlen-as-tensor leak with the line that
passes the tensor.

Reads the shim's compile events when there are any; else detects compiles from py-spy stacks
(attach mode, or a py-spy file alone) and says what can be known from them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers.core.declaration import Declaration, Removes
from traindx.analyzers.core.findings import Finding, Prescription
from traindx.analyzers.jit.autotune import (
    autotune_finding,
    cold_start_finding,
    first_step_rows,
)
from traindx.analyzers.jit.common import compile_severity, kernel_rows
from traindx.analyzers.jit.common import diff_keys as diff_keys  # re-exported: the tests read it here
from traindx.analyzers.jit.dynamo import dynamo_finding, dynamo_kinds

# re-exported: the commands and the tests read them here
from traindx.analyzers.jit.fa4 import backend_switches as backend_switches
from traindx.analyzers.jit.fa4 import int_cast as int_cast
from traindx.analyzers.jit.fa4 import wrap_in_int as wrap_in_int
from traindx.analyzers.jit.pyspy import analyze_pyspy_only
from traindx.analyzers.jit.pyspy import analyze_recording as analyze_recording
from traindx.analyzers.jit.steady import steady_finding

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

_STEADY = ("jit.fa4_steady_recompile", "jit.steady_recompile")
_BY_KIND = (  # a compile py-spy saw again (pyspy_signatures.SIGNATURES' kinds)
    "jit.inductor_steady_recompile",
    "jit.triton_autotune_steady_recompile",
    "jit.cute_dsl_steady_recompile",
    "jit.triton_steady_recompile",
)
DECLARATION = Declaration(
    name="jit",
    order=140,
    ids=(*_STEADY, *_BY_KIND, "jit.dynamo_recompile", "jit.autotune", "jit.cold_start"),
    live_triggers=("compile",),
    live_categories=("compile",),
    # a kernel compiled or tuned again in the steps where a graph recompiled: that recompile's
    explains=(
        *_STEADY,
        *_BY_KIND,
        "jit.autotune",
        "gil.contention",
        "ranks.straggler",
        "gpu.launch_bound",
        "gpu_idle.host_starved",
        "host_work.code",
    ),
    recompiles=(*_STEADY, *_BY_KIND, "jit.dynamo_recompile", "jit.autotune"),
    removes={
        **{i: Removes(("compile",), in_steps=True) for i in _STEADY},
        "jit.dynamo_recompile": Removes(("compile",), in_steps=True, fresh_graph_calls=True),
        "jit.autotune": Removes(("autotune",), in_steps=True),
    },
)


def _analyze_rank(run: RunRecord, rank: str, compiles: pd.DataFrame) -> list[Finding]:
    findings = []
    steps = run.rank_steps(rank).dropna(subset=["duration_s"])
    compiles = compiles[compiles["ok"].fillna(True).astype(bool)] if "ok" in compiles else compiles
    kernels = kernel_rows(compiles[compiles["kind"].isin(["cute_dsl", "triton"])])
    tunes = compiles[compiles["kind"] == "triton_autotune"].sort_values("start_ns")
    tuned = set(tunes["kernel"]) if len(tunes) else set()
    firsts, cold_tunes, folded = [], [], {}
    for (kind, kernel), group in kernels.items():
        # a kernel's first step compiles every config its first tuning benchmarks: all cold
        firsts.append(first_step_rows(group) if kernel in tuned else group.iloc[:1])
        if kind == "triton" and kernel in tuned:
            # the compiles made while the kernel autotunes are the re-autotune's (one cause);
            # any other recompile of it stays a recompile
            while_tuning = _compiles_while_tuning(group, tunes[tunes["kernel"] == kernel])
            folded[kernel] = group[while_tuning]
            group = pd.concat(
                [
                    group.iloc[:1],
                    group[~while_tuning].iloc[1:] if not while_tuning[0] else group[~while_tuning],
                ]
            )
            if len(group) < 2:
                continue
        found = steady_finding(run, rank, kind, kernel, group, steps)
        if found:
            findings.append(found)
    for kernel, group in tunes.groupby("kernel", sort=False):
        cold_tunes.append(first_step_rows(group))
        found = autotune_finding(run, rank, kernel, group, steps, folded.get(kernel))
        if found:
            findings.append(found)
    dynamo = compiles[compiles["kind"] == "dynamo"].sort_values("start_ns")
    if len(dynamo):
        firsts.append(dynamo[[k in ("first", "backward", "mode") for k in dynamo_kinds(dynamo)]])
        found = dynamo_finding(run, rank, dynamo, steps)
        if found:
            findings.append(found)
    if firsts or cold_tunes:
        cold = cold_start_finding(
            run,
            rank,
            pd.concat(firsts) if firsts else compiles.iloc[0:0],
            steps,
            pd.concat(cold_tunes) if cold_tunes else None,
        )
        if cold:
            findings.append(cold)
    return _merge_fa4_steady(findings)


def _compiles_while_tuning(group: pd.DataFrame, tunes: pd.DataFrame) -> Any:
    """Per compile of a Triton kernel: made while that kernel autotuned (the shim marks a
    compile inside an autotuner's run with `autotune_of`; without the mark, a compile inside one
    of the kernel's autotune intervals or in a step where it autotuned)."""
    marked = group["autotune_of"].notna().to_numpy() if "autotune_of" in group else np.zeros(len(group), bool)
    starts = group["start_ns"].to_numpy(np.int64) if "start_ns" in group else None
    inside = np.zeros(len(group), bool)
    if starts is not None and len(tunes) and "start_ns" in tunes and "end_ns" in tunes:
        for s, e in zip(tunes["start_ns"].astype("int64"), tunes["end_ns"].astype("int64")):
            inside |= (starts >= s) & (starts <= e)
    same_step = (
        group["step"].isin(set(tunes["step"].dropna())).to_numpy()
        if "step" in group
        else np.zeros(len(group), bool)
    )
    return marked | inside | same_step


def _merge_fa4_steady(findings: list[Finding]) -> list[Finding]:
    """One FA4 leak finding per rank: the kernels it recompiles are listed inside."""
    steady = [f for f in findings if f.id == "jit.fa4_steady_recompile"]
    if len(steady) <= 1:
        return findings
    steady.sort(key=lambda f: -(f.seconds_lost_per_step or 0))
    top = steady[0]
    others = [
        {
            "kernel": f.evidence.get("kernel"),
            "seconds_lost_per_step": f.seconds_lost_per_step,
            "changing_key_fields": f.evidence.get("changing_key_fields"),
        }
        for f in steady[1:]
    ]
    total = sum(f.seconds_lost_per_step or 0 for f in steady)
    share = sum(f.share_of_step or 0 for f in steady)
    merged = Finding(
        id=top.id,
        title=top.title,
        severity=compile_severity(min(share, 1.0), steady=True),
        analyzer=top.analyzer,
        summary=top.summary + f" {len(others)} other FA4 kernel(s) "
        f"recompile too; together {total:.2f} s per step.",
        steps_affected=tuple(sorted(set().union(*[set(f.steps_affected) for f in steady]))),
        seconds_lost_per_step=total,
        share_of_step=min(share, 1.0),
        evidence={**top.evidence, "other_kernels": others},
        prescriptions=tuple(
            Prescription(**{**p.__dict__, "expected_gain_s_per_step": total}) for p in top.prescriptions
        ),
        ranks=top.ranks,
    )
    return [f for f in findings if f.id != "jit.fa4_steady_recompile"] + [merged]


def analyze(run: RunRecord) -> list[Finding]:
    compiles = run.compiles
    findings = []
    ranks_with_events = set()
    if len(compiles):
        for rank, group in compiles.groupby("rank"):
            ranks_with_events.add(str(rank))
            findings.extend(_analyze_rank(run, rank, group))
    pyspy_only = [f for f in analyze_pyspy_only(run) if str(f.ranks[0]) not in ranks_with_events]
    return findings + pyspy_only
