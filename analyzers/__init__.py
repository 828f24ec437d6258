"""Analyzers: one module per pathology, each a pure function `analyze(run) -> [Finding]`.

Registered here, in one place. An analyzer that raises is reported as a finding about traindx
itself, never as a crash of the whole analysis.
"""
import importlib

from traindx.findings import Finding, rank_findings

# module names under traindx.analyzers; each exposes analyze(run) -> list[Finding]
REGISTRY = [
    "steps",
    "gil", "dataloader", "gc_pauses", "host_sync", "allocator", "launch_bound", "gpu_clocks",
    "ranks", "stability",
    "jit",
]


def analyze(run, only=None):
    findings = []
    for name in REGISTRY:
        if only and name not in only:
            continue
        try:
            module = importlib.import_module(f"traindx.analyzers.{name}")
            findings.extend(module.analyze(run))
        except Exception as exc:  # one broken analyzer must not hide the others' findings
            findings.append(Finding(
                id=f"traindx.analyzer_failed.{name}", title=f"analyzer '{name}' failed",
                severity="info", analyzer=name, summary=f"{type(exc).__name__}: {exc}"))
    # one pass over all findings: symptoms under their causes, savings from the time ledger
    from . import chains

    try:
        findings = chains.apply_savings(chains.link(findings), run)
    except Exception as exc:  # the linking must never cost the user the findings themselves
        findings.append(Finding(
            id="traindx.analyzer_failed.chains", title="linking causes and savings failed",
            severity="info", analyzer="chains", summary=f"{type(exc).__name__}: {exc}"))
    # a code prescription is a real edit of the job's file, or it is prose (analyzers/codefix.py)
    from traindx.analyzers.codefix import checked
    return rank_findings(checked(findings))
