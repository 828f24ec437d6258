"""Analyzers: one module per pathology, each a pure function `analyze(run) -> [Finding]`.

Each declares itself in its own module (`DECLARATION`, analyzers/core/declaration.py): the registry
below is derived from those declarations. An analyzer that raises is reported as a finding about
traindx itself, never as a crash of the whole analysis.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from traindx.analyzers.codefix import checked
from traindx.analyzers.core import chains
from traindx.analyzers.core.declaration import catalog
from traindx.analyzers.core.findings import Finding, rank_findings
from traindx.analyzers.core.sampling import representative_ranks

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

CATALOG = catalog()
# analyzer names, in the order they run; each one's module exposes analyze(run) -> [Finding]
REGISTRY = CATALOG.registry
# analyzer name -> its module's dotted path (traindx.analyzers.jit.jit)
MODULES = CATALOG.modules
# judged last, over every other finding once linked and priced: analyze(run, findings) -> [Finding]
JUDGES = CATALOG.judges
# read every rank at once (the rest read the sampled ranks on a large job: analyzers/core/sampling.py)
CROSS_RANK = CATALOG.cross_rank


def analyze(run: RunRecord, only: Iterable[str] | None = None) -> list[Finding]:
    wanted = set(only) if only else None
    sampled = representative_ranks(run)
    per_rank_run = run if len(sampled) == len(run.ranks) else run.subset(sampled)
    findings = [] if per_rank_run is run else [_sampled_note(run, sampled)]
    try:  # what recording cost this job: every run states it
        findings.extend(own_cost(run))
    except Exception as exc:
        findings.append(failed("self_cost", exc))
    for name in REGISTRY:
        if wanted and name not in wanted:
            continue
        try:
            module = importlib.import_module(MODULES[name])
            findings.extend(module.analyze(run if name in CROSS_RANK else per_rank_run))
        except Exception as exc:  # one broken analyzer must not hide the others' findings
            findings.append(failed(name, exc))
    for name, error in CATALOG.broken:  # declared, but its module did not import
        if not wanted or name in wanted:
            findings.append(failed(name, error))
    findings = _linked_and_priced(findings, run)
    for name in JUDGES:  # the verdict and per-step causes: they read every finding above
        if wanted and name not in wanted:
            continue
        try:
            module = importlib.import_module(MODULES[name])
            findings = findings + module.analyze(run, findings)
        except Exception as exc:  # the findings stay; the report says no verdict was made
            findings.append(failed(name, exc))
    return rank_findings(findings)


def _sampled_note(run: RunRecord, sampled: list[str]) -> Finding:
    return Finding(
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


def _linked_and_priced(findings: list[Finding], run: RunRecord) -> list[Finding]:
    """One pass over all findings: symptoms under their causes, savings from the time ledger,
    code prescriptions checked (a real edit, or prose); each step on its own, so that one
    failing keeps what the others did."""
    steps: tuple[tuple[str, Callable[[list[Finding]], list[Finding]]], ...] = (
        ("chains", lambda fs: chains.attach_call_sites(chains.link(fs))),
        ("savings", lambda fs: chains.apply_savings(fs, run)),
        ("codefix", checked),
    )
    for step, fn in steps:
        try:
            findings = fn(findings)
        except Exception as exc:  # never cost the user the findings themselves
            findings.append(failed(step, exc))
    return findings


# what each post-analysis step loses when it fails
_STEP_LOSS = {
    "chains": "symptoms are not linked to their causes",
    "savings": "prescriptions keep their own gain estimates",
    "codefix": "code prescriptions are unchecked",
}


def own_cost(run: RunRecord) -> list[Finding]:
    """`traindx.cost`: what traindx cost this job (traindx.derive.selfcost), its parts in the
    evidence; none for a run without the shim's own accounting."""
    from traindx.derive.selfcost import cost_line, self_cost  # lazy: pandas, as the analyzers

    cost = self_cost(run)
    line = cost_line(cost)
    if cost is None or line is None:
        return []
    return [
        Finding(
            id="traindx.cost",
            title=line,
            severity="info",
            analyzer="self_cost",
            summary=(
                "Measured by traindx itself: its code's time on the job's threads and its threads' CPU "
                "(the shim), the helpers' CPU (py-spy, the output relay, NVML, the live judge) priced at "
                "the job's wait for a core, and the steps it perturbed on purpose (a torch.profiler "
                "window, a memory hunt). The time ledger books the first as `traindx`, never as the "
                "job's host work."
            ),
            evidence=cost,
        )
    ]


def failed(name: str, exc: BaseException) -> Finding:
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
