"""Findings as the report shows them: prescriptions as copyable commands or diffs, evidence as
render-ready items, the verdict finding as the headline, a --fix comparison side by side."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from traindx.report.compiles import compile_groups
from traindx.report.text import clip, frame_label, ranges

if TYPE_CHECKING:
    from traindx.analyzers.core.findings import Finding, Prescription
    from traindx.judgement import FixPlan

MAX_EVIDENCE_ROWS = 25

FINDING_COMPILE_ROWS = 5  # a finding shows its first compiles; the rest are summed up per kernel


def prescription_text(p: Prescription) -> tuple[str | None, str | None]:
    """A copyable command or diff for a prescription, from its `change` when it has no command."""
    if p.command:
        return p.command, "command"
    change = p.change or {}
    lines: list[str] = []
    kind = "command"
    if "env" in change:
        lines += [f"export {k}={shlex.quote(str(v))}" for k, v in change["env"].items()]
    if "arg" in change:
        arg = change["arg"] or {}
        flags = " ".join(
            f"{k} {shlex.quote(str(v))}" if v not in (None, "", True) else k
            for k, v in (arg.get("set") or {}).items()
        )
        lines.append(f"# {arg.get('framework', 'job')} arguments: {flags}")
    if "upgrade" in change:
        up = change["upgrade"] or {}
        spec = f"{up.get('package')}>={up['min_version']}" if up.get("min_version") else up.get("package")
        lines.append(f"pip install -U {shlex.quote(str(spec))}")
    if "precompile" in change:
        pre = change["precompile"] or {}
        lines.append(f"kernel-cache warm --from-run {shlex.quote(str(pre.get('from_run', '<run>')))}")
    if "code" in change:
        code = change["code"] or {}
        kind = "diff"
        lines.append(f"--- {code.get('file', '?')}:{code.get('line', '?')}")
        lines.append(f"+++ {code.get('file', '?')}:{code.get('line', '?')}")
        lines += [f"-{l}" for l in str(code.get("before", "")).splitlines()]
        lines += [f"+{l}" for l in str(code.get("after", "")).splitlines()]
    return ("\n".join(lines), kind) if lines else (None, None)


def _evidence_items(evidence: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """A finding's evidence dict as render-ready items: text, key/value, table or preformatted.
    Empty values are left out; lists of numbers are shown inline."""
    items: list[dict[str, Any]] = []
    for key, value in (evidence or {}).items():
        label = str(key).replace("_", " ")
        if value is None or value == "" or value == [] or value == {}:
            continue
        if isinstance(value, list) and all(isinstance(v, dict) for v in value):
            columns = list(dict.fromkeys(k for v in value[:MAX_EVIDENCE_ROWS] for k in v))[:8]
            rows = [[_cell(v.get(c)) for c in columns] for v in value[:MAX_EVIDENCE_ROWS]]
            items.append(
                {
                    "label": label,
                    "type": "table",
                    "columns": [c.replace("_", " ") for c in columns],
                    "rows": rows,
                    "more": max(0, len(value) - MAX_EVIDENCE_ROWS),
                }
            )
        elif isinstance(value, (list, tuple)) and all(not isinstance(v, (dict, list)) for v in value):
            shown = ", ".join(_cell(v) for v in value[:MAX_EVIDENCE_ROWS])
            more = f" … ({len(value)} values)" if len(value) > MAX_EVIDENCE_ROWS else ""
            items.append({"label": label, "type": "text", "text": clip(shown + more, 2000)})
        elif isinstance(value, dict) and ("file" in value or "filename" in value) and "line" in value:
            items.append({"label": label, "type": "text", "text": frame_label(value)})
        elif isinstance(value, dict) and all(not isinstance(v, (dict, list)) for v in value.values()):
            items.append(
                {
                    "label": label,
                    "type": "kv",
                    "pairs": [[clip(k, 200), _cell(v)] for k, v in list(value.items())[:40]],
                }
            )
        elif isinstance(value, (dict, list)):
            items.append(
                {"label": label, "type": "pre", "text": clip(json.dumps(value, indent=1, default=str), 4000)}
            )
        elif isinstance(value, str) and ("\n" in value or len(value) > 160):
            items.append({"label": label, "type": "pre", "text": clip(value, 4000)})
        else:
            items.append({"label": label, "type": "text", "text": _cell(value)})
    return items


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict) and ("file" in value or "filename" in value):
        return frame_label(value)
    if isinstance(value, (dict, list)):
        return clip(json.dumps(value, default=str), 400)
    return clip("" if value is None else value, 400)


def finding_view(
    f: Finding, compiles: Sequence[Mapping[str, Any]], plan: FixPlan | None = None
) -> dict[str, Any]:
    """A finding as the report shows it; plan: what --fix would do with it (the judgement's)."""
    marks = plan.marks if plan is not None else ()
    prescriptions: list[dict[str, Any]] = []
    for i, p in enumerate(f.prescriptions):
        text, kind = prescription_text(p)
        prescriptions.append(
            {
                "kind": p.kind,
                "summary": clip(p.summary, 600),
                "text": text and clip(text, 4000),
                "text_kind": kind,
                "expected_gain_s": p.expected_gain_s_per_step,
                "automatic": p.automatic,
                "fix": marks[i] if i < len(marks) else None,
                "planned": False,
            }
        )
    # built by --fix's planner from this finding (the job's own flag, a derived edit)
    prescriptions.extend(
        {
            "kind": c.mechanism,
            "summary": clip(c.summary, 600),
            "text": None,
            "text_kind": None,
            "expected_gain_s": None,
            "automatic": True,
            "fix": c.fix,
            "planned": True,
        }
        for c in (plan.planned if plan is not None else ())
    )
    related = []
    if f.analyzer in ("jit", "compile", "autotune", "dynamo") or "compile" in f.id:
        kernels = set()
        for key in ("kernel", "kernels"):
            v = (f.evidence or {}).get(key)
            if isinstance(v, str):
                kernels.add(v)
            elif isinstance(v, list):
                kernels |= {str(k) for k in v}
        related = [
            c
            for c in compiles
            if not kernels or c["kernel"] in kernels or any(k in c["kernel"] for k in kernels)
        ]
        steps = set(f.steps_affected)
        if steps and not kernels:
            related = [c for c in related if c["step"] in steps] or related
    return {
        "id": clip(f.id, 200),
        "anchor": re.sub(r"[^a-zA-Z0-9_-]", "-", f.id),
        "title": clip(f.title, 300),
        "severity": f.severity,
        "analyzer": clip(f.analyzer, 100),
        "summary": clip(f.summary, 3000),
        "seconds_lost_per_step": f.seconds_lost_per_step,
        "share_of_step": f.share_of_step,
        "steps_affected": ranges(f.steps_affected),
        "n_steps_affected": len(f.steps_affected),
        "ranks": [str(r) for r in f.ranks],
        "prescriptions": prescriptions,
        "evidence": _evidence_items(f.evidence),
        "compiles": related[:FINDING_COMPILE_ROWS],
        "compiles_more": max(0, len(related) - FINDING_COMPILE_ROWS),
        "compile_groups": compile_groups(related) if len(related) > FINDING_COMPILE_ROWS else [],
        "shows_gil": f.analyzer in ("gil", "jit") or "gil" in f.id,
        "cause": getattr(f, "cause", None),
        "cause_anchor": re.sub(r"[^a-zA-Z0-9_-]", "-", f.cause) if f.cause else None,
        "symptoms": list(getattr(f, "symptoms", ()) or ()),
    }


def verdict_view(v: Finding, findings_view: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The headline, rendered from the judgement's verdict finding (analyzers/verdict.py): the
    report never decides the verdict itself."""
    ev = v.evidence or {}
    out = {
        "id": v.id,
        "kind": "healthy",
        "headline": clip(v.title, 600),
        "summary": clip(v.summary, 1000),
        "finding_title": None,
        "finding_anchor": None,
        "severity": "info",
        "gain_s": None,
        "speedup": None,
        "median_step_s": ev.get("median_step_s"),
        "after_step_s": None,
        "text": None,
        "text_kind": None,
        "automatic": False,
        "share_of_step": None,
        "steps": ev.get("steps"),
        "exit_code": ev.get("exit_code"),
        "fix": None,
        "lost_s": None,
        "saving_limit": None,
        "step_statistic": "median",
    }
    if v.id in ("verdict.no_steps", "verdict.no_shim"):
        out.update(kind="nosteps", median_step_s=None, noshim=v.id == "verdict.no_shim")
    elif v.id in ("verdict.inefficient", "verdict.unreadable_files"):
        out.update(kind="inefficient")
    elif v.id == "verdict.cause":
        top = next((f for f in findings_view if f["id"] == ev.get("top")), None)
        p = (
            top["prescriptions"][ev["prescription"]]
            if top and ev.get("prescription") is not None and top["prescriptions"]
            else None
        )
        out.update(
            kind="change" if p else "problem",
            finding_title=clip(ev.get("top_title") or "", 300),
            finding_anchor=top["anchor"] if top else None,
            severity=ev.get("top_severity") or "medium",
            gain_s=ev.get("gain_s"),
            speedup=ev.get("speedup"),
            median_step_s=ev.get("step_s"),
            step_statistic=ev.get("step_statistic") or "mean",
            after_step_s=ev.get("after_step_s"),
            share_of_step=v.share_of_step,
            lost_s=ev.get("seconds_per_step"),
            saving_limit=ev.get("saving_limit"),
        )
        if p:
            out.update(text=p["text"], text_kind=p["text_kind"], automatic=p["automatic"], fix=p.get("fix"))
    return out


def comparison_view(comparison: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Any mapping the --fix loop passes: arms side by side, other keys as facts. Generic on
    purpose: whatever keys are present are shown."""
    if not comparison:
        return None
    comparison = dict(comparison)
    arms: Any = comparison.pop("arms", None)
    if (
        arms is None
        and isinstance(comparison.get("baseline"), dict)
        and isinstance(comparison.get("candidate"), dict)
    ):
        arms = {"baseline": comparison.pop("baseline"), "candidate": comparison.pop("candidate")}
    if isinstance(arms, list):
        arms = {str(a.get("name", f"arm {i}")): a for i, a in enumerate(arms) if isinstance(a, dict)}
    arm_names = list(arms or {})
    rows: list[dict[str, Any]] = []
    if arms:
        keys = list(dict.fromkeys(k for a in arms.values() for k in a if k != "name"))
        rows = [
            {"label": str(k).replace("_", " "), "values": [_fmt_value(arms[n].get(k)) for n in arm_names]}
            for k in keys
        ]
    headline = comparison.pop("verdict", None)
    facts: list[dict[str, Any]] = []
    for k, v in comparison.items():
        if isinstance(v, dict):
            facts.append(
                {
                    "label": str(k).replace("_", " "),
                    "pairs": [[str(kk).replace("_", " "), _fmt_value(vv)] for kk, vv in v.items()],
                }
            )
        else:
            facts.append({"label": str(k).replace("_", " "), "value": _fmt_value(v)})
    return {
        "arms": [clip(n, 100) for n in arm_names],
        "rows": rows,
        "facts": facts,
        "verdict": clip(headline, 500) if headline is not None else None,
    }


def _fmt_value(v: object) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v):
        return f"[{v[0]:.4g}, {v[1]:.4g}]"
    if isinstance(v, (dict, list)):
        return clip(json.dumps(v, default=str), 400)
    return clip("" if v is None else v, 400)
