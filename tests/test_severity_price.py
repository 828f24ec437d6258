"""A finding's severity follows its price (traindx.analyzers.core.severity): once the savings
model has priced every root's fix, a severity above what that fix saves comes down to it."""

import os

import pytest

import traindx
from traindx.analyzers.core import chains
from traindx.analyzers.core.findings import Finding, Prescription
from traindx.derive import ledger as L

SYNC_RUN = os.path.join(os.path.dirname(__file__), "data", "h200-gpu-pathologies", "sync")


@pytest.fixture(scope="module")
def run():
    return traindx.load_run(SYNC_RUN)


def _finding(fid, severity, gain, lost=None):
    return Finding(
        id=fid,
        title=fid,
        severity=severity,
        analyzer="test",
        seconds_lost_per_step=lost,
        prescriptions=(Prescription(kind="code", summary="a fix", expected_gain_s_per_step=gain),),
    )


def test_a_cheap_fix_is_never_high_and_a_dear_one_keeps_its_severity(run):
    step = float(L.steady_rows(run)["wall_s"].mean())
    cheap = _finding("test.cheap", "high", 0.001 * step)  # 0.1 % of the step
    dear = _finding("test.dear", "high", 0.4 * step)
    out = {f.id: f for f in chains.apply_savings([cheap, dear], run)}
    assert out["test.cheap"].severity == "low"
    note = out["test.cheap"].evidence["severity_by_price"]
    assert note["was"] == "high" and note["share_of_step"] == pytest.approx(0.001, abs=1e-4)
    assert out["test.dear"].severity == "high"
    assert "severity_by_price" not in out["test.dear"].evidence


def test_a_fix_priced_at_nothing_after_the_roots_above_it_is_low(run):
    # the first root takes the whole step: the second's gain is capped at what is left (0),
    # so its prescription loses its price and the finding its "high"
    step = float(L.steady_rows(run)["wall_s"].mean())
    whole = _finding("test.whole", "high", 2 * step, lost=2 * step)
    syncs = _finding("test.syncs", "high", 0.5 * step, lost=0.5 * step)
    out = {f.id: f for f in chains.apply_savings([whole, syncs], run)}
    assert out["test.syncs"].evidence.get("unpriced")
    assert out["test.syncs"].severity == "low"
    assert out["test.whole"].severity == "high"


def test_critical_notes_and_unpriced_fixes_are_left_alone(run):
    critical = _finding("test.critical", "critical", 0.0001)
    unknown = _finding("test.unknown", "high", None)
    out = {f.id: f for f in chains.apply_savings([critical, unknown], run)}
    assert out["test.critical"].severity == "critical"
    assert out["test.unknown"].severity == "high"
