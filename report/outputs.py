"""Derived outputs of a run folder: findings.json and report.html, rebuilt from the record. The run
is judged once (traindx.judgement.judge_run) and every output renders that Judgement."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from traindx.analyzers.core.findings import Finding
from traindx.common import untrusted
from traindx.common.atomic import replace_with, write_json
from traindx.common.errors import UserError
from traindx.judgement import Judgement, judge_run

if TYPE_CHECKING:
    from traindx.derive.run import RunRecord

T = TypeVar("T")


def write_findings(run: RunRecord, judged: Judgement | Sequence[Finding]) -> str:
    """RUN/findings.json: the judgement's findings with their --fix plans and the step causes
    (Judgement.findings_json); a bare list of findings (the --fix runner's measured rewrite) as
    it is."""
    path = os.path.join(run.path, "findings.json")
    entries = judged.findings_json() if isinstance(judged, Judgement) else [x.to_dict() for x in judged]
    write_json(path, entries, indent=2, default=str)
    return path


def write_ledger(run: RunRecord) -> str:
    """ledger.csv: the start-up rows (step -1, phase "startup") then one row per rank-step."""
    import pandas as pd  # lazy: pandas stays out of `diagnose --help`

    path = os.path.join(run.path, "ledger.csv")
    parts = [run.startup_ledger.assign(phase="startup"), run.ledger.assign(phase="step")]
    table = (
        pd.concat([p for p in parts if len(p)], ignore_index=True)
        if any(len(p) for p in parts)
        else run.ledger.assign(phase=[])
    )
    replace_with(path, lambda tmp: table.to_csv(tmp, index=False, float_format="%.9f"))
    return path


def read_findings(run_path: str) -> list[Finding]:
    path = os.path.join(run_path, "findings.json")
    # a received folder's findings are untrusted input: no link, FIFO or device; nesting bounded
    return [Finding.from_dict(d) for d in untrusted.load_json(path, bounded=False)]


def _attempt(problems: list[str], what: str, write: Callable[[], T]) -> T | None:
    """write() or, when the disk refuses (full, read-only), one line in `problems` naming what
    was not written; the previous file is left whole (every writer here renames into place)."""
    try:
        return write()
    except OSError as exc:
        reason = exc.strerror or f"{type(exc).__name__}: {exc}"
        problems.append(f"{what} ({reason})")
        return None


def write_outputs(
    run: RunRecord,
    judgement: Judgement | None = None,
    report_path: str | None = None,
    into_run: bool = True,
    comparison: Mapping[str, Any] | None = None,
) -> tuple[Judgement, str | None, list[str]]:
    """Judge a loaded run (unless its `judgement` is given) and write what renders it:
    findings.json and ledger.csv in the run folder (unless into_run is False: `report -o
    elsewhere` leaves the run folder as it is) and the HTML report (at report_path, default
    RUN/report.html). Returns (judgement, report path or None, problems): a write that fails is
    one line in problems, never an exception, and the other outputs are still written."""
    judged = judge_run(run) if judgement is None else judgement
    problems: list[str] = []
    if into_run:
        _attempt(problems, os.path.join(run.path, "findings.json"), lambda: write_findings(run, judged))
        _attempt(problems, os.path.join(run.path, "ledger.csv"), lambda: write_ledger(run))
    try:
        from traindx.report.html import write_report  # lazy: Jinja2 is loaded only to render
    except ImportError:
        return judged, None, problems
    target = report_path or os.path.join(run.path, "report.html")
    written = _attempt(
        problems, target, lambda: write_report(run, judged, path=report_path, comparison=comparison)
    )
    return judged, written, problems


def analyze_and_write(run: RunRecord) -> tuple[Judgement, str | None]:
    """Judge a loaded run, write findings.json and report.html; returns (the judgement, report
    path or None). What could not be written is one line each on stderr."""
    judgement, report_path, problems = write_outputs(run)
    for line in problems:
        print(f"diagnose: not written: {line}", file=sys.stderr)
    return judgement, report_path


def write_live_report(run: RunRecord, findings: list[Finding]) -> None:
    """report.html rewritten while the job runs (write-then-rename: it can be opened mid-run),
    rendering the live judge's findings completed into a judgement."""
    try:
        from traindx.report.html import write_report  # lazy: Jinja2 is loaded only to render

        write_report(run, judge_run(run, findings))
    except (ImportError, OSError):
        pass  # the final report is written at the end; a mid-run one is a convenience


def write_json_file(path: str, data: Any) -> str:
    """Write `data` as JSON to a file the user named, atomically: a failure (full disk, a folder
    that went away) is one UserError naming the file, and leaves neither a half file nor a .tmp."""
    try:
        write_json(path, data, user_path=True, indent=2, default=str)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path
