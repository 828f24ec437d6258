"""DDP with gradient accumulation and no no_sync(): every micro-batch's backward all-reduces the
gradients though only the last one's sum is read by optimizer.step(). Judged from run folders
built in code (the shim's backward spans carry grad_sync, optimizer spans mark the steps), and
once on a real 2-rank gloo job on the CPU under torchrun with its no_sync() twin."""

import json
import os

import pytest
from analyzer_helpers import _line_of
from helpers import PY, diagnose, only_run_dir

import traindx
from traindx.analyzers.ranks import grad_sync

MS = 1_000_000
T0 = 1_700_000_000_000_000_000
ACCUM = 4
JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs", "ddp_accum.py")


def _rank_events(rank, synced, wait_ms, steps=8):
    """One rank's steps: ACCUM forward+backward pairs then one optimizer step; a backward whose
    gradients were all-reduced waits wait_ms after its gradients were ready."""
    ev = [
        {"type": "process_start", "t": T0 - 10 * MS, "pid": 10 + rank, "rank": str(rank), "main_thread": 1},
        {"type": "ddp", "t": T0 - 5 * MS, "group": "0"},
    ]
    for k in range(steps):
        t = T0 + k * 200 * MS
        ev.append({"type": "step_begin", "step": k, "t": t})
        at = t
        for micro in range(ACCUM):
            sync = synced(micro)
            bwd_end = at + 20 * MS + (wait_ms if sync else 0) * MS
            ev.append({"type": "span", "cat": "forward", "start": at, "t": at + 10 * MS, "tid": 1})
            ev.append(
                {
                    "type": "span",
                    "cat": "backward",
                    "start": at + 10 * MS,
                    "t": bwd_end,
                    "tid": 1,
                    "grads_ready": at + 20 * MS,
                    "grad_sync": sync,
                }
            )
            at = bwd_end
        ev.append({"type": "span", "cat": "optimizer", "start": at, "t": at + 5 * MS, "tid": 1})
        ev.append({"type": "step_end", "step": k, "t": at + 10 * MS})
    ev.append(
        {
            "type": "grad_accum",
            "t": T0 + 3 * 200 * MS,
            "steps": 3,
            "backward": [ACCUM] * 3,
            "optimizer": [1] * 3,
            "sites": {"backward": {"file": "/job/train.py", "line": 28, "function": "main"}},
        }
    )
    return sorted(ev, key=lambda e: e["t"])


def _folder(path, synced, wait_ms=30):
    (path / "events").mkdir(parents=True)
    for rank in (0, 1):
        lines = "".join(json.dumps(e) + "\n" for e in _rank_events(rank, synced, wait_ms))
        (path / "events" / f"{rank}.jsonl").write_text(lines)
    (path / "manifest.json").write_text(json.dumps({"command": ["torchrun", "train.py"], "cwd": "/job"}))
    return traindx.load_run(str(path))


def test_an_all_reduce_every_micro_batch_is_named_at_the_backward_with_its_price(tmp_path):
    findings = grad_sync.analyze(_folder(tmp_path, lambda micro: True))
    (f,) = findings
    assert f.id == "ranks.grad_sync_every_micro_batch"
    assert f.evidence["file"] == "/job/train.py" and f.evidence["line"] == 28
    assert f.evidence["optimizer_steps"] == 8 and f.evidence["extra_all_reduces"] == 8 * (ACCUM - 1)
    # the price: three 30 ms waits after the gradients were ready, every step
    assert f.seconds_lost_per_step == pytest.approx(3 * 0.030, rel=1e-4)
    assert set(f.ranks) == {"0", "1"}
    assert f.severity in ("medium", "high") and "no_sync()" in f.prescriptions[0].summary


def test_no_sync_on_all_but_the_last_micro_batch_is_quiet(tmp_path):
    assert grad_sync.analyze(_folder(tmp_path, lambda micro: micro == ACCUM - 1)) == []


@pytest.mark.slow
@pytest.mark.parametrize("no_sync", [False, True])
def test_a_real_gloo_ddp_job_accumulating_without_no_sync(tmp_path, no_sync):
    out = tmp_path / "runs"
    cmd = [os.path.join(os.path.dirname(PY), "torchrun"), "--nproc_per_node=2", JOB, "--steps", "12"]
    proc = diagnose(
        ["--out", str(out), "--no-pyspy", "--", *cmd, *(["--no-sync"] if no_sync else [])], tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    findings = traindx.analyze(traindx.load_run(only_run_dir(out)))
    found = [f for f in findings if f.id == "ranks.grad_sync_every_micro_batch"]
    if no_sync:
        assert not found
        return
    (f,) = found
    assert f.evidence["line"] == _line_of(JOB, "loss.backward()") and f.evidence["file"].endswith(
        "ddp_accum.py"
    )
    assert f.evidence["extra_all_reduces"] == 3 * f.evidence["optimizer_steps"]
    assert f.seconds_lost_per_step > 0 and "no_sync()" in f.prescriptions[0].summary
