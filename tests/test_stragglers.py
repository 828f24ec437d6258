"""Stragglers and pipeline bubbles on real multi-rank gloo jobs under `diagnose` (torchrun, 2-3
ranks): one rank made slow by sleeping, a GC storm, a slow DataLoader or recompiling before the
ranks meet. The finding names that rank, what the others waited for it per step, and why from
its own ledger; a pipeline's send/recv waits are bubbles, not stragglers; healthy jobs give
nothing, also with two CPU-burning processes beside them.

Two tests run their jobs for real (3 ranks with py-spy; DDP's all-reduces inside backward, which
the shim times); the others judge runs of the same job recorded on the 2-core CPU machine
(tests/data/cpu-stragglers.README): their judgement is checked on evidence no load can move,
and the tests that needed the machine to themselves (two CPU burners beside the job) no longer do.
"""

import os

import pytest
from helpers import PY, diagnose, only_run_dir, recorded_runs_here

import traindx

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs", "straggler_train.py")
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")
RECORDED_IN = "/work/wt-testsa"  # the checkout tests/data/cpu-stragglers was recorded in


# a rank that dies by a signal (a teardown SIGABRT was seen twice beside other tests) prints
# every Python thread's stack: with _job_stderr below, its cause reaches the failure message
JOB_ENV = {"PYTHONFAULTHANDLER": "1"}


def _job_stderr(out, lines=60):
    """The ranks' own stderr lines from the run's log.txt: diagnose's summary fills the tail of
    its stderr, so a rank's abort message is lost from proc.stderr[-3000:]."""
    try:
        with open(os.path.join(only_run_dir(out), "log.txt"), encoding="utf-8", errors="replace") as f:
            err = [line.split(" ", 2)[-1] for line in f if line.split(" ", 2)[1:2] == ["e"]]
    except (OSError, AssertionError):
        return ""
    return "".join(line for line in err if not line.startswith("[I"))[-lines * 200 :]


def _run(tmp_path, *job_args, nproc=2, pyspy=False):
    out = tmp_path / "runs"
    proc = diagnose(
        [
            "--out",
            str(out),
            "--quiet",
            *([] if pyspy else ["--no-pyspy"]),
            "--",
            TORCHRUN,
            "--nproc-per-node",
            str(nproc),
            JOB,
            *job_args,
        ],
        cwd=tmp_path,
        env=JOB_ENV,
        timeout=300,
    )
    assert proc.returncode == 0, (
        proc.stdout[-2000:]
        + proc.stderr[-3000:]
        + "\n--- the ranks' stderr (log.txt) ---\n"
        + _job_stderr(out)
    )
    run = traindx.load_run(only_run_dir(out))
    return run, traindx.analyze(run)


def _ranks(findings):
    return {f.id: f for f in findings if f.analyzer == "ranks"}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """{name: (run, findings)} of the recorded runs, each loaded and judged when first asked."""
    folder = recorded_runs_here("cpu-stragglers", tmp_path_factory.mktemp("stragglers"), RECORDED_IN)
    folder = folder / "cpu-stragglers"
    loaded = {}

    def get(name):
        if name not in loaded:
            run = traindx.load_run(str(folder / name))
            loaded[name] = (run, traindx.analyze(run))
        return loaded[name]

    return get


# every real job: 2-3 torchrun ranks under diagnose, 16-40 s each on the loaded 2-core machine
@pytest.mark.slow
def test_sleeping_rank_of_three_is_named_with_each_others_wait(tmp_path):
    run, findings = _run(
        tmp_path,
        "--sync",
        "allreduce",
        "--slow-rank",
        "2",
        "--cause",
        "sleep",
        "--slow-seconds",
        "0.25",
        nproc=3,
        pyspy=True,
    )
    assert sorted(set(run.steps["rank"])) == ["0", "1", "2"]
    found = _ranks(findings)
    assert set(found) == {"ranks.straggler"}, [(f.id, f.summary) for f in findings]
    f = found["ranks.straggler"]
    assert f.evidence["straggler"] == "2"
    assert 0.15 < f.seconds_lost_per_step < 0.5
    # both other ranks waited about the sleep for it, every step
    assert set(f.evidence["others_wait_per_step_s"]) == {"0", "1"}
    assert all(0.15 < w < 0.5 for w in f.evidence["others_wait_per_step_s"].values())
    # a sleep is no timed call: its ledger shows it as host time (the training thread's own
    # code between measured calls) before the all_reduce
    assert f.evidence["cause"] == "host"
    assert f.evidence["late_because_per_step_s"]["host"] > 0.15
    assert set(f.evidence["late_at"]["ops"]) == {"all_reduce"}
    assert f.severity in ("high", "critical")
    # one host, one clock: the arrivals themselves tell the same lateness as the waits
    gap = f.evidence["arrival_gap_per_step_s"]
    assert abs(gap - f.seconds_lost_per_step) < 0.3 * f.seconds_lost_per_step
    # py-spy names the code of that untimed work (when it could attach on this machine)
    if ("2", "all") in run.pyspy:
        assert f.evidence["straggler_does"]["hottest_frames"][0]["function"].endswith("slow_work")
        assert "slow_work" in f.summary
    else:
        assert "pyspy" in run.missing


def test_gc_storm_on_one_rank_is_the_straggler_and_a_symptom_of_the_gc_finding(recorded):
    run, findings = recorded("gc-storm")  # --sync allreduce --slow-rank 1 --cause gc
    f = _ranks(findings)["ranks.straggler"]
    assert f.evidence["straggler"] == "1"
    assert f.evidence["cause"] == "gc"
    gc_line = f.evidence["late_because_per_step_s"]["gc"]
    assert gc_line > 0.05 and f.seconds_lost_per_step > 0.05
    assert abs(f.evidence["others_wait_per_step_s"]["0"] - gc_line) < 0.5 * gc_line
    roots = [r for r in findings if r.id == "gc.gen2_in_step"]
    assert roots and "1" in roots[0].ranks
    assert f.cause == "gc.gen2_in_step" and not f.prescriptions


