"""Derived outputs of a run folder: findings.json and report.html, rebuilt from the record."""
import json
import os

from traindx.findings import Finding


def write_findings(run, findings):
    path = os.path.join(run.path, "findings.json")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump([x.to_dict() for x in findings], f, indent=2, default=str)
    os.replace(tmp, path)
    return path


def write_ledger(run):
    """ledger.csv: the start-up rows (step -1, phase "startup") then one row per rank-step."""
    import pandas as pd

    path = os.path.join(run.path, "ledger.csv")
    parts = [run.startup_ledger.assign(phase="startup"), run.ledger.assign(phase="step")]
    table = pd.concat([p for p in parts if len(p)], ignore_index=True) if any(len(p) for p in parts) \
        else run.ledger.assign(phase=[])
    tmp = path + ".tmp"
    table.to_csv(tmp, index=False, float_format="%.9f")
    os.replace(tmp, path)
    return path


def read_findings(run_path):
    path = os.path.join(run_path, "findings.json")
    with open(path, encoding="utf-8") as f:
        return [Finding.from_dict(d) for d in json.load(f)]


def analyze_and_write(run, console=None):
    """Analyze a loaded run, write findings.json and report.html; returns (findings, report path)."""
    from traindx.analyzers import analyze

    findings = analyze(run)
    write_findings(run, findings)
    try:
        write_ledger(run)
    except OSError:
        pass  # a read-only run folder: findings.json above already said so if it matters
    report_path = None
    try:
        from traindx.report.html import write_report
    except ImportError:
        write_report = None
    if write_report is not None:
        report_path = write_report(run, findings)
    return findings, report_path
