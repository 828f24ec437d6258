"""The GPU's own view (issue 20 item 4): CUDA events at the shim's measured boundaries, their
busy/idle derivation, the torch.profiler window's busy split and top kernels, and the gpu_idle
findings, on H200 run folders recorded by diagnose. (The shim's CPU path unchanged:
test_report.py's test_a_cpu_job_records_no_gpu_time.)

CI has no GPU. The shim's event bookkeeping runs against a stand-in for torch.cuda whose events
complete as a CUDA stream does (first in, first out, never before they are recorded), and the
derive layer is checked against the idle time of a simulated FIFO stream, which it never sees.
"""

import contextlib
import io
import json
import os
import shutil
import types

import pandas as pd
import pytest
from gpu_view_helpers import DATA, ROOT, load

import traindx
from traindx.analyzers.gpu import idle as gpu_idle
from traindx.profiler import gputime as derive
from traindx.profiler.torchtrace import gpu_kind, gpu_window, load_trace, top_kernels

NCCL = os.path.join(DATA, "h200x2-nccl-straggler")  # 2 x H200, NCCL, rank 1 sleeps 250 ms a step
PATHOLOGIES = os.path.join(DATA, "h200-gpu-pathologies")
SHIM = os.path.join(ROOT, "profiler", "shim")


# -- a FIFO stream: what a CUDA stream does with work and events --------------------------------
class Stream:
    """Work runs in order, each item from max(queued, previous end); an event completes when
    everything queued before it has run (and not before it was recorded)."""

    def __init__(self, t0):
        self.free = t0  # when the GPU has run everything queued so far
        self.busy = []  # (start, end) of each piece of work

    def launch(self, t, seconds):
        start = max(self.free, t)
        self.free = start + int(seconds * 1e9)
        self.busy.append((start, self.free))

    def complete_at(self, t):
        self.free = max(self.free, t + 3000)  # 3 µs for the event itself
        return self.free

    def idle_between(self, a, b):
        busy = sum(max(0, min(e, b) - max(s, a)) for s, e in self.busy)
        return (b - a - busy) / 1e9


class Clock:
    def __init__(self):
        self.t = 1_800_000_000_000_000_000

    def __call__(self):
        return self.t


def fake_torch(clock, stream, capturing=lambda: False):
    class Event:
        created = 0

        def __init__(self, enable_timing=False):
            Event.created += 1
            self.g = None

        def record(self):
            self.g = stream.complete_at(clock())

        def query(self):  # done once the host's clock has passed its completion
            return self.g is not None and self.g <= clock()

        def synchronize(self):
            clock.t = max(clock.t, self.g)

        def elapsed_time(self, other):
            return (other.g - self.g) / 1e6

    cuda = types.SimpleNamespace(
        Event=Event,
        is_initialized=lambda: True,
        current_device=lambda: 0,
        is_current_stream_capturing=capturing,
    )
    return types.SimpleNamespace(cuda=cuda, compiler=None), Event


@pytest.fixture
def shim(monkeypatch):
    monkeypatch.syspath_prepend(SHIM)
    from _traindx_shim import gputime

    emitted = []
    monkeypatch.setattr(gputime, "emit", lambda type_, **f: emitted.append(dict(f, type=type_)))
    clock = Clock()
    monkeypatch.setattr(gputime, "_now", clock)
    state = dict(
        gputime._state,
        pool=[],
        marks=[],
        pending=__import__("collections").deque(),
        active=False,
        checked=False,
    )
    monkeypatch.setattr(gputime, "_state", state)
    monkeypatch.setattr(gputime.steps, "boundary_hooks", [])
    return gputime, clock, emitted


def run_loop(gputime, clock, stream, steps, host_s=0.050, launch_bound=False):
    """A loop: a batch built on the host for host_s (no GPU work), forward queued at its end
    (2 ms of GPU work), backward (8 ms), optimizer (1 ms), the loss read (a sync)."""
    truth = []
    for step in range(steps):
        gputime._boundary(step)
        start = clock.t
        clock.t += int(host_s * 1e9)
        stream.launch(clock.t, 0.002)
        clock.t += 100_000
        gputime.mark("bwd>")
        stream.launch(clock.t, 0.008)
        clock.t += 200_000
        gputime.mark("bwd<")
        gputime.mark("opt>")
        stream.launch(clock.t, 0.001)
        clock.t += 50_000
        gputime.mark("opt<")
        clock.t = max(clock.t, stream.free) + 20_000  # loss.item(): the host waits for the GPU
        gputime.mark("sync<")
        truth.append((step, start, clock.t))
    gputime._boundary(steps)
    return truth


