"""Terminal output: the ranked summary after a job (the live view while it runs:
report/live_view.py)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from traindx.common.console import Console
from traindx.common.units import fmt_s

if TYPE_CHECKING:
    from traindx.analyzers.core.findings import Finding
    from traindx.derive.run import RunRecord
    from traindx.judgement import Judgement

SEVERITY_STYLE = {"critical": "bold red", "high": "red", "medium": "yellow", "low": "cyan", "info": "dim"}
SUMMARY_ROWS = 6
CODE_LINES = 6  # lines of a diff or command printed under the verdict
# what --fix's plan does with a prescription (the judgement's plans: analyzers/judgement.py)
FIX_MARK = {
    "applied": "--fix applies this",
    "next": "--fix tries this next",
    "alternative": "alternative, not applied by --fix",
    "by_hand": "by hand",
    "skipped": "not tried by --fix's ladder",
}


_OPEN, _CLOSE = "([{", ")]}"


def _atoms(text: str) -> list[str]:
    """Words of text, where code stays one atom: a call or an index (DataLoader(a=1, b=2),
    x[0, 1]) or a `quoted` span never breaks inside; a prose parenthesis (like this one) does."""
    atoms: list[str] = []
    stack: list[bool] = []
    current, quoted = "", False
    for word in text.split():
        current = f"{current} {word}" if current else word
        for i, ch in enumerate(word):
            if ch == "`":
                quoted = not quoted
            elif ch in _OPEN:
                # code when the bracket follows a name: f(…), a[…]; prose when it opens a word
                stack.append(i > 0 and (word[i - 1].isalnum() or word[i - 1] in "_.]"))
            elif ch in _CLOSE and stack:
                stack.pop()
        if not any(stack) and not quoted:
            atoms.append(current)
            current = ""
    if current:
        atoms.append(current)
    return atoms


def wrap_keeping_code(text: str, width: int, first: str = "", indent: str = "  ") -> list[str]:
    """Lines of at most width (when an atom fits), broken only between atoms; an atom longer
    than a line is printed whole on its own line (a terminal folds it, a log file keeps it)."""
    lines, line, empty = [], first, True
    for atom in _atoms(text):
        if not empty and len(line) + 1 + len(atom) > width:
            lines.append(line)
            line, empty = indent, True
        line += atom if empty else " " + atom
        empty = False
    lines.append(line)
    return lines


def _say(console: Console, text: str, style: str = "", first: str = "", indent: str = "  ") -> None:
    """Print prose that may hold code: wrapped at the console's width between atoms only, and
    never re-wrapped by rich (soft_wrap), so a log file holds each piece of code whole."""
    for i, line in enumerate(wrap_keeping_code(text, console.width, first, indent)):
        if i == 0 and first:
            console.print(Text(first, style="bold") + Text(line[len(first) :], style=style), soft_wrap=True)
        else:
            console.print(Text(line, style=style), soft_wrap=True)


def _stats_line(data: Mapping[str, Any]) -> list[str]:
    """The run's numbers, one labelled statistic each, as parts joined by ' · '."""
    st = data["stats"]
    parts = [
        f"{st['steps']} steps recorded on {st['ranks']} rank(s)",
        f"step time median {fmt_s(st['steady_median_s'])}",
        f"p90 {fmt_s(st['p90_step_s'])}",
    ]
    w = st["worst_step"]
    if w:
        slowest = f"slowest step {w['step']}: {fmt_s(w['duration_s'])}"
        if w["cause"] != "normal":
            slowest += f" ({data['causes'].get(w['cause'], w['cause'])})"
        parts.append(slowest)
    if st.get("mfu") is not None:
        parts.append(f"MFU {st['mfu']:.1%}")
    elif st.get("mfu_note"):
        parts.append(f"MFU unknown ({st['mfu_note']})")
    if st["compiles"]:
        parts.append(
            f"{st['compiles']} JIT compile{'s' if st['compiles'] != 1 else ''}, {fmt_s(st['compile_s'])}"
        )
    return parts


