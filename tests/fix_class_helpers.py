"""What the fix-class test modules share: the jobs, a line of a file, a planned edit's text, the findings the planner starts from."""

import ast

from traindx.analyzers.core.findings import Finding, Prescription
from traindx.fixing.plan import source as fix_source


def _line_of(path, text):
    with open(path, encoding="utf-8") as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def _edited(plan):
    """{file: the patched text} of a plan's source edits (what the scratch copy holds)."""
    out = {}
    for path in {e["file"] for e in plan.source_edits}:
        out[path] = fix_source.patched_text(path, [e for e in plan.source_edits if e["file"] == path])
        ast.parse(out[path])
    return out


def _pageable(path, line, lost, loader_pin=None):
    """gpu_idle.pageable_copy as it reads a trace: the copy's line, and (when the batch comes
    from a DataLoader) the loader's pin_memory=True edit; the non_blocking prescription is prose
    (its edit is the planner's to build from the named line)."""
    prescriptions = []
    if loader_pin:
        prescriptions.append(
            Prescription(
                kind="code",
                summary="DataLoader(..., pin_memory=True)",
                change={"code": loader_pin},
                expected_gain_s_per_step=lost,
            )
        )
    prescriptions.append(
        Prescription(kind="code", summary="copy asynchronously", expected_gain_s_per_step=lost)
    )
    return Finding(
        id="gpu_idle.pageable_copy",
        title="Host-to-device copies from pageable memory",
        severity="high",
        analyzer="gpu_idle",
        seconds_lost_per_step=lost,
        share_of_step=0.3,
        evidence={
            "rank": "0",
            "pageable_h2d_s_per_step": lost * 1.2,
            "file": path,
            "line": line,
            "source": open(path).read().splitlines()[line - 1],
        },
        prescriptions=tuple(prescriptions),
    )
