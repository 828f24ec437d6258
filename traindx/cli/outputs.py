"""Derived outputs of a run folder: findings.json and report.html, rebuilt from the record."""

import json
import os

from traindx.analyzers import analyze
from traindx.analyzers.findings import Finding


def _replace_from(tmp, path, write):
    """write(tmp) then rename it onto path; on failure no .tmp is left and path is untouched."""
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    return path


def write_findings(run, findings):
    path = os.path.join(run.path, "findings.json")

    def dump(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump([x.to_dict() for x in findings], f, indent=2, default=str)

    return _replace_from(path + ".tmp", path, dump)


def write_ledger(run):
    """ledger.csv: the start-up rows (step -1, phase "startup") then one row per rank-step."""
    import pandas as pd

    path = os.path.join(run.path, "ledger.csv")
    parts = [run.startup_ledger.assign(phase="startup"), run.ledger.assign(phase="step")]
    table = (
        pd.concat([p for p in parts if len(p)], ignore_index=True)
        if any(len(p) for p in parts)
        else run.ledger.assign(phase=[])
    )
    return _replace_from(path + ".tmp", path, lambda tmp: table.to_csv(tmp, index=False, float_format="%.9f"))


def read_findings(run_path):
    path = os.path.join(run_path, "findings.json")
    with open(path, encoding="utf-8") as f:
        return [Finding.from_dict(d) for d in json.load(f)]


def _attempt(problems, what, write):
    """write() or, when the disk refuses (full, read-only), one line in `problems` naming what
    was not written; the previous file is left whole (every writer here renames into place)."""
    try:
        return write()
    except OSError as exc:
        reason = exc.strerror or f"{type(exc).__name__}: {exc}"
        problems.append(f"{what} ({reason})")
        return None


def write_outputs(run, findings=None, report_path=None, into_run=True, comparison=None):
    """Analyze a loaded run (unless `findings` are given) and write what derives from it:
    findings.json and ledger.csv in the run folder (unless into_run is False: `report -o
    elsewhere` leaves the run folder as it is) and the HTML report (at report_path, default
    RUN/report.html). Returns (findings, report path or None, problems): a write that fails is
    one line in problems, never an exception, and the other outputs are still written."""
    if findings is None:
        findings = analyze(run)
    problems = []
    if into_run:
        _attempt(problems, os.path.join(run.path, "findings.json"), lambda: write_findings(run, findings))
        _attempt(problems, os.path.join(run.path, "ledger.csv"), lambda: write_ledger(run))
    try:
        from traindx.report.html import write_report
    except ImportError:
        return findings, None, problems
    target = report_path or os.path.join(run.path, "report.html")
    written = _attempt(
        problems, target, lambda: write_report(run, findings, path=report_path, comparison=comparison)
    )
    if written is None:
        try:  # a full disk can leave the half-written copy beside it
            os.remove(target + ".tmp")
        except OSError:
            pass
    return findings, written, problems


def analyze_and_write(run, console=None):
    """Analyze a loaded run, write findings.json and report.html; returns (findings, report path
    or None). What could not be written is one line each on stderr."""
    import sys

    findings, report_path, problems = write_outputs(run)
    for line in problems:
        print(f"diagnose: not written: {line}", file=sys.stderr)
    return findings, report_path


def write_live_report(run, findings):
    """report.html rewritten while the job runs (write-then-rename: it can be opened mid-run)."""
    try:
        from traindx.report.html import write_report

        write_report(run, findings)
    except (ImportError, OSError):
        pass  # the final report is written at the end; a mid-run one is a convenience


def write_json_file(path, data):
    """Write `data` as JSON to a file the user named, atomically: a failure (full disk, a folder
    that went away) is one UserError naming the file, and leaves neither a half file nor a .tmp."""
    from traindx.common.errors import UserError

    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, default=str)
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path
