"""What the live judgement (analyzers/live/live.py) shows and asks: its options and state, the
control files it writes for the job (stop, capture), whether a run is still live, and the
ledger line shown beside the step count."""

from __future__ import annotations

import errno
import glob
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from traindx.analyzers.core.findings import SEVERITIES, Finding
from traindx.common import untrusted
from traindx.common.atomic import write_json
from traindx.derive.ledger import CATEGORIES, LABELS

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

STOP_FILE = os.path.join("control", "stop.json")
CAPTURE_FILE = os.path.join("control", "capture.json")
# the per-step events a pass reads: each process's last WINDOW_STEPS steps (traindx.derive.so_far: a
# rolling window, 1.25x at most; enough for a period of tens of steps to repeat)
WINDOW_STEPS = 200
Routes = tuple[str, ...] | None  # the analyzers a pass runs (None: every one)


@dataclass(frozen=True)
class LiveOptions:
    cpu_share: float = 0.02  # live CPU (both stages) <= this share of one core
    poll_s: float = 0.1  # how often the events are tailed for new step ends
    min_severity: str = "high"  # findings printed while the job runs
    until_diagnosed: bool = False  # stop the job once the top finding is stable
    report_every: int = 3  # rewrite report.html every N analyses (0: never), budget
    # permitting; also after an analysis that showed a finding
    window_steps: int = WINDOW_STEPS  # a pass judges each process's last N steps (0: all):
    # a days-long run's live memory and pass cost bounded


@dataclass
class LiveState:
    """What the live view shows: the newest analysis and the tail of the events."""

    step: int = 0  # steps finished (the furthest rank)
    last_step_s: float | None = None
    median_step_s: float | None = None
    compiles: int = 0
    ledger_line: str | None = None
    top: Finding | None = None  # the current top root finding, if any
    analyses: int = 0
    analysis_cpu_s: float = 0.0  # full stage (the report rewrites included)
    cheap_cpu_s: float = 0.0  # cheap stage (tailing, signals)
    report_cpu_s: float = 0.0  # of analysis_cpu_s: report.html rewrites
    polls: int = 0
    import_cpu_s: float = 0.0  # one-time imports (the final analysis's too)
    elapsed_s: float = 0.0
    stop_requested_at: int | None = None  # the step the job was asked to stop at
    stable: list[str] = field(default_factory=list)  # ids of the findings printed so far
    # deep captures asked for: kind, why, when
    captures: list[dict[str, Any]] = field(default_factory=list)
    passes: list[dict[str, Any]] = field(default_factory=list)  # each analysis: trigger, step, cpu_s
    running: bool = True


def severity_rank(severity: str) -> int:
    """Higher is more severe; unknown severities rank lowest."""
    return SEVERITIES.index(severity) if severity in SEVERITIES else -1


def at_least(severity: str, floor: str) -> bool:
    return severity_rank(severity) >= severity_rank(floor)


def write_control(path: str, data: dict[str, Any]) -> None:
    folder = os.path.dirname(path)
    if os.path.islink(folder):  # the run folder replaced by a link while the job ran
        raise OSError(errno.ELOOP, f"{folder} is a symbolic link now: not written through")
    os.makedirs(folder, exist_ok=True)
    write_json(path, data, indent=2, default=str)  # no temp file left on a full disk; the old file stands


def request_stop(run_dir: str, at_step: int, reason: str) -> None:
    """Ask every rank of the job to stop cleanly once it has finished `at_step` steps."""
    write_control(
        os.path.join(run_dir, STOP_FILE), {"steps": int(at_step), "reason": reason, "t_ns": time.time_ns()}
    )


def request_capture(run_dir: str, kind: str, reason: str) -> None:
    """Ask the shim for a torch.profiler window on the next step (once per kind, within the
    window's budget: the shim decides)."""
    write_control(
        os.path.join(run_dir, CAPTURE_FILE), {"kind": kind, "reason": reason, "t_ns": time.time_ns()}
    )


def run_is_live(run_dir: str) -> bool:
    """The manifest (or any node part's) says running; a folder without one is starting."""
    paths = [os.path.join(run_dir, "manifest.json")]
    paths += glob.glob(os.path.join(run_dir, "nodes", "*", "manifest.json"))
    seen = False
    for p in paths:
        try:  # a run folder's file: no link, FIFO or device (untrusted)
            status = untrusted.load_json(p).get("status")
        except (OSError, ValueError, AttributeError):
            continue
        seen = True
        if status == "running":
            return True
    return not seen


def ledger_line(run: RunRecord) -> str | None:
    """The steady steps' mean ledger, its three largest lines ("data 61% · fwd/bwd 30% ...")."""
    try:
        ledger = run.ledger
        if not len(ledger):
            return None
        steady = ledger[ledger["step"] > ledger["step"].min()] if ledger["step"].nunique() > 2 else ledger
        wall = float(steady["wall_s"].sum())
        if wall <= 0:
            return None
        parts = []
        for c in [*CATEGORIES, "unexplained"]:
            col = f"{c}_s"
            if col in steady:
                parts.append((float(steady[col].sum()) / wall, LABELS.get(c, c)))
        parts.sort(reverse=True)
        return " · ".join(f"{label} {share:.0%}" for share, label in parts[:3] if share >= 0.01)
    except Exception:
        return None
