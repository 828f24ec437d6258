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


def read_findings(run_path):
    path = os.path.join(run_path, "findings.json")
    with open(path, encoding="utf-8") as f:
        return [Finding.from_dict(d) for d in json.load(f)]


def analyze_and_write(run, console=None):
    """Analyze a loaded run, write findings.json and report.html; returns (findings, report path)."""
    from traindx.analyzers import analyze

    findings = analyze(run)
    write_findings(run, findings)
    report_path = None
    try:
        from traindx.report.html import write_report
    except ImportError:
        write_report = None
    if write_report is not None:
        report_path = write_report(run, findings)
    return findings, report_path
