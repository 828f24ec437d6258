"""What-if across ranks: `diagnose analyze TRACE.parquet` on a published production trace (the
straggler study's "ST": its last stage is long), checked against the published S, M_S and M_W;
and synthetic 1F1B and interleaved traces (an event-driven generator of their own, bench/whatif_synth.py), one
per fault and a healthy twin, checked end to end: the replay reproduces the recorded steps, the
category is named and the healthy twin stays quiet."""

import gzip
import json
import os
import sys
import tarfile

import numpy as np
import pandas as pd
import pytest

from traindx.analyzers.ranks.whatif import category, judge
from traindx.cli.main import main
from traindx.derive import optable, whatif
from traindx.derive.optable_runs import from_run, split_ddp_backward
from traindx.derive.run import load_run
from traindx.profiler.straggler_trace import RENAMES

TESTS = os.path.dirname(os.path.abspath(__file__))
ST = os.path.join(TESTS, "data", "straggler_st")
sys.path.insert(0, os.path.join(os.path.dirname(TESTS), "bench"))
import whatif_synth  # noqa: E402


def test_published_trace_st(capsys, tmp_path):
    code = main(["analyze", os.path.join(ST, "trace-ST.parquet"), "--json", "--timelines", str(tmp_path)])
    assert code == 0
    for name in ("recorded", "ideal"):  # Perfetto: a process per DP rank, a track per stage
        with gzip.open(tmp_path / f"{name}.json.gz", "rt") as f:
            events = json.load(f)["traceEvents"]
        assert {e["tid"] for e in events if e["ph"] == "X"} == {0, 1, 2, 3}
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
    "interleaved_worker": ({"slow_worker": (1, 2, 1.6), "vpp": 2}, "one_worker"),
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


def _megatron_log(path, slow_rank):
    """A log as Megatron prints it with --timing-log-level 2 --timing-log-option all (the format
    strings of megatron/core/timers.py), 4 DP ranks, one of them slow in its compute."""
    lines = []
    for k in range(1, 7):
        lines.append(
            f" [2026-12-05 00:00:{k:02d}] iteration {k * 10:8d}/     100 | consumed samples: {k * 640:12d} |"
            " elapsed time per iteration (ms): 812.3 |"
        )
        lines.append("times across ranks (ms):")
        for timer, base in (
            ("forward-compute", 200.0),
            ("backward-compute", 400.0),
            ("all-grads-sync", 50.0),
            ("optimizer", 30.0),
        ):
            lines.append(f"  {timer}:")
            for r in range(4):
                slow = 1.5 if r == slow_rank and timer.endswith("compute") else 1.0
                lines.append(f"     rank {r:2d}: {base * slow * (1 + 0.01 * ((r + k) % 3)):.2f}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_megatron_timers(tmp_path, capsys):
    assert main(["analyze", _megatron_log(tmp_path / "slow.log", slow_rank=2), "--json"]) == 0
    head = json.loads(capsys.readouterr().out)[0]
    assert head["id"] == "whatif.one_worker" and head["evidence"]["top_workers"][0] == {"stage": 0, "dp": 2}
    assert "Drain or repair" in head["prescriptions"][0]["summary"]
    assert main(["analyze", _megatron_log(tmp_path / "even.log", slow_rank=-1), "--json"]) == 0
    assert [f["severity"] for f in json.loads(capsys.readouterr().out)] == ["info"]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whatif-runs")
    with tarfile.open(os.path.join(TESTS, "data", "cpu-whatif-slow-rank.tar.xz")) as tar:
        tar.extractall(folder, filter="data")
    return folder / "cpu-whatif-slow-rank"


def test_run_folder_slow_rank_and_twin(ddp_runs, capsys):
    assert main(["analyze", str(ddp_runs / "faulty"), "--what-if", "--json"]) == 0
    head = json.loads(capsys.readouterr().out)[0]
    assert head["id"] == "whatif.one_worker" and head["severity"] == "high"
    assert head["evidence"]["top_workers"] == [{"stage": 0, "dp": 1}]
    assert head["evidence"]["fix_top_speedup"] > 1.3  # the twin ran 2.0x faster
    assert main(["analyze", str(ddp_runs / "twin"), "--what-if", "--json"]) == 0
    twin = json.loads(capsys.readouterr().out)
    assert all(f["severity"] in ("info", "low") for f in twin)


@pytest.fixture(scope="module")
def ddp_model_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whatif-ddp-runs")
    with tarfile.open(os.path.join(TESTS, "data", "cpu-whatif-ddp-slow-rank.tar.xz")) as tar:
        tar.extractall(folder, filter="data")
    return folder / "cpu-whatif-ddp-slow-rank"


def test_ddp_slow_rank_split_at_grads_ready_predicts_the_twin(ddp_model_runs, capsys):
    """torch DDP reduces gradients inside backward: each rank's backward is split where its own
    gradients were ready (the shim's grads_ready), so fixing the slow rank predicts what the
    healthy twin measured (recorded side by side)."""
    faulty = ddp_model_runs / "faulty"
    table = from_run(load_run(str(faulty)))
    per = table.groupby(["rank", "optype"], observed=True)["duration"].median()
    # the fast rank computes less and waits more in its backward than the slow one
    assert per[(0, "backward-compute")] < per[(1, "backward-compute")]
    assert per[(0, "grads-all-reduce")] > 5 * per[(1, "grads-all-reduce")]
    assert main(["analyze", str(faulty), "--what-if", "--json"]) == 0
    head = json.loads(capsys.readouterr().out)[0]
    assert head["id"] == "whatif.one_worker" and head["evidence"]["top_workers"] == [{"stage": 0, "dp": 1}]
    assert main(["analyze", str(ddp_model_runs / "twin"), "--what-if", "--json"]) == 0
    twin = json.loads(capsys.readouterr().out)
    assert all(f["severity"] in ("info", "low") for f in twin)
    measured = (
        head["evidence"]["step_time_recorded_median_s"] / twin[0]["evidence"]["step_time_recorded_median_s"]
    )
    assert head["evidence"]["fix_top_speedup"] == pytest.approx(measured, rel=0.25)


def test_ddp_backward_split_without_grads_ready_is_estimated():
    """A run recorded before grads_ready: the backward is split by the estimate (the rank that
    reached backward last sets the backward-per-forward ratio); with it, at grads_ready."""
    rows = []
    for step in range(2):
        for rank, (fwd, bwd_start, ready) in enumerate(((0.02, 0.02, 0.06), (0.04, 0.04, 0.12))):
            base = step * 1.0
            rows.append((rank, step, "forward-compute", base, fwd, np.nan))
            rows.append(
                (rank, step, "backward-grads-all-reduce", base + bwd_start, 0.13 - bwd_start, base + ready)
            )
    table = pd.DataFrame(rows, columns=["rank", "step", "optype", "start", "duration", "ready"])
    measured = split_ddp_backward(table)
    comp = measured[measured["optype"] == "backward-compute"].groupby("rank")["duration"].median()
    assert comp.to_numpy() == pytest.approx([0.04, 0.08])
    estimated = split_ddp_backward(table.assign(ready=np.nan))
    comp = estimated[estimated["optype"] == "backward-compute"].groupby("rank")["duration"].median()
    assert comp.to_numpy() == pytest.approx([0.045, 0.09])  # rank 1 came last: 0.09 / 0.04 of forward
    ar = estimated[estimated["optype"] == "grads-all-reduce"]
    assert (ar["start"] + ar["duration"]).round(9).nunique() == 2  # one end per step, every rank
