"""The DataLoader-workers prediction splits the data line into its off-CPU wait and its CPU
work: a storage wait parallelises over the workers whatever the load, CPU work only as far as
the cores give each task a share (traindx.analyzers.core.savings)."""

import os

import pytest
from helpers import PY, diagnose

import traindx
from traindx.analyzers.core import savings as S
from traindx.derive import ledger as L

JOBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs")


def test_a_wait_parallelises_over_workers_and_cpu_work_over_the_share():
    # 48 ms of storage wait and 1 ms of CPU per batch, 1.5 ms of compute, 8 other runnable
    # tasks on 2 cores: each task gets 2/8 of a core, less what the job's own busy tasks take
    # (at most 3 more). The wait needs no core: 2 workers make a batch every
    # (48 + 1 / share) / 2 ms, 4 workers twice as often
    two = S.workers_step_model(0.001, 0.0015, 0.0016, 2, 2, 8, load_wait=0.048)
    four = S.workers_step_model(0.001, 0.0015, 0.0016, 4, 2, 8, load_wait=0.048)
    assert (0.048 + 0.001 * 8 / 2) / 2 < two <= (0.048 + 0.001 * 11 / 2) / 2
    assert four == pytest.approx(two / 2, rel=0.1)
    # the same 49 ms read as CPU work (what the model did before the split) comes out at more
    # than twice the 50.6 ms step it came from: 2 more CPU-hungry tasks on a full machine
    assert S.workers_step_model(0.049, 0.0015, 0.0016, 2, 2, 8) > 2 * 0.0506
    # held to the quarter core it had, the job's CPU work needs 2.5 ms / 0.25 = 10 ms a step:
    # still less than the wait, which the workers share
    assert S.workers_step_capped(0.001, 0.0015, 0.0016, 2, 0.25, load_wait=0.048) == pytest.approx(0.0245)
    # a CPU-bound main stage sets the step: the workers' wait is hidden behind it
    assert S.workers_step_model(0.001, 0.3, 0.3, 2, 2, 0, load_wait=0.2) == pytest.approx(0.3, rel=0.02)


def test_measured_stage_times_grow_only_by_the_contention_the_workers_add():
    # an idle 2-core machine, a CPU-bound loader (30 ms runnable per batch, no run-queue wait)
    # and 6 ms of compute: what the CPU model says (18 ms, test_ledger's documented case)
    assert S.workers_step_measured(0.0, 0.030, 0.0, 0.006, 2, 2, 0) == pytest.approx(
        S.workers_step_model(0.030, 0.006, 0.006, 2, 2, 0), rel=0.05
    )
    # a loader that waits on storage: 48 ms off the CPU and 7 ms runnable per batch, measured
    # at a quarter core (7 other runnable tasks on 2 cores). The wait halves over 2 workers;
    # the runnable part grows by the job's own extra tasks, at most (7 + 3) / 8
    step = S.workers_step_measured(0.048, 0.007, 0.0, 0.0016, 2, 2, 7)
    assert (0.048 + 0.007) / 2 < step <= (0.048 + 0.007 * 10 / 8) / 2
    # a main stage that is slower than the workers' batches sets the step: its measured
    # 310 ms, a little slower for the workers' short bursts beside it
    step = S.workers_step_measured(0.64, 0.027, 0.0, 0.31, 2, 2, 4.5)
    assert 0.31 < step < 0.31 * 1.1


def test_loader_time_split_from_the_data_spans_or_the_whole_steps_runq():
    evd = {"data": 0.060, "data_cpu": 0.002, "data_runq": 0.006, "thread_cpu": 0.004, "thread_runq": 0.012}
    split = S.loader_time_split(evd)
    assert split == pytest.approx({"cpu": 0.002, "runq": 0.006, "wait": 0.052, "runq_measured": True})
    # an older shim: no run-queue wait on the spans, the thread's whole-step ratio (3 s of
    # waiting for a core per CPU second) prices the data CPU's
    split = S.loader_time_split(dict(evd, data_runq=None))
    assert split["runq"] == pytest.approx(0.006) and split["runq_measured"] is False
    assert split["wait"] == pytest.approx(0.052)
    assert S.core_share_seen(evd) == pytest.approx(0.25)
    assert S.core_share_seen(dict(evd, thread_runq=None)) is None


@pytest.mark.slow
def test_the_split_of_a_real_loader_that_waits_then_works(tmp_path):
    """8 steps of 4 samples, each a 5 ms sleep then 0.5 ms of the thread's CPU: the shim's data
    spans give 20 ms a step off the CPU and 2 ms of CPU, whatever the machine's load (a
    preempted thread is runnable, not waiting), and the prediction for 2 workers halves the wait."""
    out = tmp_path / "run"
    proc = diagnose(
        [
            "--no-pyspy",
            "--quiet",
            "--run-dir",
            str(out),
            "--",
            PY,
            os.path.join(JOBS, "wait_and_work_loader.py"),
            "--steps",
            "8",
        ],
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = traindx.load_run(str(out))
    evd = L.cpu_evidence(run)
    assert evd["data_runq"] is not None and evd["thread_runq"] is not None
    split = S.loader_time_split(evd)
    batch = 4
    assert batch * 0.0005 * 0.95 <= split["cpu"] <= batch * 0.0005 + 0.003
    # off the CPU: the sleeps (a woken thread waits for a core in the run queue, not here)
    assert batch * 0.005 * 0.95 <= split["wait"] <= batch * 0.005 * 1.2 + 0.003
    assert split["cpu"] + split["runq"] + split["wait"] == pytest.approx(evd["data"])
    found = [f for f in traindx.analyze(run) if f.id == "dataloader.starvation"]
    assert found, [f.id for f in traindx.analyze(run)]
    f = found[0]
    # a price well under the time lost says why (the verdict and the report print it)
    priced = next(
        (p.expected_gain_s_per_step for p in f.prescriptions if p.expected_gain_s_per_step is not None), None
    )
    short = priced is None or priced < 0.8 * f.seconds_lost_per_step
    assert ("saving_limit" in f.evidence) == short, (priced, f.seconds_lost_per_step, f.evidence)
    if short:
        assert f"{f.removes['workers']} worker processes" in f.evidence["saving_limit"]
    pred = S.predicted_step_time(run, f)
    workers = f.removes["workers"]
    assert pred["cpu_evidence"]["load_wait"] == pytest.approx(split["wait"])
    low, high = pred["predicted_range_s"]
    # the wait goes to the workers and is shared among them: never faster than that, and the
    # step saves at least what it moved beyond one worker's share
    assert low >= split["wait"] / workers - 1e-9
    assert pred["predicted_step_s"] <= pred["baseline_step_s"] - split["wait"] * (1 - 1 / workers) * 0.5
    # partly a wait: the point sits nearer the per-task reading, (1 - wait / data) / 2 of the way
    # towards the group cap (on a quiet machine ~0.05; a loaded one's run-queue time counts as
    # CPU demand: 0.31 seen at load 3 on 2 cores)
    evd_out = pred["cpu_evidence"]
    task, group = evd_out["per_task_s"], evd_out["per_group_s"]
    weight = (1 - split["wait"] / evd["data"]) / 2
    assert pred["predicted_step_s"] == pytest.approx(task + weight * (group - task))
    assert evd_out["group_weight"] == pytest.approx(weight) and weight < 0.45
