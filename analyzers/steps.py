"""Run-level facts every report needs, and a warning when evidence is missing."""
from traindx.findings import Finding


def analyze(run):
    findings = []
    if run.missing:
        findings.append(Finding(
            id="evidence.missing", title="Some evidence could not be collected",
            severity="info", analyzer="steps",
            summary="; ".join(f"{k}: {v}" for k, v in sorted(run.missing.items())),
            evidence={"missing": dict(run.missing)}))
    return findings
