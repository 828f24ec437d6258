"""`diagnose analyze PYSPY_FILE`: the JIT compiles found in a py-spy recording on its own (a
speedscope .json or a raw collapsed file), with no run folder around it."""

from __future__ import annotations

import os

from traindx.analyzers.core.findings import Finding, rank_findings
from traindx.analyzers.jit.jit import analyze_recording
from traindx.common.errors import UserError
from traindx.profiler import speedscope


def analyze_file(path: str, rate_hz: float) -> list[Finding]:
    """The ranked findings of the recording; `rate_hz`: samples per second of a raw file,
    which counts samples instead of seconds."""
    if os.path.getsize(path) == 0:
        raise UserError(f"{path} is empty: not a py-spy recording")
    # a file the user names may be a link of theirs (a run folder's own never is)
    recording = speedscope.load(os.path.realpath(path))
    if not recording or not any(s.stacks for s in recording.values()):
        raise UserError(f"{path} holds no py-spy samples")
    with open(path, encoding="utf-8", errors="replace") as f:
        is_raw = not f.read(4096).lstrip().startswith("{")
    if is_raw:  # collapsed stacks count samples: seconds = samples / rate
        for samples in recording.values():
            samples.weights = [w / rate_hz for w in samples.weights]
    return rank_findings(analyze_recording(recording, source=f"py-spy file {os.path.basename(path)}"))
