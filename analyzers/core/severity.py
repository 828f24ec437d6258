"""A finding's severity follows its price: once chains.apply_savings has priced every root's fix,
a severity above what that price is worth comes down to it (never below "low").

Analyzers set severities from their own measure, independently of what their fix saves; a fix
priced at a few milliseconds of a long step is not a high-severity problem. Applied only where
the share is under PRICED_AT_NOTHING: nearer the thresholds a share moves with the machine's
load, and a severity must not. Critical findings, notes, unpriced fixes (unknown is not nothing)
and prices that depend on the passing load are left alone."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from traindx.analyzers.core.evidence import severity_for_share
from traindx.analyzers.core.findings import NOTE, severity_index
from traindx.derive import ledger as ledger_mod

if TYPE_CHECKING:  # annotations only
    from traindx.analyzers.core.findings import Finding
    from traindx.derive.run import RunRecord

FLOOR = "low"  # a prescribed fix, however cheap, is more than a note
PRICED_AT_NOTHING = 0.02  # a fix that saves under 2 % of the step is priced at nothing


def bounded_by_price(findings: list[Finding], run: RunRecord | None) -> list[Finding]:
    """Findings whose severity exceeds their price's brought down to it (see the module's
    docstring); evidence["severity_by_price"] says what it was and why."""
    if run is None or not len(run.ledger):
        return findings
    steady = ledger_mod.steady_rows(run)
    if not len(steady):
        return findings
    step_s = {str(r): float(v) for r, v in steady.groupby("rank")["wall_s"].mean().items()}
    return [_bounded(f, step_s) for f in findings]


def _bounded(f: Finding, step_s: dict[str, float]) -> Finding:
    if f.cause is not None or f.severity in (NOTE, "critical") or not f.prescriptions:
        return f
    if isinstance(f.removes, dict) and f.removes.get("workers"):
        # priced by the workers model on the cores the machine's other work left free at the
        # time (savings_workers.py): a load that comes and goes, so not what the problem is worth
        return f
    gains = [p.expected_gain_s_per_step for p in f.prescriptions if p.expected_gain_s_per_step is not None]
    ranks = [str(r) for r in f.ranks if str(r) in step_s] or list(step_s)
    step = max(step_s[r] for r in ranks)
    if gains and step > 0:
        gain = max(0.0, max(gains))
    elif f.evidence.get("unpriced") and "capped_by_roots_above_s" in f.evidence:
        # the roots ranked above already claim the time it loses: it saves nothing more. A fix
        # the model priced at or below zero on its own (more workers on cores the machine's
        # load fills: that load comes and goes) is unknown, not nothing, and left alone.
        gain = 0.0
    else:
        return f
    share = gain / step if step > 0 else 0.0
    if share >= PRICED_AT_NOTHING:
        # between "nothing" and the whole step the analyzer's own measure stands: a bound by the
        # price's share would move a finding across severities with the machine's load (a GIL
        # finding priced at 12 % of a quiet step and 20 % of a loaded one)
        return f
    bound = max(severity_for_share(share), FLOOR, key=severity_index)
    if severity_index(f.severity) <= severity_index(bound):
        return f
    note = {"was": f.severity, "expected_gain_s_per_step": round(gain, 6), "share_of_step": round(share, 4)}
    return replace(f, severity=bound, evidence={**f.evidence, "severity_by_price": note})