def _print_parts(console: Console, parts: list[str], style: str = "") -> None:
    """' · '-joined parts, wrapped between parts (a number never leaves its label)."""
    line = ""
    for part in parts:
        if line and len(line) + 3 + len(part) > console.width:
            console.print(Text(line, style=style), soft_wrap=True)
            line = "  " + part
        else:
            line = f"{line} · {part}" if line else part
    if line:
        console.print(Text(line, style=style), soft_wrap=True)


def _print_verdict(console: Console, v: Mapping[str, Any]) -> None:
    if v["kind"] == "change":
        _say(console, v["headline"], style="bold green", first="Verdict: ")
        if v["gain_s"]:
            gain = f"expected saving {fmt_s(v['gain_s'])} per step"
            if v.get("saving_limit") and v.get("lost_s"):
                gain += f" of the {fmt_s(v['lost_s'])} this cause costs ({v['saving_limit']})"
            if v["speedup"]:
                gain += (
                    f" (≈ {v['speedup']:.1f}× faster: {v.get('step_statistic', 'mean')} step "
                    f"{fmt_s(v['median_step_s'])} → "
                    f"{fmt_s(v['after_step_s'])})"
                )
            _say(console, gain, first="  ", indent="    ")
        if v["text"]:
            for line in v["text"].splitlines()[:CODE_LINES]:  # code: whole lines, never wrapped
                console.print(Text("  " + line, style="cyan"), soft_wrap=True)
        why = f"why: {v['finding_title']}"
        if v.get("fix") == "applied":
            why += " · diagnose --fix applies this"
        _say(console, why, style="dim", first="  ", indent="    ")
    elif v["kind"] == "problem":
        _say(console, v["headline"], style="bold yellow", first="Main problem: ")
    elif v["kind"] == "inefficient":
        _say(console, v["headline"], style="bold yellow", first="Verdict: ")
    elif v["kind"] == "nosteps":
        _say(console, v["headline"], style="yellow")
        _say(console, v["summary"], style="dim", first="  ", indent="  ")
    else:
        _say(console, v["headline"], style="green")


def print_summary(
    run: RunRecord, judgement: Judgement, report_path: str | None = None, console: Console | None = None
) -> None:
    """The verdict and the top findings of a judged run, from the same report data as the HTML
    report (report.data.build_summary)."""
    from traindx.report.data import build_summary  # pandas: not for the live status line

    render_summary(build_summary(run, judgement), run.path, report_path, console)


