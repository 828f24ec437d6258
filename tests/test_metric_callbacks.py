"""A metric over the whole training set computed in a framework callback (Lightning's
`on_train_batch_end`, an HF TrainerCallback's `on_step_end`) is evaluation work: named at the
job's callback line (the frame the framework called, never site-packages), with its period and
its price each time, forwards and the host metric after them together; the twins that score once
an epoch / at the end stay quiet. Judged on runs recorded once (tests/data/cpu-metric-callbacks.README);
one real run of the Lightning job checks the record side (the shim's hook frame) today."""

import os

import pytest
from analyzer_helpers import _line_of, _one, _record
from helpers import PY, ROOT, recorded_runs_here

import traindx
from traindx.analyzers import analyze
from traindx.analyzers.core.findings import severity_index

JOBS = os.path.join(ROOT, "tests", "jobs")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    folder = recorded_runs_here(
        "cpu-metric-callbacks", tmp_path_factory.mktemp("metric-cb"), "/work/wt-evalcb"
    )
    return lambda name: analyze(traindx.load_run(str(folder / name)))


def _callback_line(job):
    return _line_of(os.path.join(JOBS, job), "acc, auc = self.score(")


def _assert_named_at_the_callback(findings, job, period):
    ev = _one(findings, "evaluation.in_loop")
    assert os.path.basename(ev.evidence["file"]) == job
    assert ev.evidence["line"] == _callback_line(job)  # the callback's line, not its forward's
    assert ev.evidence["forward_at"]["line"] == _line_of(os.path.join(JOBS, job), "with torch.no_grad():") + 1
    assert ev.evidence["period"] == period
    # its price each time is the slow steps' excess (the forwards and the metric's Python loop),
    # not its forwards' alone
    slow = _one(findings, "steps.periodic_slow")
    excess = slow.evidence["median_slow_s"] - slow.evidence["median_other_s"]
    assert ev.evidence["mean_s_each"] >= 0.6 * excess
    assert ev.evidence["mean_s_each"] >= ev.evidence["forward_s_each"]
    # one root: its slow steps and the host time they add sit under it
    assert slow.cause == ev.id
    assert all(f.cause == ev.id for f in findings if f.id.startswith("host_work."))


@pytest.mark.parametrize(
    "run, job, period",
    [("lightning-every5", "fw_lightning_metric_cb.py", 5), ("hf-every5", "fw_hf_metric_cb.py", 5)],
)
def test_a_whole_set_metric_in_a_callback_is_evaluation_at_its_line(recorded, run, job, period):
    _assert_named_at_the_callback(recorded(run), job, period)


@pytest.mark.parametrize("run", ["lightning-epoch", "hf-end"])
def test_the_twins_that_score_once_stay_quiet(recorded, run):
    findings = recorded(run)
    loud = [(f.id, f.severity) for f in findings if severity_index(f.severity) > severity_index("low")]
    assert not loud
    assert not [f for f in findings if f.id == "evaluation.in_loop" and f.severity != "info"]


@pytest.mark.slow
def test_the_lightning_callback_recorded_today_is_named_at_its_line(tmp_path_factory):
    run = _record(
        tmp_path_factory,
        "lightning-metric-cb",
        ["--no-pyspy"],
        [PY, os.path.join(JOBS, "fw_lightning_metric_cb.py"), "--max-steps", "40", "--every", "5"],
    )
    _assert_named_at_the_callback(analyze(run), "fw_lightning_metric_cb.py", 5)
