"""What-if across ranks: `diagnose analyze TRACE.parquet` on a published production trace (the
straggler study's "ST": its last stage is long), checked against the published S, M_S and M_W;
and synthetic 1F1B traces (an event-driven generator of their own, bench/whatif_synth.py), one
per fault and a healthy twin, checked end to end: the replay reproduces the recorded steps, the
category is named and the healthy twin stays quiet."""

import json
import os
import sys

import pytest

from traindx.analyzers.whatif import category, judge
from traindx.cli.main import main
from traindx.derive import optable, whatif
from traindx.profiler.straggler_trace import RENAMES

TESTS = os.path.dirname(os.path.abspath(__file__))
ST = os.path.join(TESTS, "data", "straggler_st")
sys.path.insert(0, os.path.join(os.path.dirname(TESTS), "bench"))
import whatif_synth  # noqa: E402


def test_published_trace_st(capsys):
    code = main(["analyze", os.path.join(ST, "trace-ST.parquet"), "--json"])
    assert code == 0
    findings = json.loads(capsys.readouterr().out)
    head = findings[0]
    assert head["id"] == "whatif.stage" and "last stage" in head["title"]
    ev = head["evidence"]
    with open(os.path.join(ST, "ms-ST.json")) as f:
        ms = json.load(f)
    with open(os.path.join(ST, "mw-ST.json")) as f:
        mw = json.load(f)
    assert ev["S"] == pytest.approx(ms["tori"] / ms["tideal"], rel=0.05)
    assert ev["M_S"] == pytest.approx(ms["Ms"], rel=0.05)
    assert ev["M_W"] == pytest.approx(mw["Mw"], abs=0.05)
    assert ev["step_time_ideal_s"] == pytest.approx(ms["tideal"], rel=0.05)
    assert "--decoder-last-pipeline-num-layers" in head["prescriptions"][0]["summary"]


def test_not_a_trace(tmp_path, capsys):
    bad = tmp_path / "trace-x.parquet"
    bad.write_bytes(b"not parquet")
    assert main(["analyze", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diagnose: error:")


CASES = {
    "healthy": ({}, "healthy"),
    "worker": ({"slow_worker": (1, 2, 1.6)}, "one_worker"),
    "last_stage": ({"slow_stage": (3, 1.5)}, "stage"),
    "sequence": ({"seq_cv": 0.4}, "sequence_lengths"),
    "optype": ({"slow_optype": ("grads-reduce-scatter", 0.2, 20.0)}, "optype"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_synthetic_fault(name):
    kwargs, expected = CASES[name]
    raw = whatif_synth.make(dp=4, pp=4, mb=4, steps=4, seed=3, **kwargs)
    result = whatif.analyze(optable.normalize(raw.rename(columns=RENAMES)))
    recorded = sum(result.recorded) / len(result.recorded)
    assert recorded == pytest.approx(result.t_replayed, rel=0.02)  # the replay reproduces the steps
    findings = judge(result, source=name)
    if expected == "healthy":
        assert [f.severity for f in findings] == ["info"]
        return
    assert category(result)[0] == expected
    assert findings[0].id == f"whatif.{expected}" and findings[0].severity in ("low", "medium", "high")
    assert result.slowdown > 1.05 and findings[0].prescriptions
    if expected == "one_worker":
        assert result.top_workers[0] == (1, 2)
