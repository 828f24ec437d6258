"""Ray Train under diagnose, with the real Ray (CPU, gloo): TorchTrainer runs the training loop in
worker actors that Ray's raylet starts, not the command diagnose started.

1. A local cluster: `diagnose -- python driver.py`, the driver's ray.init() starts the cluster
   (GCS, raylet, Ray's Python helpers) as its own children, so the workers inherit the shim.
2. A cluster of two "nodes" on this machine: `diagnose --run-dir RUN -- ray start --head --block`
   and `diagnose --run-dir RUN -- ray start --address HEAD --block` (the second one with its wall
   clock shifted by libfaketime), a plain driver submitting the job, the nodes stopped with
   SIGTERM (as scancel or a pod deletion does), then `diagnose merge RUN`.

Ray on 2 cores is heavy: no dashboard, no usage stats, one CPU per node, no drain wait on SIGTERM.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest
from helpers import PY, ROOT, diagnose, only_run_dir

import traindx
from traindx.profiler import nodes

JOB = os.path.join(ROOT, "tests", "jobs", "ray_train.py")
RAY = os.path.join(os.path.dirname(PY), "ray")
STEPS = 6
SHIFT_S = -6.5
RAY_ENV = {
    "OMP_NUM_THREADS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    # a local test cluster: no token to hand from the head to the other node
    "RAY_AUTH_MODE": "disabled",
    # SIGTERM on a node waits up to 30 s for the cluster to drain it by default
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_tmp():
    """A Ray temp dir of the test's own: a node stopped by a signal leaves its address in
    <temp>/ray/ray_current_cluster, where the next ray.init() would try to join the dead cluster.
    Short, under /tmp: Ray's unix sockets live below it (a socket path has at most 107 bytes)."""
    path = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def ray_env(ray_tmp, **extra):
    env = dict(os.environ, **RAY_ENV, RAY_TMPDIR=ray_tmp, **extra)
    for name in ("TRAINDX_RUN_DIR", "RAY_ADDRESS"):
        env.pop(name, None)
    return env


def assert_ranks_of_ray_workers(run):
    """Ranks 0 and 1 with STEPS steps each, in processes that Ray started (not the driver's or
    the node command's children by diagnose's hand); no other process is a rank, and py-spy
    recorded the ranks only."""
    assert run.ranks == ["0", "1"], run.processes.to_dict("records")
    assert run.steps.groupby("rank").size().to_dict() == {"0": STEPS, "1": STEPS}
    procs = run.processes
    ranked = procs[procs["label"].notna()]
    # a Ray worker execs itself once at start (setup_worker -> default_worker): one pid, two
    # events files, the same rank; every other process of Ray's (helpers, idle workers) is none
    assert sorted(set(ranked["label"])) == ["0", "1"]
    assert ranked.groupby("label")["pid"].nunique().to_dict() == {"0": 1, "1": 1}
    assert set(ranked[ranked["evidence"].notna()]["evidence"]) == {"init_process_group"}
    assert len(procs[procs["label"].isna()]) >= 4, procs.to_dict("records")  # Ray's own Pythons
    assert {int(p) for p in run.manifest["ranks"].values()} == set(ranked["pid"])
    if "pyspy" not in run.missing:
        assert sorted(run.pyspy) == [("0", "all"), ("0", "gil"), ("1", "all"), ("1", "gil")]
        assert set(run.dumps["rank"]) == {"0", "1"}