@pytest.mark.slow
def test_slow_data_on_one_ddp_rank_is_found_through_the_backward(tmp_path):
    """DDP's gradient all-reduces run in C++ inside backward: the ranks meet in each backward."""
    run, findings = _run(
        tmp_path, "--sync", "ddp", "--slow-rank", "1", "--cause", "data", "--slow-seconds", "0.2"
    )
    assert (run.events["type"] == "ddp").sum() == 2
    # each backward says where its rank's own gradients were ready: the fast rank's soon, the
    # rest of its backward waits for the slow rank's gradients
    bwd = run.events[(run.events["type"] == "span") & (run.events["cat"] == "backward")]
    ready, start, end = (bwd[c].astype(float) for c in ("grads_ready", "start", "t"))
    assert ready.notna().all() and (ready >= start).all() and (ready <= end).all()
    fast = (bwd["rank"].astype(str) == "0").to_numpy()
    assert ((ready - start)[fast] < 0.5 * (end - start)[fast]).mean() > 0.5
    f = _ranks(findings)["ranks.straggler"]
    assert f.evidence["straggler"] == "1"
    assert "DDP backwards" in f.evidence["source"]
    assert "backward" in f.evidence["late_at"]["ops"]
    assert f.evidence["cause"] == "data"
    assert 0.1 < f.seconds_lost_per_step < 0.5
    assert f.cause == "dataloader.starvation"


def test_compiling_straggler_chains_under_its_recompile(recorded):
    run, findings = recorded("compile")  # --sync allreduce --slow-rank 1 --cause compile
    f = _ranks(findings)["ranks.straggler"]
    assert f.evidence["straggler"] == "1"
    assert f.evidence["cause"] == "compile"
    assert f.evidence["straggler_compiles_in_steady_steps"]["compiles"] >= 5
    assert f.cause is not None and f.cause.startswith("jit.")
    root = next(r for r in findings if r.id == f.cause)
    assert "ranks.straggler" in root.symptoms


def test_pipeline_stages_show_bubbles_not_a_straggler(recorded):
    # --grad-norm: an all_reduce over both stages every step as well (gradient clipping)
    run, findings = recorded("pipeline")  # --sync pipeline --grad-norm --width 512 --layers 4
    found = _ranks(findings)
    assert "ranks.straggler" not in found, found["ranks.straggler"].summary
    bubble = found["ranks.pipeline_bubble"]
    per_rank = bubble.evidence["per_rank"]
    assert set(per_rank) == {"0", "1"}
    assert all(0.05 < v["share_of_step"] < 1.0 for v in per_rank.values())
    assert set(per_rank["1"]["ops"]) == {"recv", "send"} and per_rank["1"]["peers"] == [0]
    assert 0 < bubble.share_of_step < 1


def test_a_slow_pipeline_stage_is_a_bubble_with_the_stage_that_causes_it(recorded):
    run, findings = recorded("pipeline-slow-stage")  # --sync pipeline --grad-norm --slow-rank 1 --cause gc
    found = _ranks(findings)
    assert "ranks.straggler" not in found, found["ranks.straggler"].summary
    bubble = found["ranks.pipeline_bubble"]
    per_rank = bubble.evidence["per_rank"]
    assert per_rank["0"]["share_of_step"] > 0.5 > per_rank["1"]["share_of_step"]
    stage = bubble.evidence["slow_stage"]
    assert (stage["rank"], stage["waited_for_by"]) == ("1", "0")
    assert next(iter(stage["ledger_beyond_per_step_s"])) == "gc"
    assert bubble.cause == "gc.gen2_in_step"  # the stage's GC is the root, the bubble its symptom


# recorded with two CPU-burning processes beside the job (and the machine's other load)
@pytest.mark.parametrize("sync", ["allreduce", "ddp"])
def test_healthy_jobs_give_nothing_under_cpu_load(recorded, sync):
    run, findings = recorded(f"loaded-healthy-{sync}")  # --sync {sync} --steps 16
    assert len(run.steps) == 2 * 16
    assert _ranks(findings) == {}, [(f.id, f.summary) for f in findings if f.analyzer == "ranks"]


def test_straggler_under_cpu_load_is_the_same_rank_and_cause(recorded):
    run, findings = recorded("loaded-ddp-gc")  # two CPU burners beside; --sync ddp --slow-rank 0 --cause gc
    f = _ranks(findings)["ranks.straggler"]
    assert (f.evidence["straggler"], f.evidence["cause"]) == ("0", "gc")
    assert f.cause == "gc.gen2_in_step"


def test_the_loaded_machine_names_no_thread_call_of_another_job_in_the_same_folder(recorded):
    """tests/jobs/ holds other jobs' scripts beside straggler_train.py (checkpoint_every.py sets
    torch.set_num_threads(1)): the threads finding reads only the files the run shows it ran."""
    run, findings = recorded("pipeline")
    threads = [f for f in findings if f.analyzer == "threads"]
    assert threads, [f.id for f in findings]  # the machine was loaded (load average 15-22)
    for f in threads:
        call = f.evidence.get("thread_call")
        assert call is None or call["file"].endswith("straggler_train.py"), call
        assert "checkpoint_every.py" not in f.summary + str(f.evidence["threads_from"])
