"""Run-level facts every report needs, and a warning when evidence is missing."""

from __future__ import annotations

import re
import signal
from typing import TYPE_CHECKING, Any

from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="steps",
    order=10,
    ids=("evidence.missing", "job.exit"),
    cross_rank=True,
    not_causes=("evidence.missing",),
)


def analyze(run: RunRecord) -> list[Finding]:
    findings = []
    if run.missing:
        findings.append(
            Finding(
                id="evidence.missing",
                title="Some evidence could not be collected",
                severity="info",
                analyzer="steps",
                summary="; ".join(f"{k}: {v}" for k, v in sorted(run.missing.items())),
                evidence={"missing": dict(run.missing)},
            )
        )
    findings.extend(_job_exit(run))
    return findings


# a line of a crash's own message (the C++ runtime's, CPython's, a launcher's), in any framework
_CRASH_LINE = re.compile(
    r"terminate called|Fatal Python error|Segmentation fault|core dumped|"
    r"Aborted|\bError\b|Error:|Exception|FATAL|Traceback",
    re.IGNORECASE,
)
STDERR_TAIL_LINES = 40


def _exit_words(code: int, forwarded: list[Any]) -> str:
    """'SIGABRT (exit 134)' for a signal (the launcher records -N), 'exit 3' otherwise."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        how = " (forwarded by diagnose)" if name in forwarded else ""
        return f"{name} (exit {128 - code}){how}"
    return f"exit {code}"


def _job_exit(run: RunRecord) -> list[Finding]:
    """A job that did not end with 0: how it ended and the first crash line of its stderr's tail,
    so that an abort at teardown names itself (the verdict still judges the steps recorded)."""
    manifest = run.manifest or {}
    code = manifest.get("exit_code")
    if not isinstance(code, int) or code == 0:
        return []
    log = run.log
    tail = [str(t) for t in log.loc[log["stream"] == "e", "text"].tail(STDERR_TAIL_LINES)] if len(log) else []
    crash = next((i for i, line in enumerate(tail) if _CRASH_LINE.search(line)), None)
    quoted = tail[crash : crash + 3] if crash is not None else tail[-3:]
    first = next((line.strip() for line in quoted if line.strip()), "")
    words = _exit_words(code, [str(s) for s in manifest.get("signals_forwarded") or []])
    title = f"The job ended by {words}" if code < 0 else f"The job ended with {words}"
    if first:
        title += f"; its stderr: {first[:160]}"
    stacks = run.fault_stacks
    crashed = {label: _crashing_frame(text) for label, text in stacks.items()}
    where = next(((label, frame) for label, frame in crashed.items() if frame), None)
    if where:
        title += f"; {where[0]} crashed at {where[1]}"
    summary = (
        f"The job's process ended by {words}. Its last lines on stderr:\n" + "\n".join(tail[-12:])
        if tail
        else f"The job's process ended by {words}; it printed nothing on stderr."
    )
    for label, text in stacks.items():
        summary += f"\nPython's stacks of {label} at the crash (faulthandler):\n{text[-4000:]}"
    return [
        Finding(
            id="job.exit",
            title=title,
            severity="info",
            analyzer="steps",
            summary=summary,
            evidence={
                "exit_code": code,
                "signal": words if code < 0 else None,
                "crash_lines": quoted,
                "stderr_tail": tail[-12:],
                "crashed_at": crashed,
                "fault_stacks": stacks,
            },
        )
    ]


def _crashing_frame(text: str) -> str | None:
    """'file:line in function' innermost in the crashing thread of a faulthandler dump."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Current thread") or line.startswith("Stack (most recent call first)"):
            for frame in lines[i + 1 :]:
                m = re.match(r'\s+File "(.+)", line (\d+) in (.+)', frame)
                if m:
                    return f"{m.group(1)}:{m.group(2)} in {m.group(3)}"
                if not frame.strip():
                    break
    return None
