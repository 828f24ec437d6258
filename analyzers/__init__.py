"""Analyzers: one module per pathology, each a pure function `analyze(run) -> [Finding]`.

Registered here, in one place. An analyzer that raises is reported as a finding about traindx
itself, never as a crash of the whole analysis.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

from traindx.analyzers import chains
from traindx.analyzers.codefix import checked
from traindx.analyzers.findings import Finding, rank_findings
from traindx.analyzers.sampling import representative_ranks

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

# module names under traindx.analyzers; each exposes analyze(run) -> list[Finding]
REGISTRY = [
    "steps",
    "gil",
    "dataloader",
    "gc_pauses",
    "host_sync",
    "allocator",
    "launch_bound",
    "gpu_clocks",
    "gpu_idle",
    "ranks",
    "stability",
    "host_work",
    "threads",
    "jit",
]
# judged last, over every other finding once linked and priced: analyze(run, findings) -> [Finding]
JUDGES = ["step_causes", "verdict"]


# read every rank at once (the rest read the sampled ranks on a large job: analyzers/sampling.py)
CROSS_RANK = {"steps", "ranks", "gpu_clocks"}


def analyze(run: RunRecord, only: Iterable[str] | None = None) -> list[Finding]:
    findings = []
    sampled = representative_ranks(run)
    per_rank_run = run if len(sampled) == len(run.ranks) else run.subset(sampled)
    if per_rank_run is not run:
        findings.append(
            Finding(
                id="analysis.ranks_sampled",
                title=f"Per-rank analysis read {len(sampled)} of {len(run.ranks)} ranks",
                severity="info",
                analyzer="sampling",
                summary=(
                    f"{len(run.ranks)} ranks: the per-rank analyzers read {len(sampled)} of them - "
                    "the first and last, and the ranks at both extremes of every step-time and "
                    "time-ledger measure; the straggler and GPU analyses read every rank."
                ),
                evidence={"ranks_analyzed": sampled, "ranks": len(run.ranks)},
            )
        )
    for name in REGISTRY:
        if only and name not in only:
            continue
        try:
            module = importlib.import_module(f"traindx.analyzers.{name}")
            findings.extend(module.analyze(run if name in CROSS_RANK else per_rank_run))
        except Exception as exc:  # one broken analyzer must not hide the others' findings
            findings.append(failed(name, exc))
    # one pass over all findings: symptoms under their causes, savings from the time ledger;
    # each step on its own, so that one failing keeps what the others did
    for step, fn in (
        ("chains", lambda fs: chains.attach_call_sites(chains.link(fs))),
        ("savings", lambda fs: chains.apply_savings(fs, run)),
        ("codefix", checked),
    ):  # a code prescription is a real edit, or prose
        try:
            findings = fn(findings)
        except Exception as exc:  # never cost the user the findings themselves
            findings.append(failed(step, exc))
    for name in JUDGES:  # the verdict and per-step causes: they read every finding above
        if only and name not in only:
            continue
        try:
            module = importlib.import_module(f"traindx.analyzers.{name}")
            findings = findings + module.analyze(run, findings)
        except Exception as exc:  # the findings stay; the report says no verdict was made
            findings.append(failed(name, exc))
    return rank_findings(findings)


# what each post-analysis step loses when it fails
_STEP_LOSS = {
    "chains": "symptoms are not linked to their causes",
    "savings": "prescriptions keep their own gain estimates",
    "codefix": "code prescriptions are unchecked",
}


def failed(name, exc):
    """The finding (and the one warning line) for an analyzer or step of traindx that raised:
    only its own result is missing."""
    what = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    loss = _STEP_LOSS.get(name, "its findings are missing; the other analyzers' stand")
    warnings.warn(f"analyzer '{name}' failed ({what}): {loss}", AnalyzerFailedWarning, stacklevel=2)
    return Finding(
        id=f"traindx.analyzer_failed.{name}",
        title=f"analyzer '{name}' failed",
        severity="info",
        analyzer=name,
        summary=f"{what}; {loss}",
    )


class AnalyzerFailedWarning(UserWarning):
    """An analyzer of traindx raised (a bug of traindx, not of the job)."""