def test_shim_records_one_event_per_step_lazily_and_reuses_its_events(shim):
    gputime, clock, emitted = shim
    stream = Stream(clock.t)
    torch, Event = fake_torch(clock, stream)
    gputime._state["torch"] = torch
    gputime._maybe_start()  # CUDA "in use": the step hook goes in
    assert gputime.steps.boundary_hooks == [gputime._boundary]
    gputime.mark("bwd>")
    assert gputime._state["marks"] == [], "no marks before a step exists"
    run_loop(gputime, clock, stream, steps=30)
    gputime.flush()
    events = [e for e in emitted if e["type"] == gputime.GPU_TIME_EVENT]
    assert [e["step"] for e in events] == list(range(30))
    for a, b in zip(events, events[1:]):  # a step's last mark is the next step's first
        assert a["marks"][-1][:2] == b["marks"][0][:2]
    labels = [m[0] for m in events[5]["marks"]]
    assert labels == ["step", "bwd>", "bwd<", "opt>", "opt<", "sync<", "step"]
    assert all(m[2] >= 0 for e in events for m in e["marks"])
    assert Event.created < 20, "events come back to the pool once read"


def test_shim_marks_nothing_while_a_cuda_graph_is_captured(shim):
    gputime, clock, emitted = shim
    stream = Stream(clock.t)
    torch, _ = fake_torch(clock, stream, capturing=lambda: True)
    gputime._state["torch"] = torch
    gputime._maybe_start()  # CUDA "in use": the step hook goes in
    run_loop(gputime, clock, stream, steps=3)
    gputime.flush()
    assert not [e for e in emitted if e["type"] == gputime.GPU_TIME_EVENT]
    assert not [e for e in emitted if e["type"] == "shim_error"]


def test_derive_brackets_the_true_idle_time_of_a_fifo_stream(shim):
    """The derived floor and ceiling of each step's idle time hold the stream's true idle time;
    the host-built batch is named: its stretch's ceiling is the batch time."""
    gputime, clock, emitted = shim
    stream = Stream(clock.t)
    gputime._state["torch"] = fake_torch(clock, stream)[0]
    gputime._maybe_start()  # CUDA "in use": the step hook goes in
    truth = run_loop(gputime, clock, stream, steps=20, host_s=0.050)
    gputime.flush()
    events = pd.DataFrame([dict(e, rank="0") for e in emitted if e["type"] == gputime.GPU_TIME_EVENT])
    stretches = derive.stretches(events)
    steps = derive.steps_table(stretches).set_index("step")
    for step, start, end in truth[2:]:
        true_idle = stream.idle_between(start, end)
        row = steps.loc[step]
        assert row["idle_min_s"] - 1e-5 <= true_idle <= row["idle_max_s"] + 1e-5
        assert abs(row["idle_max_s"] - true_idle) < 0.002  # within the forward's launch
        # the ceiling on idle is the tight side here: busy at least 11 of ~61 ms (the truth)
        assert 0.15 < row["busy_min_share"] < 0.25 and row["busy_max_share"] >= row["busy_min_share"]
    host = stretches[(stretches["from"] == "step") & (stretches["to"] == "bwd>")]
    assert host["idle_max_s"].iloc[5:].between(0.0499, 0.0502).all()


def test_derive_kernel_free_stretches_are_exact(shim):
    """A DataLoader fetch queues no GPU work: the idle inside it is measured on the GPU's clock
    alone (no clock alignment), floor = ceiling."""
    gputime, clock, emitted = shim
    stream = Stream(clock.t)
    gputime._state["torch"] = fake_torch(clock, stream)[0]
    gputime._maybe_start()  # CUDA "in use": the step hook goes in
    for step in range(12):
        gputime._boundary(step)
        stream.launch(clock.t, 0.010)  # the previous step's tail still running
        gputime.mark("data>")
        clock.t += 30_000_000  # a 30 ms wait for the batch
        gputime.mark("data<")
        gputime.mark("bwd>")
        stream.launch(clock.t, 0.005)
        gputime.mark("bwd<")
    gputime._boundary(12)
    gputime.flush()
    events = pd.DataFrame([dict(e, rank="0") for e in emitted if e["type"] == "gpu_time"])
    rows = derive.stretches(events)
    data = rows[rows["from"] == "data>"]
    assert data["kernel_free"].all()
    assert (data["idle_min_s"] == data["idle_max_s"]).all()
    # a 30 ms wait while 15 ms are queued (the last backward, 5 ms, and this tail, 10 ms)
    assert data["idle_min_s"].iloc[2:].between(0.0149, 0.0151).all()


