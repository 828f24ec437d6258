"""Time the host spends while its GPU still runs work queued before it is the GPU's in the
ledger (the `gpu` line, "waits for GPU"), not the host's or a sync's: a conv net whose GPU is
busy the whole step booked 0.12 s of its 0.13 s step as "host". Run records built in code: the
shim's steps, spans and GPU time marks (CUDA events at the measured boundaries) of a loop that
queues forward, backward and the optimizer step, then waits (a sync, or its own loop code)."""

import json

import numpy as np
import pytest
from ledger_helpers import _assert_sums_exactly

import traindx
from traindx.derive import ledger as L

MS = 1_000_000
T0 = 1_700_000_000_000_000_000
STEPS = 8


def _loop_run(path, gpu_ms, wait_in_sync):
    """A step of 100 ms: 10 ms of loop code, forward (5 ms) and backward (5 ms) queued, the
    optimizer step (5 ms), then 75 ms in a sync (wait_in_sync) or in the loop's own code. The
    GPU runs the step's kernels for gpu_ms from the forward's start (its queue empty at each
    step's start: the previous step's wait drained it)."""
    (path / "events").mkdir(parents=True)
    ev = [{"type": "process_start", "t": T0 - 10 * MS, "pid": 1, "rank": "0", "main_thread": 1}]
    for k in range(STEPS):
        t = T0 + k * 100 * MS
        ev += [{"type": "step_begin", "step": k, "t": t}, {"type": "step_end", "step": k, "t": t + 100 * MS}]
        spans = [("forward", 10, 15), ("backward", 15, 20), ("optimizer", 20, 25)]
        if wait_in_sync:
            spans.append(("sync", 25, 100))
        ev += [
            {"type": "span", "cat": c, "start": t + a * MS, "t": t + b * MS, "tid": 1} for c, a, b in spans
        ]
        done = 10 + gpu_ms  # when the GPU finishes the step's kernels (ms into the step)

        def g(h_ms, queued_until, done=done):  # a mark recorded at h_ms completes when the GPU reaches it
            return float(max(h_ms, min(done, queued_until)) * 1000)

        marks = [
            ["step", t, g(0, 0)],
            ["bwd>", t + 15 * MS, g(15, 10 + gpu_ms * 0.4)],
            ["bwd<", t + 20 * MS, g(20, 10 + gpu_ms * 0.9)],
            ["opt>", t + 20 * MS, g(20, 10 + gpu_ms * 0.9)],
            ["opt<", t + 25 * MS, g(25, done)],
        ]
        if wait_in_sync:
            marks.append(["sync<", t + 100 * MS, g(100, done)])
        marks.append(["step", t + 100 * MS, g(100, done)])
        ev.append({"type": "gpu_time", "step": k, "device": 0, "t": t + 100 * MS, "marks": marks})
    ev.sort(key=lambda e: e["t"])
    (path / "events" / "0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    (path / "manifest.json").write_text(json.dumps({"command": ["python", "train.py"], "cwd": "/job"}))
    return traindx.load_run(str(path))


def _mean(run, line):
    return float(L.steady_rows(run)[f"{line}_s"].mean())


@pytest.mark.parametrize("wait_in_sync", [True, False])
def test_the_hosts_wait_for_a_busy_gpu_is_the_gpus_line(tmp_path, wait_in_sync):
    # the GPU busy 90 ms of the 100 ms step: the host waits 75 ms after queueing the step
    run = _loop_run(tmp_path / "busy", gpu_ms=90, wait_in_sync=wait_in_sync)
    _assert_sums_exactly(run.ledger)
    assert _mean(run, "gpu") == pytest.approx(0.075, abs=1e-6)
    assert _mean(run, "sync") == pytest.approx(0.0, abs=1e-6)
    assert _mean(run, "host") == pytest.approx(0.010, abs=1e-6)  # the loop code before the forward
    assert _mean(run, "forward_backward") == pytest.approx(0.010, abs=1e-6)
    assert "waits for GPU 0.075" in L.breakdown_text(L.steady_rows(run))


def test_the_hosts_own_work_beside_an_idle_gpu_stays_the_hosts(tmp_path):
    # the GPU done 20 ms into the step: of the 75 ms of loop code after the optimizer step, the
    # GPU still runs earlier work for 5 ms; the other 70 ms are the host's own
    run = _loop_run(tmp_path / "idle", gpu_ms=20, wait_in_sync=False)
    _assert_sums_exactly(run.ledger)
    assert _mean(run, "gpu") == pytest.approx(0.005, abs=1e-6)
    assert _mean(run, "host") == pytest.approx(0.080, abs=1e-6)


def test_a_run_without_gpu_marks_books_as_before(tmp_path):
    run = _loop_run(tmp_path / "busy", gpu_ms=90, wait_in_sync=True)
    for e in (tmp_path / "busy" / "events").iterdir():
        kept = [line for line in e.read_text().splitlines() if '"gpu_time"' not in line]
        e.write_text("\n".join(kept) + "\n")
    run = traindx.load_run(str(tmp_path / "busy"))
    assert _mean(run, "gpu") == 0.0
    assert _mean(run, "sync") == pytest.approx(0.075, abs=1e-6)
    assert np.isclose(_mean(run, "host"), 0.010)