def render_summary(
    data: Mapping[str, Any], run_path: str, report_path: str | None = None, console: Console | None = None
) -> None:
    """Print summary data (report.data.build_summary). Fits 80 columns and a log file: numbers
    wrap between parts, code is never broken, prescriptions are listed under the table
    (numbered) rather than cut in a column."""
    console = console or Console(file=sys.stderr)
    v, st = data["verdict"], data["stats"]
    console.rule("traindx")
    if st["steps"]:
        _print_parts(console, _stats_line(data))
        for line in (st.get("ledger_line"), st.get("gpu_classes_line"), st.get("startup_line")):
            if line:
                head, _, rest = line.partition(" = ")
                parts = rest.split(" · ") if rest else []
                _print_parts(
                    console,
                    [f"{head} = {parts[0]}"] + parts[1:] if parts else [line],
                    style="dim" if line is st.get("startup_line") else "",
                )
    _print_verdict(console, v)
    problems = [f for f in data["findings"] if f["severity"] != "info"]
    if problems:
        table = Table(show_header=True, header_style="bold")
        table.add_column("#", justify="right", no_wrap=True)
        table.add_column("severity", no_wrap=True)
        table.add_column("finding", ratio=1)
        table.add_column("lost/step", justify="right", no_wrap=True)
        listed = []
        for f in problems[:SUMMARY_ROWS]:
            lost = "-" if f["seconds_lost_per_step"] is None else fmt_s(f["seconds_lost_per_step"])
            if f.get("cause"):  # a symptom, printed under its cause: its seconds are the cause's
                lost = f"({lost})"
            title = Text(f"↳ symptom: {f['title']}", style="dim") if f.get("cause") else Text(f["title"])
            number = ""
            if f["prescriptions"]:
                listed.append(f)
                number = str(len(listed))
            table.add_row(
                number, Text(f["severity"], style=SEVERITY_STYLE.get(f["severity"], "")), title, lost
            )
        console.print(table)
        for i, f in enumerate(listed, 1):
            p = f["prescriptions"][0]
            mark = FIX_MARK.get(p.get("fix") or "")
            said = (
                v["kind"] == "change" and f["anchor"] == v["finding_anchor"] and p["summary"] == v["headline"]
            )
            _say(
                console,
                ("the verdict above" if said else p["summary"]) + (f" [{mark}]" if mark else ""),
                first=f"{i}. ",
                indent="   ",
            )
            for q in f["prescriptions"][1:]:
                if q.get("planned") and q.get("fix") == "applied":  # built by --fix's planner
                    _say(console, f"--fix builds and applies: {q['summary']}", first="   ", indent="     ")
            more = len([q for q in f["prescriptions"] if not q.get("planned")]) - 1
            if more:
                console.print(
                    Text(f"   + {more} alternative{'s' if more > 1 else ''} in the report", style="dim"),
                    soft_wrap=True,
                )
        if len(problems) > SUMMARY_ROWS:
            console.print(f"… and {len(problems) - SUMMARY_ROWS} more in the report", markup=False)
    _print_notes(console, data)
    if report_path:
        console.print(f"report: {report_path}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"run: {run_path}", markup=False, highlight=False, soft_wrap=True)


def _print_notes(console: Console, data: Mapping[str, Any]) -> None:
    """The first notes, what was not collected, and what recording cost the job (every run)."""
    skip = ("evidence.missing", "traindx.cost")
    notes = [f for f in data["findings"] if f["severity"] == "info" and f["id"] not in skip]
    for f in notes[:3]:
        _say(console, f"note: {f['title']}", style="dim")
    if data["missing"]:
        _say(console, "not collected: " + data["missing_summary"], style="dim")
    if data["stats"].get("cost_line"):
        _say(console, data["stats"]["cost_line"], style="dim")


def findings_table(findings: list[Finding], lost_header: str, digits: int) -> Table:
    """Severity, title, seconds lost (under `lost_header`) and the first prescription of each
    finding, one row each."""
    table = Table(show_header=True, header_style="bold")
    table.add_column("severity")
    table.add_column("finding")
    table.add_column(lost_header, justify="right")
    table.add_column("first prescription")
    for f in findings:
        lost = "-" if f.seconds_lost_per_step is None else f"{f.seconds_lost_per_step:.{digits}f} s"
        table.add_row(
            Text(f.severity, style=SEVERITY_STYLE.get(f.severity, "")),
            Text(f.title),
            lost,
            Text(f.prescriptions[0].summary if f.prescriptions else ""),
        )
    return table


def print_file_summary(path: str, findings: list[Finding], console: Console | None = None) -> None:
    """The findings of a py-spy recording on its own (`diagnose analyze FILE`): stacks only."""
    console = console or Console(file=sys.stderr)
    console.rule("traindx")
    console.print(
        f"py-spy recording: {path} (stacks only: no steps, no compile keys)", markup=False, highlight=False
    )
    if not findings:
        console.print(Text("No JIT compiles after the first call were found in these stacks.", style="green"))
        return
    console.print(findings_table(findings, "per recompile", digits=2))
    for f in findings[:3]:
        console.print(Text(f.summary, style="cyan"))
