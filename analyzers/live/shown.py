"""What the live judgement shows (analyzers/live/live.py): the root findings that became stable,
handed to `on_finding` once each and recorded in live.json with when they were shown; the deep
captures a stable anomaly asks for; and --until-diagnosed's stop once the top root held.

`ShownFindings` is the part of `LiveJudge` that decides this; LiveJudge holds the state it reads
(declared below) and runs the two stages."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from traindx.analyzers.core.chains import GENERIC_AT_A_LINE
from traindx.analyzers.core.declaration import catalog
from traindx.analyzers.core.findings import Finding
from traindx.analyzers.live.state import (
    LiveOptions,
    LiveState,
    Routes,
    at_least,
    ledger_line,
    request_stop,
    severity_rank,
    write_control,
)
from traindx.profiler.live_tail import EventTail

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

_CATALOG = catalog()
# when each finding was first shown (time to finding, measured): {id: {t_ns, step, severity}}
SHOWN_FILE = "live.json"
# a recompile or re-autotune is proven by the analyzer's own rule (two compiles of one kernel,
# key changed): the ids of that family (a substring of a finding's id)
PROVEN_AT_ONCE = _CATALOG.recompiles
STABLE_AFTER_STEPS = 3
# --until-diagnosed stops on a generic top root (host code at a line) once it stayed the top
# while the record grew to this many times the steps it became the top at (a specific rival at
# its line that needs more steps had its chance)
TOP_HOLD_FACTOR = 2
# stable findings of these analyzers are anomalies worth a deep capture too
CAPTURE_ANALYZERS = _CATALOG.capture_analyzers
STOP_MARGIN_S = 1.0
# a root finding one severity below the printed floor is judged again when the record has grown
# this many times (its share may have been diluted by a warm-up in the first steps: a warm-up is
# at most half the steps, so a one-off of k steps is set apart from 2k + 1 steps on)
GROW_FACTOR = 1.5
# findings that are no cause of a slowdown (the verdict, traindx's own state, missing evidence)
NOT_CAUSES = _CATALOG.not_causes


class ShownFindings:
    """The shown findings' part of LiveJudge (its state is LiveJudge's: declared here)."""

    run_dir: str
    options: LiveOptions
    state: LiveState
    tail: EventTail
    on_finding: Callable[[Finding, LiveState], None]
    on_anomaly: Callable[[str, str], None] | None
    errors: list[str]
    _captured: set[str]
    _seen: dict[str, int]
    _printed: set[str]
    _shown: dict[str, dict[str, Any]]
    _pending: dict[str, str]
    _top: tuple[str | None, int]
    _hold_until: int
    _near: str
    _grow_at: int

    def _anomaly(self, kind: str, why: str) -> None:
        if kind in self._captured or self.on_anomaly is None:
            return
        self._captured.add(kind)
        self.state.captures.append({"kind": kind, "why": why, "t_ns": time.time_ns()})
        try:
            self.on_anomaly(kind, why)
        except Exception as exc:
            self._error(f"capture on {kind}", exc)

    def _error(self, what: str, exc: BaseException) -> None:
        text = f"{what}: {type(exc).__name__}: {exc}"
        if text not in self.errors:
            self.errors.append(text)

    def _write_shown(self) -> None:
        s = self.state
        try:
            write_control(
                os.path.join(self.run_dir, SHOWN_FILE),
                {
                    "findings": self._shown,
                    "captures": s.captures,
                    "analyses": s.analyses,
                    "analysis_cpu_s": round(s.analysis_cpu_s + s.cheap_cpu_s, 4),
                    "full_stage_cpu_s": round(s.analysis_cpu_s, 4),
                    "cheap_stage_cpu_s": round(s.cheap_cpu_s, 4),
                    "report_cpu_s": round(s.report_cpu_s, 4),
                    "polls": s.polls,
                    "import_cpu_s": round(s.import_cpu_s, 4),
                    "passes": s.passes,
                    # a pass that failed says why (the live view never breaks the job)
                    "errors": self.errors,
                },
            )
        except OSError as exc:
            self._error(f"writing {SHOWN_FILE}", exc)

    def _stop_step(self) -> int:
        """A step every rank has not reached yet: the furthest rank's step now, plus the steps
        that fit in STOP_MARGIN_S (each rank reads the request at its next step end, at most
        CONTROL_POLL_NS late; ranks that stop at different steps would hang in a collective)."""
        try:
            self.tail.poll()
        except Exception:
            pass
        step_s = self.state.median_step_s or self.tail.last_step_s or STOP_MARGIN_S
        return self.tail.step + max(2, math.ceil(STOP_MARGIN_S / max(step_s, 1e-3)))

    def _judge(self, run: RunRecord, findings: list[Finding], only: Routes = None, trigger: str = "") -> bool:
        """Print what became stable; True when something was shown."""
        s = self.state
        covered = self.tail.step
        steps = run.steps
        if len(steps) and "duration_s" in steps:
            durations = steps["duration_s"].dropna()
            s.median_step_s = float(durations.median()) if len(durations) else None
        if only is None:
            s.ledger_line = ledger_line(run)
        floor = self.options.min_severity
        roots = [
            f
            for f in findings
            if f.cause is None and at_least(f.severity, floor) and not f.id.startswith(NOT_CAUSES)
        ]
        stable = self._stable(roots, covered)
        if only is None or roots:  # a partial analysis says nothing of the other analyzers
            s.top = roots[0] if roots else s.top if only else None
        if only is None:
            self._watch_near(findings, covered)
        new = [f for f in stable if f.id not in self._printed]
        if new:
            try:  # the step on the screen when it is printed, not the one the analysis read
                self.tail.poll()
            except Exception:
                pass
        s.step = max(s.step, self.tail.step)
        self._show(new, covered, trigger)
        unconfirmed = [f for f in roots if f not in stable]
        if unconfirmed or (only is not None and new):
            # seen once, or found by one analyzer alone: judged again at the next step end
            why = unconfirmed[0].id if unconfirmed else f"{new[0].id} found by {only}"
            self._pending.setdefault("confirm", why)
        if (
            self.options.until_diagnosed and roots and s.stop_requested_at is None and only is None
        ):  # the top is only known from a full analysis
            self._stop_if_diagnosed(roots, stable, covered)
        return bool(new)

    def _stable(self, roots: list[Finding], covered: int) -> list[Finding]:
        """The root findings seen in two steady steps (or proven at once: a recompile)."""
        stable = []
        for f in roots:
            first = self._seen.setdefault(f.id, covered)
            proven = (
                any(k in f.id for k in PROVEN_AT_ONCE)
                or len(set(f.steps_affected)) >= 2
                or covered >= STABLE_AFTER_STEPS
            )
            if proven or covered > first:
                stable.append(f)
        return stable

    def _show(self, new: list[Finding], covered: int, trigger: str) -> None:
        """Hand the newly stable findings to on_finding, once each, and record when."""
        s = self.state
        for f in new:
            self._printed.add(f.id)
            s.stable.append(f.id)
            self._shown[f.id] = {
                "t_ns": time.time_ns(),
                "step": s.step,
                "analysed_step": covered,
                "trigger": trigger,
                "severity": f.severity,
                "title": f.title,
            }
            self.on_finding(f, s)
            kernel = (f.evidence or {}).get("kernel")
            if isinstance(kernel, str) and any(k in f.id for k in PROVEN_AT_ONCE):
                self.tail.judged_kernels.add(kernel)
            if f.analyzer in CAPTURE_ANALYZERS:  # a straggler, an idle GPU: capture it
                self._anomaly(f.analyzer, f.title)
        if new:
            self._write_shown()

    def _stop_if_diagnosed(self, roots: list[Finding], stable: list[Finding], covered: int) -> None:
        """--until-diagnosed: ask the job to stop once the top root is stable, held, and no
        unstable finding of its severity or above is pending."""
        top = roots[0]
        pending = [
            f for f in roots if f not in stable and severity_rank(f.severity) >= severity_rank(top.severity)
        ]
        if top.id != self._top[0]:
            self._top = (top.id, covered)  # first seen as the top at this step count
        if top in stable and not pending and self._top_held(top, covered):
            at = self._stop_step()
            request_stop(self.run_dir, at, f"diagnosed: {top.id}")
            self.state.stop_requested_at = at

    def _watch_near(self, findings: list[Finding], covered: int) -> None:
        """A root finding one severity below the floor, not printed yet, is judged again once
        the record has grown by GROW_FACTOR: a share of the step measured over the first few
        steps can still hold a warm-up (minGPT's first optimizer step is 5x the others, so a
        per-step gc.collect() read medium at step 3 and high from step 5; the next pass was due
        at the 30 s cadence, after the job). Geometric growth keeps it to a few passes over
        any run, within the budget."""
        floor = severity_rank(self.options.min_severity)
        near = [
            f
            for f in findings
            if f.cause is None
            and severity_rank(f.severity) == floor - 1
            and f.id not in self._printed
            and not f.id.startswith(NOT_CAUSES)
        ]
        self._near = near[0].id if near else ""
        self._grow_at = max(covered + 1, math.ceil(GROW_FACTOR * covered)) if near else 0

    def _top_held(self, top: Finding, covered: int) -> bool:
        """Whether the top root finding can be the diagnosis. A generic one (at a line:
        chains.GENERIC_AT_A_LINE, or step_causes') can be superseded by a specific analyzer that needs
        more steps, so it holds only once it stayed the top while the record grew TOP_HOLD_FACTOR times;
        until then a pass is due at that size. Specific findings hold at once."""
        if top.id not in GENERIC_AT_A_LINE and top.analyzer != "step_causes":
            return True
        need = max(self._top[1] * TOP_HOLD_FACTOR, self._top[1] + 1)
        if covered >= need:
            return True
        self._hold_until = need
        return False