@pytest.mark.slow
def test_ray_train_on_a_local_cluster_started_by_the_driver(tmp_path, ray_tmp):
    proc = diagnose(
        ["--out", "runs", "--quiet", "--", PY, JOB, "--steps", str(STEPS)],
        cwd=tmp_path,
        env=ray_env(ray_tmp),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run = traindx.load_run(only_run_dir(tmp_path / "runs"))
    assert_ranks_of_ray_workers(run)
    driver = run.processes[run.processes["argv"].map(lambda a: JOB in (a or []))]
    assert len(driver) == 1 and driver["label"].isna().all()  # the driver is never a rank
    ranked = run.processes[run.processes["label"].notna()]
    # the workers are the raylet's children (a native process), not the driver's
    assert not set(ranked["ppid"]) & set(run.processes["pid"]), run.processes.to_dict("records")
    assert os.path.exists(os.path.join(run.path, "report.html"))
    assert "steps recorded on 2 rank(s)" in proc.stdout + proc.stderr


def wait_for_port(port, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the head node's diagnose ended before its GCS listened"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"nothing listens on {port} after {timeout} s")


@pytest.mark.slow
def test_ray_cluster_of_two_nodes_under_diagnose_merges_into_one_run(tmp_path, ray_tmp):
    from test_multinode import faketime_library

    library = faketime_library()
    shifted = (
        {"LD_PRELOAD": library, "FAKETIME": f"{SHIFT_S:+}", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
        if library
        else {}
    )
    gcs = free_port()
    common = ["--num-cpus", "1", "--block", "--disable-usage-stats"]
    logs = {}

    def node(name, args, env):
        logs[name] = open(tmp_path / f"{name}.out", "w")
        ports = ["--dashboard-agent-listen-port", str(free_port())]  # two nodes on one host
        return subprocess.Popen(
            [PY, "-m", "traindx", "--run-dir", "RUN", "--quiet", "--", RAY, "start", *args, *common, *ports],
            cwd=tmp_path,
            env=env,
            stdout=logs[name],
            stderr=subprocess.STDOUT,
        )

    def log(name):
        return (tmp_path / f"{name}.out").read_text()[-3000:]

    head = node("head", ["--head", "--port", str(gcs), "--include-dashboard", "false"], ray_env(ray_tmp))
    worker = None
    try:
        wait_for_port(gcs, head)
        worker = node("worker", ["--address", f"127.0.0.1:{gcs}"], ray_env(ray_tmp, **shifted))
        # the driver, not under diagnose: one worker per node (STRICT_SPREAD waits for both)
        driver = subprocess.run(
            [
                PY,
                JOB,
                "--steps",
                str(STEPS),
                "--address",
                f"127.0.0.1:{gcs}",
                "--spread",
                "--storage",
                str(tmp_path / "ray_results"),
            ],
            cwd=tmp_path,
            env=ray_env(ray_tmp),
            text=True,
            capture_output=True,
            timeout=420,
        )
        assert driver.returncode == 0, driver.stdout[-2000:] + driver.stderr[-3000:]
    finally:
        for p in (worker, head):  # stopped the way scancel / a pod deletion stops a node
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = {n: p.wait(timeout=120) for n, p in (("worker", worker), ("head", head)) if p}
        for f in logs.values():
            f.close()

    parts = nodes.node_dirs(tmp_path / "RUN")
    host = socket.gethostname().split(".")[0]
    assert sorted(parts) == sorted([f"{host}-head", host]), (os.listdir(tmp_path / "RUN"), log("head"))
    for name, path in parts.items():
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
        role = "head" if name.endswith("-head") else "worker"
        assert manifest["node"]["source"] == ("ray start --head" if role == "head" else "ray start --address")
        assert manifest["signals_forwarded"] == ["SIGTERM"]
        # diagnose exits with the node command's own status (Ray's `ray start --block` exits 1
        # on SIGTERM, with or without diagnose)
        assert codes[role] == manifest["exit_code"], (codes, log(role))
        alone = traindx.load_run(path)
        assert len(alone.ranks) == 1 and len(alone.steps) == STEPS, log(role)

    proc = diagnose(["merge", "RUN"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run = traindx.load_run(tmp_path / "RUN")
    assert_ranks_of_ray_workers(run)
    assert sorted(run.manifest["rank_nodes"].values()) == sorted(parts)  # one rank per node
    with open(tmp_path / "RUN" / "clock.json") as f:
        clock = json.load(f)
    assert clock["consistent"], clock
    est = clock["nodes"][host]["offset_ns"] - clock["nodes"][f"{host}-head"]["offset_ns"]
    err = clock["nodes"][host]["error_ns"] + clock["nodes"][f"{host}-head"]["error_ns"]
    true = -SHIFT_S * 1e9 if library else 0.0  # the worker's timestamps need +6.5 s
    assert abs(est - true) <= err and err < 0.5e9, clock
    # after merging the two ranks' step ends agree (one all_reduce per step binds them)
    ends = run.steps.pivot(index="step", columns="rank", values="end_ns")
    assert (ends["0"] - ends["1"]).abs().max() < 0.5e9, ends


@pytest.mark.parametrize(
    "command,expected",
    [
        (["ray", "start", "--head", "--block", "--port", "6379"], ("h-head", "ray start --head")),
        (["/venv/bin/ray", "start", "--address=10.0.0.1:6379", "--block"], ("h", "ray start --address")),
        (["ray", "status"], None),
    ],
)
def test_ray_node_identity(command, expected):
    assert nodes.node_identity(command, {}, hostname="h.cluster") == expected


def test_ray_start_without_block_is_refused_in_one_line(tmp_path):
    proc = diagnose(["--run-dir", "RUN", "--", RAY, "start", "--head"], cwd=tmp_path)
    assert proc.returncode != 0
    assert "ray start --block" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "RUN" / "nodes").exists()  # nothing was started


def test_ray_node_needs_a_shared_run_dir(tmp_path):
    proc = diagnose(["--", RAY, "start", "--head", "--block"], cwd=tmp_path)
    assert proc.returncode != 0 and "--run-dir" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_events_are_written_when_the_process_group_is_destroyed_before_a_quick_exit(tmp_path):
    """Ray Train destroys each worker's process group, then ray.kill ends the worker without
    atexit: the steps the writer still queued must be on disk by then (the steps here take
    microseconds, so without the flush the last ones sit in the 0.25 s queue and are lost)."""
    job = os.path.join(ROOT, "tests", "jobs", "quick_exit_train.py")
    proc = diagnose(
        ["--out", "runs", "--quiet", "--no-pyspy", "--", PY, job, "5"],
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run = traindx.load_run(only_run_dir(tmp_path / "runs"))
    assert run.ranks == ["0"]
    assert len(run.steps) == 5, run.steps
