"""Every launcher, every rank: one events file and one py-spy pair per training process, the
rank each process learned, no steps for the launcher. Real launchers, CPU, gloo.

Each job makes 6 optimizer steps per rank with a 0.3 s wait per step (its "data"), so py-spy,
which attaches when a process shows training evidence, has time to sample.
"""

import os
import socket

import pytest
from helpers import PY, ROOT, diagnose, only_run_dir

import traindx

JOBS = os.path.join(ROOT, "tests", "jobs")
BIN = os.path.dirname(PY)
STEPS = 6


def job(name):
    return os.path.join(JOBS, name)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_under_diagnose(tmp_path, command, env=None):
    proc = diagnose(
        ["--out", "runs", "--", *command],
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1", "PYTHON": PY, **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return traindx.load_run(only_run_dir(tmp_path / "runs"))


def assert_two_ranks(run, launchers=()):
    """Ranks 0 and 1, each with its own events file and STEPS steps; py-spy on both (when
    py-spy can attach here); the launcher processes recorded no steps and are no rank."""
    assert run.ranks == ["0", "1"], (run.ranks, run.processes.to_dict("records"))
    assert run.steps.groupby("rank").size().to_dict() == {"0": STEPS, "1": STEPS}
    procs = run.processes
    ranked = procs[procs["label"].notna()]
    assert sorted(ranked["label"]) == ["0", "1"]
    assert ranked["file"].is_unique and ranked["pid"].is_unique  # never one file for two
    assert sorted(run.manifest["ranks"]) == ["0", "1"]
    assert {int(p) for p in run.manifest["ranks"].values()} == set(ranked["pid"])
    for argv_part in launchers:  # e.g. the torchrun agent: seen by the shim, not a rank
        launcher = procs[
            procs["argv"].map(lambda a: any(argv_part in x for x in a or []))  # noqa: B023
            & procs["label"].isna()
        ]
        assert len(launcher) >= 1, (argv_part, procs.to_dict("records"))
    # py-spy evidence of both ranks, unless py-spy cannot attach on this machine (then the
    # manifest says why; a manager that never attached would leave no reason and fail here)
    if "pyspy" not in run.missing:
        for rank in ("0", "1"):
            assert (rank, "all") in run.pyspy and (rank, "gil") in run.pyspy, sorted(run.pyspy)
        assert set(run.dumps["rank"]) == {"0", "1"}


@pytest.mark.slow
def test_torchrun_with_spawned_dataloader_workers(tmp_path):
    run = run_under_diagnose(
        tmp_path,
        [
            os.path.join(BIN, "torchrun"),
            "--nproc-per-node",
            "2",
            "--master-port",
            free_port(),
            job("ddp_train.py"),
            "--workers",
            "1",
            "--worker-start",
            "spawn",
        ],
    )
    assert_two_ranks(run, launchers=["torchrun"])
    # the spawned DataLoader workers ran the shim too, yet wrote nothing
    assert len(run.processes) == 3, run.processes.to_dict("records")


@pytest.mark.slow
def test_python_m_torch_distributed_run(tmp_path):
    run = run_under_diagnose(
        tmp_path,
        [
            PY,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            free_port(),
            job("ddp_train.py"),
            "--workers",
            "1",
            "--worker-start",
            "fork",
        ],
    )
    assert_two_ranks(run, launchers=["-m"])
    assert len(run.processes) == 3  # forked DataLoader workers stay silent


@pytest.mark.slow
def test_torch_multiprocessing_spawn(tmp_path):
    run = run_under_diagnose(tmp_path, [PY, job("spawn_train.py"), free_port()])
    assert_two_ranks(run, launchers=["spawn_train.py"])
    ranks = run.processes[run.processes["label"].notna()]
    assert set(ranks["evidence"]) == {"init_process_group"}


@pytest.mark.slow
def test_forked_ranks(tmp_path):
    run = run_under_diagnose(tmp_path, [PY, job("fork_train.py"), free_port()])
    assert_two_ranks(run, launchers=["fork_train.py"])


@pytest.mark.slow
def test_accelerate_launch(tmp_path):
    run = run_under_diagnose(
        tmp_path,
        [
            os.path.join(BIN, "accelerate"),
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            free_port(),
            job("accelerate_train.py"),
        ],
    )
    assert_two_ranks(run, launchers=["launch"])


@pytest.mark.slow
def test_lightning_ddp_where_the_parent_is_rank_0(tmp_path):
    run = run_under_diagnose(tmp_path, [PY, job("lightning_train.py")], env={"MASTER_PORT": free_port()})
    assert_two_ranks(run)
    # Lightning's parent is rank 0 itself; it learned that from its process group
    parent = run.processes[run.processes["label"] == "0"].iloc[0]
    child = run.processes[run.processes["label"] == "1"].iloc[0]
    assert child["ppid"] == parent["pid"]


@pytest.mark.slow
def test_srun_style_rank_set_by_the_job(tmp_path):
    run = run_under_diagnose(tmp_path, ["bash", job("srun_like.sh"), free_port()])
    assert_two_ranks(run)
    starts = run.events[run.events["type"] == "process_start"]
    assert set(starts["rank_source"]) == {"SLURM_PROCID"}
    known = run.events[run.events["type"] == "rank_known"]
    assert sorted(known["rank"]) == ["0", "1"] and set(known["source"]) == {"process_group"}


@pytest.mark.slow
def test_bare_parent_launching_worker_pythons(tmp_path):
    run = run_under_diagnose(tmp_path, [PY, job("launch_workers.py"), job("ddp_train.py"), free_port()])
    assert_two_ranks(run, launchers=["launch_workers.py"])


def test_one_rank_in_several_processes_is_kept_apart_deterministically():
    from traindx.profiler.shim._traindx_shim.roles import rank_labels

    # a restarted rank 1 (new pid, later start), and a process that never learned its rank
    procs = [
        {"pid": 300, "rank": "1", "start": 50},
        {"pid": 100, "rank": "0", "start": 10},
        {"pid": 200, "rank": "1", "start": 10},
        {"pid": 50, "rank": None, "start": 1},
    ]
    labels = rank_labels(procs)
    assert labels == {100: "0", 200: "1", 300: "1-p300", 50: "0-p50"}
    assert rank_labels(list(reversed(procs))) == labels


@pytest.mark.slow
def test_without_the_shim_py_spy_samples_the_ranks_not_the_launcher(tmp_path):
    proc = diagnose(
        [
            "--out",
            "runs",
            "--no-shim",
            "--",
            os.path.join(BIN, "torchrun"),
            "--nproc-per-node",
            "2",
            "--master-port",
            free_port(),
            job("ddp_train.py"),
        ],
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = traindx.load_run(only_run_dir(tmp_path / "runs"))
    if "pyspy" in run.missing:
        pytest.skip(f"py-spy cannot attach here: {run.missing['pyspy']}")
    assert sorted(run.manifest["ranks"]) == ["0", "1"]  # from each worker's RANK
    assert sorted(run.pyspy) == [("0", "all"), ("0", "gil"), ("1", "all"), ("1", "gil")]