# -- the window (H200 traces) ------------------------------------------------------------------
def test_window_busy_split_and_top_kernels_on_h200_nccl_trace():
    trace = load_trace(os.path.join(NCCL, "trace", "0.json.gz"), "0")
    gpu = trace[trace["cat"].isin(["kernel", "gpu_memcpy", "gpu_memset"])]
    view = gpu_window(trace, int(gpu["start_ns"].min()), int(gpu["end_ns"].max()))
    assert view["communication_s"] > 0.9 * view["busy_s"]  # rank 0 waits in the all-reduce
    assert view["exposed_communication_s"] > 0.95 * view["communication_s"]
    assert view["compute_s"] > 0 and view["copy_s"] > 0 and view["pageable_h2d_s"] > 0
    assert abs(view["busy_s"] + view["idle_s"] - view["wall_s"]) < 1e-9
    top = top_kernels(trace, 3)
    assert top["kind"].iloc[0] == "communication" and "AllReduce" in top["name"].iloc[0]
    assert top["share"].is_monotonic_decreasing
    assert gpu_kind("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)") == "copy"
    assert "bytes" in trace and (trace["bytes"] > 0).any()


def test_window_of_a_compute_only_h200_job():
    trace = load_trace(os.path.join(PATHOLOGIES, "sync", "trace", "0.json.gz"), "0")
    gpu = trace[trace["cat"] == "kernel"]
    view = gpu_window(trace, int(gpu["start_ns"].min()), int(gpu["end_ns"].max()))
    assert view["communication_s"] == 0 and view["exposed_communication_s"] == 0
    assert view["compute_s"] > 0.9 * view["busy_s"]


# -- findings on H200 run folders ------------------------------------------------------------
def test_gpu_idle_names_the_sleeping_rank_and_the_waiting_one():
    run = load(NCCL)
    found = {(f.id, f.ranks[0]): f for f in gpu_idle.analyze(run)}
    starved = found[("gpu_idle.host_starved", "1")]
    assert starved.evidence["function"] == "main"
    assert starved.evidence["calls"][0]["call"] == "sleep"
    assert 0.24 < starved.seconds_lost_per_step < 0.27  # the injected 250 ms a step
    assert all(p.expected_gain_s_per_step > 0 for p in starved.prescriptions)
    waiting = found[("gpu_idle.exposed_communication", "0")]
    assert waiting.seconds_lost_per_step > 0.1
    assert ("gpu_idle.host_starved", "0") not in found  # rank 0's GPU waits in NCCL, not on its host
    # one cause: rank 1's host work; the straggler and rank 0's wait in NCCL are its symptoms
    linked = {f.id: f for f in traindx.analyze(run)}
    assert linked["gpu_idle.host_starved"].cause is None
    assert linked["ranks.straggler"].cause == "gpu_idle.host_starved"
    assert linked["gpu_idle.exposed_communication"].cause == "gpu_idle.host_starved"


@pytest.mark.parametrize("name", ["none", "power", "launch_bound"])
def test_gpu_idle_quiet_on_h200_jobs_without_host_work(name):
    assert [f.id for f in gpu_idle.analyze(load(os.path.join(PATHOLOGIES, name)))] == []


def test_pageable_copy_finding_from_the_window(tmp_path):
    """The H200 trace's pageable copies are 64 KB each (too small to matter): no finding. The same
    window with each copy's size and time scaled up 4,000x (256 MB at the trace's 11 GB/s) is
    one, saving the copy time over pinned memory's: the copies' share of the window's step
    applied to the steady step (a pageable copy's speed follows the host's memory traffic), less
    the same bytes from pinned memory, and never below the GPU work that stays."""
    run = load(NCCL)
    assert not [f for f in gpu_idle.analyze(run) if f.id == "gpu_idle.pageable_copy"]
    trace = run.torch_trace.copy()
    big = (trace["cat"] == "gpu_memcpy") & trace["name"].str.contains("Pageable")
    trace.loc[big, "bytes"] *= 4000
    trace.loc[big, "dur_s"] *= 4000
    run.__dict__["torch_trace"] = trace
    found = [f for f in gpu_idle.analyze(run) if f.id == "gpu_idle.pageable_copy"]
    assert found, "a large pageable copy per step is a finding"
    f = found[0]
    copy_s, nbytes = f.evidence["pageable_h2d_s_per_step"], f.evidence["bytes_per_step"]
    e = f.evidence
    pinned_s = nbytes / gpu_idle.PINNED_H2D_BPS
    expected = min(
        e["copy_share_of_window_step"] * e["steady_step_s"] - pinned_s,
        e["steady_step_s"] - e["gpu_work_left_s_per_step"],
    )
    assert f.seconds_lost_per_step == pytest.approx(expected, rel=1e-3)
    assert 0 < f.seconds_lost_per_step < e["steady_step_s"] and copy_s > pinned_s
    assert "pin" in f.prescriptions[0].summary


