"""A job stopped by a signal (SIGSTOP, SIGTSTP: state T) for a while: its processes ran nothing,
so the pause is no cause in its code. The launcher saw each stop in /proc (manifest "stopped");
the steps it overlaps are left out of every steady measure (derive/steady.perturbed_steps), and
this note says how long the job was stopped, so that a slow step is not read as the job's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding
from traindx.derive.steady import stopped_intervals, stopped_steps
from traindx.profiler.proctree import StopWatch

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

DECLARATION = Declaration(
    name="stopped", order=150, ids=("process.stopped",), not_causes=("process.stopped",)
)


def _seconds(ns: int) -> str:
    s = ns / 1e9
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


def analyze(run: RunRecord) -> list[Finding]:
    stops = stopped_intervals(run)
    if not stops:
        return []
    # one stop of several processes at once (a process group stopped) is one pause of the job
    merged: list[list[int]] = []
    for _, start, end in sorted(stops, key=lambda s: s[1]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    # the launcher's polls saw each stop from inside: one poll interval shorter on average
    seconds = [s.get("seconds") for s in run.manifest.get("stopped") or [] if isinstance(s, dict)]
    poll_ns = StopWatch.POLL_S * 1e9
    total = int(sum(end - start + poll_ns for start, end in merged))
    if len(merged) == 1 and len(seconds) == 1 and isinstance(seconds[0], (int, float)):
        total = int(seconds[0] * 1e9)
    times = f" {len(merged)} times," if len(merged) > 1 else ""
    title = f"The job was stopped (SIGSTOP) for{times} {_seconds(total)}" + (" in all" if times else "")
    steps = stopped_steps(run)
    return [
        Finding(
            id="process.stopped",
            title=title,
            severity="info",
            analyzer="stopped",
            summary=(
                "A signal stopped the job's processes (state T in /proc: SIGSTOP or SIGTSTP, sent "
                "by a person, a scheduler or a debugger): they ran nothing meanwhile. The steps the "
                "stop overlaps are left out of the steady measures; their time is no cause in the "
                "job's code."
            ),
            steps_affected=tuple(sorted({s for ss in steps.values() for s in ss})),
            ranks=tuple(sorted(steps)),
            evidence={
                "stops": [{"pid": pid, "start_ns": a, "end_ns": b} for pid, a, b in stops],
                "seconds": total / 1e9,
            },
        )
    ]
