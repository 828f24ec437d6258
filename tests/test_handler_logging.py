"""Gradient histograms logged every iteration from a framework handler: the logging library's
writer thread holds the GIL (tensorboardX's pure-Python CRC in site-packages), but it does the
work the job's handler line hands it, so the headline is that line with its price and the GIL
hold its symptom; the twin that logs every 100 steps stays quiet. Judged on runs recorded once
(tests/data/cpu-grad-histograms.README)."""

import os

import pytest
from analyzer_helpers import _line_of
from helpers import ROOT, recorded_runs_here

import traindx
from traindx.analyzers import analyze
from traindx.analyzers.core.findings import severity_index

JOB = os.path.join(ROOT, "tests", "jobs", "fw_lightning_grad_hist.py")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    folder = recorded_runs_here("cpu-grad-histograms", tmp_path_factory.mktemp("hist"), "/work/wt-evalcb")
    return lambda name: analyze(traindx.load_run(str(folder / name)))


def test_the_handler_line_is_the_headline_and_the_writer_thread_its_symptom(recorded):
    findings = recorded("hist-every1")
    roots = sorted(
        (f for f in findings if f.cause is None and f.seconds_lost_per_step),
        key=lambda f: -f.seconds_lost_per_step,
    )
    top = roots[0]
    assert top.id == "host_work.code"
    assert top.evidence["file"] == JOB and top.evidence["line"] == _line_of(JOB, "self.writer.add_histogram(")
    assert severity_index(top.severity) >= severity_index("medium")
    gil = [f for f in findings if f.id == "gil.contention"]
    assert gil and all(f.cause == "host_work.code" for f in gil)
    assert "site-packages" not in top.title


def test_the_twin_logging_every_100_steps_is_quiet(recorded):
    findings = recorded("hist-every100")
    assert not [(f.id, f.severity) for f in findings if severity_index(f.severity) > severity_index("low")]
