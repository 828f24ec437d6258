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


# read every rank at once (the rest read the sampled ranks on a large job: analyzers/sampling.py)
CROSS_RANK = {"steps", "ranks", "gpu_clocks"}


def analyze(run, only=None):
    findings = []
    from .sampling import representative_ranks

    sampled = representative_ranks(run)
    per_rank_run = run if len(sampled) == len(run.ranks) else run.subset(sampled)
    if per_rank_run is not run:
        findings.append(Finding(
            id="analysis.ranks_sampled",
            title=f"Per-rank analysis read {len(sampled)} of {len(run.ranks)} ranks",
            severity="info", analyzer="sampling",
            summary=(f"{len(run.ranks)} ranks: the per-rank analyzers read {len(sampled)} of them - "
                     "the first and last, and the ranks at both extremes of every step-time and "
                     "time-ledger measure; the straggler and GPU analyses read every rank."),
            evidence={"ranks_analyzed": sampled, "ranks": len(run.ranks)}))
    for name in REGISTRY:
        if only and name not in only:
            continue
        try:
            module = importlib.import_module(f"traindx.analyzers.{name}")
            findings.extend(module.analyze(run if name in CROSS_RANK else per_rank_run))
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
