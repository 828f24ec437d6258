"""A rollout is not an evaluation: a run of no-grad forwards whose rows the optimizer steps after
it train on, new rows each run (a PPO rollout), is the training algorithm's own data collection -
a note, never "evaluate less often" - while an evaluation (rows nothing trains on) or a metric
over a fixed data set (the same rows each time) stays evaluation.in_loop.

Judged from run folders built in code (the shim's eval spans and nograd_phase events), and the
shim's check itself on real tensors, in a subprocess as the job would run it."""

import json
import os
import subprocess
import sys

import pytest

import traindx
from traindx.analyzers.run import evaluation

MS = 1_000_000
T0 = 1_700_000_000_000_000_000
SHIM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiler", "shim")
PERIOD = 4


def _folder(path, phases):
    """12 steps of forward, backward and optimizer; every PERIOD-th step opens with 20 no-grad
    forwards called from /job/train.py:30, each run followed by the shim's check of it."""
    (path / "events").mkdir(parents=True)
    ev = [{"type": "process_start", "t": T0 - 10 * MS, "pid": 1, "rank": "0", "main_thread": 1}]
    runs = iter(phases)
    for k in range(12):
        t = T0 + k * 500 * MS
        ev.append({"type": "step_begin", "step": k, "t": t})
        at = t
        if k % PERIOD == 0:
            for i in range(20):
                span = {
                    "type": "span",
                    "cat": "forward",
                    "start": at,
                    "t": at + 10 * MS,
                    "tid": 1,
                    "grad": False,
                }
                if i == 0:
                    span["caller"] = {"file": "/job/train.py", "line": 30, "function": "main"}
                ev.append(span)
                at += 12 * MS
            fed, fresh = next(runs)
            ev.append({"type": "nograd_phase", "t": at + 1, "rows": 160, "fed": fed, "fresh": fresh})
        for cat, ms in (("forward", 10), ("backward", 20), ("optimizer", 5)):
            ev.append({"type": "span", "cat": cat, "start": at, "t": at + ms * MS, "tid": 1})
            at += ms * MS
        ev.append({"type": "step_end", "step": k, "t": at + MS})
    ev.sort(key=lambda e: e["t"])
    (path / "events" / "0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    (path / "manifest.json").write_text(json.dumps({"command": ["python", "train.py"], "cwd": "/job"}))
    return traindx.load_run(str(path))


def test_a_no_grad_phase_the_next_steps_train_on_is_the_algorithms_data_collection(tmp_path):
    run = _folder(tmp_path, [(True, None), (True, True), (True, True)])
    (f,) = evaluation.analyze(run)
    assert f.id == "evaluation.rollout" and f.severity == "info" and not f.prescriptions
    assert f.evidence["line"] == 30 and f.evidence["period"] == PERIOD
    assert "rollout" in f.summary and f.seconds_lost_per_step > 0  # its price stays said


@pytest.mark.parametrize(
    "phases",
    [
        [(False, None), (False, True), (False, True)],  # held-out rows: nothing trains on them
        [(True, None), (True, False), (True, False)],  # a metric over the training set: same rows
        [(True, None), (False, True), (True, True)],  # one run nothing trained on
    ],
)
def test_an_evaluation_stays_an_evaluation(tmp_path, phases):
    (f,) = evaluation.analyze(_folder(tmp_path, phases))
    assert f.id == "evaluation.in_loop" and f.prescriptions


def test_a_run_recorded_without_the_check_stays_an_evaluation(tmp_path):
    run = _folder(tmp_path, [(None, None)] * 3)
    (f,) = evaluation.analyze(run)
    assert f.id == "evaluation.in_loop"


CHECK = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from _traindx_shim import nograd_feeds
from _traindx_shim.stepstate import _state
_state["torch"] = torch
out = []
nograd_feeds.emit = lambda type_, **f: out.append(f)
mode = sys.argv[2]
data = torch.randn(512, 16)
obs = torch.randn(8, 16)
for phase in range(3):
    if mode == "rollout":  # new observations each step, stored in a buffer refilled in place
        seen = []
        for _ in range(16):
            obs.copy_(0.9 * obs + torch.randn(8, 16))
            nograd_feeds._on_forward((obs,), False)
            seen.append(obs.clone())
        batch = torch.cat(seen)[torch.randperm(128)[:32]]
    else:  # a metric over the whole training set, then the next training batch
        nograd_feeds._on_forward((data,), False)
        batch = data[torch.randperm(512)[:32]]
    nograd_feeds._on_forward((batch,), True)
    nograd_feeds._on_forward((batch,), True)  # later grad forwards check nothing
print(json.dumps(out))
"""


@pytest.mark.parametrize("mode,fresh", [("rollout", True), ("metric", False)])
def test_the_shim_tells_rows_trained_on_and_whether_they_are_new(mode, fresh):
    proc = subprocess.run(
        [sys.executable, "-c", CHECK, SHIM, mode], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [e["fed"] for e in events] == [True, True, True]
    assert [e["fresh"] for e in events] == [None, fresh, fresh]
    assert events[0]["rows"] == (128 if mode == "rollout" else 512)
