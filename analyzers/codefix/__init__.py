"""Code prescriptions that are real code: a `before` that is the job's own source (one line, or a
call written over several lines, or a part of them) and an `after` that parses, at a file:line.

Every analyzer that prescribes a code change builds its `change["code"]` through `code_change`;
what fails the check is not a diff and goes into the prescription's prose instead. `apply` and
`unified_diff` turn a change into the edited file and the patch a user applies (`patch -p0`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

# the pieces live in codefix_edit, codefix_source and codefix_device; analyzers read them here
from traindx.analyzers.codefix.device import (
    HOST_READ_METHODS,
    async_copy_edits,
    device_accumulations,
    device_checks,
)
from traindx.analyzers.codefix.edit import (
    apply,
    code_change,
    keyword_sources,
    parses,
    set_keywords,
    unified_diff,
)
from traindx.analyzers.codefix.source import (
    LOOP_NODES,
    before_training_loop,
    calls_in_loops,
    calls_of,
    imports_torch,
    innermost_node,
    is_call_of,
    source_tree,
)
from traindx.analyzers.core.findings import Finding, NoChange, Prescription, SourceEdit

# the names read here by other modules (some defined in the modules imported above)
__all__ = [
    "HOST_READ_METHODS",
    "LOOP_NODES",
    "is_call_of",
    "imports_torch",
    "innermost_node",
    "source_tree",
    "apply",
    "async_copy_edits",
    "before_training_loop",
    "calls_in_loops",
    "calls_of",
    "checked",
    "code_change",
    "device_accumulations",
    "device_checks",
    "keyword_sources",
    "parses",
    "set_keywords",
    "unified_diff",
]


def _applicable(code: Mapping[str, Any]) -> bool:
    """The code edit passes code_change's check (an edit that cannot be checked does not)."""
    try:
        valid = code_change(
            code.get("file"),
            code.get("line"),
            code.get("before"),
            code.get("after"),
            last_line=code.get("last_line"),
            op=code.get("op"),
        )
    except Exception:  # an edit that cannot be checked is not applied: prose only
        return False
    return valid is not None


def _prose_only(p: Prescription, code: Mapping[str, Any]) -> Prescription:
    """The prescription without its code edit (the edits made with it stay), what the edit said
    kept in its prose."""
    codes = p.change.codes if isinstance(p.change, SourceEdit) else None
    change = NoChange() if codes is None else SourceEdit(code=None, codes=codes)
    after = str(code.get("after") or "").strip()
    summary = p.summary if not after or after in p.summary else f"{p.summary} ({after})"
    return replace(p, change=change, summary=summary, automatic=p.automatic and bool(change))


def checked(findings: Sequence[Finding]) -> list[Finding]:
    """The findings with every code prescription checked: a `change["code"]` that is not a real,
    applicable edit (no file:line, prose in `before`, an `after` that does not parse) is taken
    out of the change, and what it said stays in the prescription's prose."""
    out = []
    for finding in findings:
        prescriptions, changed = [], False
        for p in finding.prescriptions:
            code = p.change.code if isinstance(p.change, SourceEdit) else None
            # (an autotune-key edit is located and checked by the fix loop itself, at the
            # kernel's decorator: fixing/plan/source.py)
            if code is None or code.get("autotune_key") or _applicable(code):
                prescriptions.append(p)
                continue
            prescriptions.append(_prose_only(p, code))
            changed = True
        out.append(replace(finding, prescriptions=tuple(prescriptions)) if changed else finding)
    return out