# -- marks on real run folders ---------------------------------------------------------------
def add_marks(shim, run_dir, rank, plan):
    """Append the per-step marks a FIFO stream gives for `plan(step, start_ns, end_ns)` (a list
    of (label, at_ns, gpu_work_s)) to a real run folder recorded before the shim had them."""
    gputime, clock, emitted = shim
    run = load(str(run_dir))
    steps = run.rank_steps(rank)
    stream = Stream(int(steps["start_ns"].min()))
    gputime._state["torch"] = fake_torch(clock, stream)[0]
    gputime._maybe_start()  # CUDA "in use": the step hook goes in
    for row in steps.itertuples():
        clock.t = int(row.start_ns)
        gputime._boundary(int(row.step))
        for label, at, work in plan(int(row.step), int(row.start_ns), int(row.end_ns)):
            clock.t = at
            gputime.mark(label)
            if work:
                stream.launch(at, work)
    clock.t = int(steps["end_ns"].max())
    gputime._boundary(int(steps["step"].max()) + 1)
    gputime.flush()
    events = sorted(p for p in os.listdir(run_dir / "events") if p.endswith(".jsonl"))
    with open(run_dir / "events" / events[0], "a") as f:
        for e in emitted:
            if e["type"] == "gpu_time":
                f.write(json.dumps(dict(e, t=e["marks"][-1][1])) + "\n")


def test_idle_between_steps_every_fifth_step(tmp_path, shim):
    """Every 5th step the loop's end-of-step code (after the optimizer) keeps the host busy
    for half the step while the GPU has nothing queued: named, with its period and steps. (A
    recorded run whose steps follow each other with no gap between them, as the shim's
    boundaries do now; its marks from the FIFO stream.)"""
    dst = tmp_path / "run"
    shutil.copytree(os.path.join(DATA, "cpu-gc-freeze-pair", "base"), dst)

    def plan(step, start, end):
        span = end - start
        opt_end = start + (span // 2 if step % 5 == 0 else span - 200_000)
        return [
            ("bwd>", start + 100_000, 0.0),
            ("bwd<", start + 200_000, span * 0.3 / 1e9),
            ("opt>", start + 300_000, 0.0),
            ("opt<", opt_end - 1000, 0.0005),
            ("sync<", opt_end, 0.0),
        ]

    add_marks(shim, dst, "0", plan)
    run = load(str(dst))
    found = [f for f in gpu_idle.analyze(run) if f.id == "gpu_idle.between_steps"]
    assert len(found) == 1
    f = found[0]
    steady = {
        int(s)
        for s in __import__("traindx.analyzers.core.evidence", fromlist=["x"]).steady_steps(run, "0")["step"]
    }
    assert set(f.steps_affected) == {s for s in steady if s % 5 == 0}
    assert f.evidence["period"] == 5
    steps = run.rank_steps("0").set_index("step")
    # half of each such step, less the optimizer's 0.5 ms, less the other steps' median
    expected = (
        sum(steps.loc[s, "duration_s"] / 2 - 0.0005 for s in f.steps_affected) / len(f.steps_affected)
        - f.evidence["idle_s_median_step"]
    )
    assert f.evidence["idle_s_on_those_steps"] == pytest.approx(expected, rel=0.05)
    assert f.prescriptions[0].expected_gain_s_per_step > 0


@pytest.mark.slow
def test_report_shows_gpu_busy_per_step_and_top_kernels(tmp_path, shim):
    """A real H200 run folder with per-step marks from the FIFO stream added: the report's GPU
    block lists the steps (busy beside the ledger) and the window's kernels."""
    dst = tmp_path / "run"
    shutil.copytree(NCCL, dst)

    def plan(step, start, end):
        return [("bwd>", (start + end) // 2, 0.004), ("sync<", end - 1000, 0.0)]

    add_marks(shim, dst, "0", plan)
    from traindx.cli import main as cli  # in this process: a second Python start adds nothing here

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli.main(["report", str(dst)])
    assert code == 0, err.getvalue()[-2000:]
    html = (dst / "report.html").read_text()
    assert 'id="gpu-time"' in html and 'id="gpu-steps"' in html and 'id="top-kernels"' in html
    assert "ncclDevKernel_AllReduce" in html
    assert "GPU busy" in html


# -- the CPU path: a CPU job runs unchanged and records no GPU time (checked on test_report.py's
# tiny run, test_a_cpu_job_records_no_gpu_time, which made the same diagnose run of train_tiny.py) --
