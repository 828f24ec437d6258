"""Switches that tax every op: a tiny transformer with autograd anomaly detection left on (a real
job under diagnose) is named at the line that turned it on, with the edit that turns it off and
the shim's runtime patch; its evaluation without torch.no_grad() at the model's call; the healthy
twin is quiet; the runtime patch really turns anomaly mode off."""

from __future__ import annotations

import json
import os

import pytest
from helpers import PY, ROOT, diagnose_side_by_side, only_run_dir

import traindx
from traindx.analyzers.core.findings import is_problem
from traindx.fixing.plan.planner import candidate_plans

pytestmark = pytest.mark.slow  # three real jobs side by side (~25 s on two loaded cores)

JOB = os.path.join(ROOT, "tests", "jobs", "anomaly_train.py")
STEPS = "12"


def _line_of(text: str) -> int:
    with open(JOB) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("switches")
    # the third arm is what a --fix candidate runs: the shim's patch turns anomaly mode off
    patched = ["env", "TRAINDX_RUNTIME_PATCHES=switch_off:anomaly,switch_off:eval_grad"]
    # the anomaly arm also evaluates every 5th step without torch.no_grad()
    slowed = ["--anomaly", "--eval-every", "5"]
    arms = {"anomaly": ([], slowed), "healthy": ([], []), "patched": (patched, slowed)}
    outs = {name: str(base / name) for name in arms}
    procs = diagnose_side_by_side(
        [
            ["--quiet", "--steps", STEPS, "--out", outs[name], "--", *pre, PY, JOB, "--steps", "20", *args]
            for name, (pre, args) in arms.items()
        ],
        cwd=str(base),
        env={"OMP_NUM_THREADS": "1"},
    )
    assert all(p.returncode == 0 for p in procs), [p.stderr[-2000:] for p in procs]
    return {name: only_run_dir(out) for name, out in outs.items()}


def _findings(run_dir):
    with open(os.path.join(run_dir, "findings.json")) as f:
        data = json.load(f)
    return data.get("findings", data) if isinstance(data, dict) else data


def test_anomaly_mode_is_named_at_its_line_with_the_edit_that_turns_it_off(runs):
    found = [f for f in _findings(runs["anomaly"]) if f["id"] == "switches.anomaly"]
    assert found, [f["id"] for f in _findings(runs["anomaly"])]
    f = found[0]
    line = _line_of("torch.autograd.set_detect_anomaly(True)")
    assert f["severity"] in ("medium", "high", "critical")
    assert f["evidence"]["set_at"]["line"] == line and f"anomaly_train.py:{line}" in f["title"]
    code = f["prescriptions"][0]["change"]["code"]
    assert code["line"] == line and code["after"].strip() == "torch.autograd.set_detect_anomaly(False)"
    assert f["prescriptions"][1]["change"] == {"runtime": {"patch": "switch_off:anomaly"}}
    assert f["seconds_lost_per_step"] > 0


def test_an_evaluation_without_no_grad_is_named_at_the_model_call(runs):
    found = [f for f in _findings(runs["anomaly"]) if f["id"] == "switches.eval_grad"]
    assert found and found[0]["evidence"]["set_at"]["line"] == _line_of("val = nn.functional")
    assert "torch.no_grad()" in found[0]["prescriptions"][0]["summary"]
    # the call wrapped on its line, applied by --fix; on a CPU its own model says it pays little
    code = found[0]["prescriptions"][0]["change"]["code"]
    assert code["line"] == _line_of("val = nn.functional") and found[0]["prescriptions"][0]["automatic"]
    assert code["after"] == "with torch.no_grad(): " + code["before"] and code["before"].startswith("val = ")
    assert found[0]["severity"] == "low"


def test_fix_measures_the_edit_then_the_runtime_patch(runs):
    run = traindx.load_run(runs["anomaly"])
    findings = [f for f in traindx.analyze(run) if f.id == "switches.anomaly"]
    candidates, _ = candidate_plans([PY, JOB, "--anomaly"], findings, runs["anomaly"], environ={}, cwd=ROOT)
    assert [c.mechanism for c in candidates][:2] == ["source", "runtime"]
    assert candidates[1].plan.env == {"TRAINDX_RUNTIME_PATCHES": "switch_off:anomaly"}


def test_healthy_twin_is_quiet(runs):
    loud = [f for f in _findings(runs["healthy"]) if f["severity"] not in ("info", "low")]
    assert not [f for f in loud if not f["id"].startswith("verdict.")], loud


def test_the_runtime_patches_turn_them_off(runs):
    run = traindx.load_run(runs["patched"])
    switch = run.of_type("switch")
    assert len(switch) and bool(switch["forced_off"].iloc[0]) and switch["name"].iloc[0] == "anomaly"
    assert not [f for f in traindx.analyze(run) if f.id.startswith("switches.") and is_problem(f)]
    # the evaluations ran without grad: their forward spans say so
    events = [
        json.loads(line)
        for name in os.listdir(os.path.join(runs["patched"], "events"))
        if name.endswith(".jsonl")
        for line in open(os.path.join(runs["patched"], "events", name))
    ]
    no_grad = [e for e in events if e.get("cat") == "forward" and e.get("grad") is False]
    assert len(no_grad) >= 2  # steps 5 and 10 (step 0 runs before the hooks are on)
