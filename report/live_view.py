"""The live view while a job runs: a status line (rich Live on a terminal, plain lines in a log)
and each stable finding printed once, with its first prescription. It only renders what
`traindx.analyzers.live.live.LiveJudge` decided."""

from __future__ import annotations

import errno
import os
import sys
import time
from types import TracebackType
from typing import TextIO

from rich.live import Live
from rich.text import Text

from traindx.analyzers.core.findings import Finding
from traindx.analyzers.live.live import LiveState
from traindx.common.console import Console
from traindx.report.terminal import SEVERITY_STYLE

PLAIN_STATUS_EVERY_S = 30.0  # a log file gets a status line this often, not at every refresh


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms"


def status_text(state: LiveState) -> str:
    """One line: elapsed, step, median step, the ledger's largest lines, the current top finding."""
    parts = [f"traindx ▸ {state.elapsed_s:5.0f} s", f"step {state.step}"]
    if state.median_step_s is not None:
        parts.append(f"median step {_fmt_s(state.median_step_s)}")
    elif state.last_step_s is not None:
        parts.append(f"last step {_fmt_s(state.last_step_s)}")
    if state.compiles:
        parts.append(f"compiles {state.compiles}")
    if state.ledger_line:
        parts.append(state.ledger_line)
    if state.top is not None:
        parts.append(f"top: {state.top.title}")
    if state.stop_requested_at is not None:
        parts.append(f"stopping after step {state.stop_requested_at}")
    return " │ ".join(parts)


def _where(value: object) -> str:
    """A frame as file:line (function); other values as they are."""
    if isinstance(value, dict) and value.get("file"):
        text = f"{value['file']}:{value.get('line', '?')}"
        return f"{text} ({value['function']})" if value.get("function") else text
    return str(value)


def finding_lines(finding: Finding, state: LiveState) -> list[str]:
    """A stable finding as printed while the job runs: what, where, and the first fix."""
    lost = ""
    if finding.seconds_lost_per_step:
        lost = f" ({_fmt_s(finding.seconds_lost_per_step)} per step)"
    lines = [f"traindx ▸ step {state.step}: [{finding.severity}] {finding.title}{lost}"]
    ev = finding.evidence or {}
    for key in ("origin", "caller", "site", "line"):
        value = ev.get(key)
        if value:
            lines.append(f"    {key}: {_where(value)}")
            break
    if finding.prescriptions:
        p = finding.prescriptions[0]
        lines.append(f"    fix: {p.summary}")
        if p.command:
            lines.extend("      " + line for line in str(p.command).splitlines()[:8])
    return lines


class LiveView:
    """Renders LiveJudge callbacks to a terminal (rich Live) or to a log file (plain lines)."""

    def __init__(self, stream: TextIO = sys.stderr, live: bool | None = None) -> None:
        self.console = Console(file=stream)
        self.live = stream.isatty() if live is None else live
        self._live: Live | None = None
        self._state = LiveState()
        self._last_plain = 0.0

    def __enter__(self) -> LiveView:
        if self.live:
            self._live = Live(
                Text(""),
                console=self.console,
                refresh_per_second=2,
                transient=True,
                get_renderable=self._render,
            )
            self._live.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._live is not None:
            self._live.__exit__(exc_type, exc, traceback)
            self._live = None

    def _render(self) -> Text:
        return Text(status_text(self._state), style="bold cyan", overflow="ellipsis", no_wrap=True)

    def on_state(self, state: LiveState) -> None:
        self._state = state
        if not self.live and state.analyses and time.monotonic() - self._last_plain >= PLAIN_STATUS_EVERY_S:
            self._last_plain = time.monotonic()
            self.console.print(status_text(state), markup=False, highlight=False, soft_wrap=True)

    def on_finding(self, finding: Finding, state: LiveState) -> None:
        style = SEVERITY_STYLE.get(finding.severity, "")
        for i, line in enumerate(finding_lines(finding, state)):
            self.console.print(
                line, markup=False, highlight=False, soft_wrap=True, style=style if i == 0 else ""
            )

    def write_output(self, stream: str, data: bytes) -> None:
        """The job's own bytes ("o": stdout, else stderr), unchanged, above the live line."""
        fd = 1 if stream == "o" else 2
        live = self._live
        if live is None:
            (sys.stdout if stream == "o" else sys.stderr).flush()
            _write_all(fd, data)
            return
        # rich draws the status line again at its next refresh; until then it is erased so
        # that the job's bytes start where it was (rich's own print does the same)
        with live._lock:
            try:
                self.console.control(live._live_render.position_cursor())
                self.console.file.flush()
            except Exception:  # rich's internals moved: the bytes still go out whole
                pass
            _write_all(fd, data)


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except BrokenPipeError:
        raise  # the reader of this stream is gone: the relay closes the job's end (as bare)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise  # full (/dev/full, a full disk): the job's next write fails, as bare
        # else the terminal is gone (hung up)
