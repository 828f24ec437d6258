"""`diagnose -- <cmd>` on real jobs: the run record, exit codes, signals, the shim's manners."""

import json
import os
import shutil
import signal
import subprocess
import textwrap
import time

import pytest
from helpers import PY, diagnose, example, only_run_dir

import traindx
from traindx.common.errors import UserError
from traindx.derive.run import CorruptEvidenceWarning, TruncatedEvidenceWarning

TINY = example("train_tiny.py")
SECRETS = {"HF_TOKEN": "hf_abc123", "MY_API_KEY": "k-999", "DB_PASSWORD": "pw", "PLAIN_SETTING": "visible"}


@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
    """The example under diagnose as a user runs it (py-spy on), once for the checks below: its
    environment also holds secrets (for the manifest's redaction) and a sitecustomize of the
    user's own on PYTHONPATH (which must still run beside the shim)."""
    tmp = tmp_path_factory.mktemp("example")
    site = tmp / "site"
    site.mkdir()
    marker = tmp / "marker"
    (site / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    env = {"PYTHONPATH": str(site), **SECRETS}
    proc = diagnose(["--out", "runs", "--steps", "6", "--", PY, TINY, "--steps", "50"], cwd=tmp, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc, only_run_dir(tmp / "runs"), marker


@pytest.mark.slow
def test_records_the_steps_of_the_example(example_run):
    proc, run_dir, _ = example_run
    run = traindx.load_run(run_dir)
    steps = run.steps
    # --steps 6 stops the job cleanly after six optimizer steps
    assert list(steps["step"]) == [0, 1, 2, 3, 4, 5]
    assert steps["duration_s"].between(0.001, 30).all()
    # the job's own log agrees with the shim on the number of steps it made
    assert list(run.log_steps["step"]) == [1, 2, 3, 4, 5, 6]
    assert run.log_steps["loss"].notna().all()
    assert run.manifest["exit_code"] == 0
    assert run.manifest["packages"]["torch"].startswith("2.")
    # py-spy evidence of the rank, unless py-spy is missing on this machine
    if "pyspy" not in run.missing:
        assert ("0", "all") in run.pyspy and ("0", "gil") in run.pyspy
        main = [t for t in run.pyspy[("0", "all")].values() if len(t.stacks) > 5]
        assert main, "py-spy recorded no samples"
    # the summary names the run folder and the step count
    assert "6 steps recorded" in proc.stderr


@pytest.mark.slow  # a real job under diagnose
def test_job_exit_code_passes_through(tmp_path):
    proc = diagnose(
        ["--out", "runs", "--no-pyspy", "--", PY, TINY, "--steps", "2", "--exit-code", "3"], cwd=tmp_path
    )
    assert proc.returncode == 3
    run = traindx.load_run(only_run_dir(tmp_path / "runs"))
    assert run.manifest["exit_code"] == 3
    assert len(run.steps) == 2


ABORT_JOB = textwrap.dedent("""
    import os
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    def teardown():
        os.abort()  # what a C++ std::terminate at exit does

    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # a forked worker process: it gets no fault file and never writes into the job's
    loader = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4, num_workers=1,
                        multiprocessing_context="fork")
    for step, (x,) in enumerate(loader):
        loss = model(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.3f}", flush=True)
    teardown()
""")


@pytest.mark.slow  # 21-23 s: two diagnose runs
def test_a_job_that_aborts_is_named_with_the_line_it_crashed_at(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(ABORT_JOB)
    proc = diagnose(["--out", "runs", "--no-pyspy", "--", PY, str(script)], cwd=tmp_path)
    assert proc.returncode == -signal.SIGABRT, proc.stderr[-2000:]  # ends by the job's signal, as bare
    assert "The job ended by SIGABRT (exit 134)" in " ".join(proc.stderr.split()), proc.stderr
    run = traindx.load_run(only_run_dir(tmp_path / "runs"))
    (ended,) = [f for f in traindx.analyze(run) if f.id == "job.exit"]
    line = ABORT_JOB.splitlines().index("    os.abort()  # what a C++ std::terminate at exit does") + 1
    assert ended.evidence["crashed_at"] == {"rank 0": f"{script}:{line} in teardown"}
    assert ended.evidence["signal"].startswith("SIGABRT")
    assert os.listdir(os.path.join(run.path, "faults")) == [f"p{run.manifest['ranks']['0']}.txt"]
    # a job that turned faulthandler on itself keeps it: the stacks go to its stderr (log.txt)
    proc = diagnose(
        ["--run-dir", "own", "--no-pyspy", "--", PY, str(script)],
        cwd=tmp_path,
        env={"PYTHONFAULTHANDLER": "1"},
    )
    run = traindx.load_run(str(tmp_path / "own"))
    assert proc.returncode == -signal.SIGABRT and run.fault_stacks == {}
    assert any("in teardown" in t for t in run.log["text"])


@pytest.mark.slow
def test_sigterm_leaves_a_loadable_partial_run(tmp_path):
    env = dict(os.environ)
    proc = subprocess.Popen(
        [PY, "-m", "traindx", "--out", "runs", "--", PY, TINY, "--steps", "100000"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    events = tmp_path / "runs"
    # wait until the job has made a few steps
    while time.time() < deadline:
        files = list(events.glob("*/events/p*.jsonl"))
        if files and files[0].read_text().count('"step_end"') >= 3:
            break
        time.sleep(0.3)
    else:
        proc.kill()
        pytest.fail("the job never made 3 steps")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM  # the job's death by SIGTERM, passed on
    run = traindx.load_run(only_run_dir(events))
    assert len(run.steps) >= 3
    assert run.manifest["signals_forwarded"] == ["SIGTERM"]
    assert run.manifest["end_ns"] is not None
    assert os.path.exists(os.path.join(run.path, "findings.json"))


@pytest.mark.slow
def test_default_torch_profile_window_stands_down_on_a_cpu_job(example_run):
    # (moved here from tests/test_analyzers.py: this run has diagnose's default options)
    run = traindx.load_run(example_run[1])
    skipped = run.events[run.events["type"] == "torch_profile_skipped"]
    assert "no CUDA" in skipped["reason"].iloc[0]
    assert not len(run.events[run.events["type"] == "torch_profile"])


@pytest.mark.slow
def test_existing_sitecustomize_still_runs(example_run):
    _, run_dir, marker = example_run  # the user's sitecustomize was first on PYTHONPATH
    assert marker.read_text() == "ran"
    assert len(traindx.load_run(run_dir).steps) == 6  # and the shim ran too


# torchrun's two ranks each with their own events and steps, one py-spy sampler per worker and
# none for the agent: tests/test_launchers.py (test_torchrun_with_spawned_dataloader_workers,
# assert_two_ranks), which checks that and more on a torchrun job of its own


def test_unknown_command_is_a_one_line_error(tmp_path):
    proc = diagnose(["--", "no-such-trainer-xyz", "--steps", "1"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "diagnose: error: command not found: no-such-trainer-xyz"
    assert not (tmp_path / "runs").exists()


def test_no_command_is_a_one_line_error(tmp_path):
    proc = diagnose([], cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "no command given" in proc.stderr


@pytest.mark.slow
def test_secrets_are_redacted_in_the_manifest(example_run):
    _, run_dir, _ = example_run  # SECRETS were in the job's environment
    text = open(os.path.join(run_dir, "manifest.json")).read()
    for secret in ("hf_abc123", "k-999", '"pw"'):
        assert secret not in text
    env = json.loads(text)["env"]
    assert env["HF_TOKEN"] == env["MY_API_KEY"] == env["DB_PASSWORD"] == "<redacted>"
    assert env["PLAIN_SETTING"] == "visible"


@pytest.mark.slow
def test_missing_evidence_is_recorded_not_fatal(tmp_path):
    # no NVML on a CPU machine; py-spy switched off: the job still runs to its end
    proc = diagnose(
        ["--out", "runs", "--no-pyspy", "--", PY, TINY, "--steps", "2"],
        cwd=tmp_path,
        env={"PATH": os.path.dirname(PY) + os.pathsep + "/usr/bin:/bin"},
    )
    assert proc.returncode == 0
    run = traindx.load_run(only_run_dir(tmp_path / "runs"))
    assert "pyspy" in run.missing
    if not run.manifest["gpus"]:
        assert "nvml" in run.missing


@pytest.mark.slow  # a job under diagnose
def test_a_failing_shim_hook_does_not_harm_the_job(tmp_path):
    # a job whose import of a hooked module makes our hook fail: the job runs on and the
    # failure lands in the events as a shim_error
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import sys, types
        import _traindx_shim
        from _traindx_shim import importhooks
        importhooks.on_import("json.tool", lambda m: 1 / 0)
        import json.tool
        print("job finished")
    """)
    )
    proc = diagnose(["--out", "runs", "--no-pyspy", "--", PY, str(script)], cwd=tmp_path)
    assert proc.returncode == 0
    assert "job finished" in proc.stdout
    run = traindx.load_run(only_run_dir(tmp_path / "runs"))
    errors = run.events[run.events["type"] == "shim_error"]
    assert "ZeroDivisionError" in errors["error"].iloc[0]


def test_load_run_rejects_a_folder_that_is_not_a_run(tmp_path):
    with pytest.raises(UserError, match="not a traindx run"):
        traindx.load_run(tmp_path)
    proc = diagnose(["report", str(tmp_path)], cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_truncated_and_corrupt_event_lines_are_skipped_with_a_warning(tmp_path, example_run):
    # a copy of the example's run (any cached tables left behind: the events are read again)
    run_dir = str(tmp_path / "run")
    shutil.copytree(example_run[1], run_dir, ignore=shutil.ignore_patterns("tables"))
    (events,) = [os.path.join(run_dir, "events", n) for n in os.listdir(os.path.join(run_dir, "events"))]
    with open(events, "a") as f:
        f.write('{"type": "step_end", "step": 6, "t": 17')  # what a killed job leaves
    with pytest.warns(TruncatedEvidenceWarning, match="last line is truncated"):
        run = traindx.load_run(run_dir)
    assert len(run.steps) == 6
    # a corrupt line anywhere (a disk fault, a bad copy): skipped, the file and line named
    with open(events) as f:
        lines = f.read().splitlines()[:-1]
    lines[3:3] = ["{garbage", '"not an event"', '{"type": "step_end", "step": "x", "t": 5}']
    with open(events, "w") as f:
        f.write("\n".join(lines) + "\n")
    with pytest.warns(CorruptEvidenceWarning) as caught:
        run = traindx.load_run(run_dir)
    assert f"{events}: corrupt lines 4, 5, 6 skipped" in str(caught[0].message)
    assert len(run.steps) == 6
    # the commands on the run work, and say what they skipped in one line
    for command in (["report", run_dir], ["analyze", run_dir]):
        proc = diagnose(command, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "Traceback" not in proc.stderr
        assert f"diagnose: warning: {events}: corrupt lines 4, 5, 6 skipped" in proc.stderr


SIGNAL_JOB = textwrap.dedent("""
    import json, os, signal, sys
    def handlers():
        return {s.name: repr(signal.getsignal(s)) for s in signal.Signals
                if s not in (signal.SIGKILL, signal.SIGSTOP)}
    at_start = handlers()
    import torch
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
    after_training = handlers()
    # the job's own SIGTERM handler, chaining the previous one as Lightning's does
    previous = signal.getsignal(signal.SIGTERM)
    seen = []
    def on_term(signum, frame):
        seen.append(signum)
        if callable(previous):
            previous(signum, frame)
    signal.signal(signal.SIGTERM, on_term)
    model(torch.randn(2, 4)).sum().backward(); opt.step()
    mine = signal.getsignal(signal.SIGTERM) is on_term
    os.kill(os.getpid(), signal.SIGTERM)
    print(json.dumps({"at_start": at_start, "after_training": after_training,
                      "previous": repr(previous), "mine": mine, "seen": seen}))
""")


@pytest.mark.slow
def test_the_job_sees_only_its_own_signal_handlers(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SIGNAL_JOB)
    bare = subprocess.run([PY, str(script)], capture_output=True, text=True, timeout=120)
    proc = diagnose(["--out", "runs", "--no-pyspy", "--", PY, str(script)], cwd=tmp_path)
    assert bare.returncode == 0 and proc.returncode == 0, proc.stderr
    bare, under = json.loads(bare.stdout), json.loads(proc.stdout.strip().splitlines()[-1])
    assert under["at_start"] == bare["at_start"]
    assert under["after_training"] == bare["after_training"]  # hooks installed, nothing changed
    assert under["previous"] == repr(signal.SIG_DFL)
    assert under["mine"] and under["seen"] == [signal.SIGTERM]
    assert len(traindx.load_run(only_run_dir(tmp_path / "runs")).steps) >= 3

    # started with hang-ups ignored (nohup, a background job): the job ignores them too
    def nohup():
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    bare = subprocess.run([PY, str(script)], capture_output=True, text=True, timeout=120, preexec_fn=nohup)
    proc = diagnose(
        ["--run-dir", str(tmp_path / "nohup"), "--no-pyspy", "--", PY, str(script)],
        cwd=tmp_path,
        preexec_fn=nohup,
    )
    assert bare.returncode == 0 and proc.returncode == 0, proc.stderr
    bare, under = json.loads(bare.stdout), json.loads(proc.stdout.strip().splitlines()[-1])
    assert bare["at_start"]["SIGHUP"] == repr(signal.SIG_IGN)
    assert under["at_start"] == bare["at_start"] and under["after_training"] == bare["after_training"]


@pytest.mark.slow
def test_sigterm_during_a_long_c_call_ends_the_job_at_once(tmp_path):
    # a native wait that only a signal's default action interrupts: a Python-level SIGTERM
    # handler would run only after it returns (300 s)
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import datetime, os
        import torch, torch.distributed as dist
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=300))
        print("waiting", os.getpid(), flush=True)
        store.wait(["never-set"])
        print("the wait returned", flush=True)
    """)
    )
    proc = subprocess.Popen(
        [PY, "-m", "traindx", "--out", "runs", "--no-pyspy", "--", PY, str(script)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pid = None
    for line in proc.stdout:
        if line.startswith("waiting"):
            pid = int(line.split()[1])
            break
    assert pid, proc.stderr.read()
    events = tmp_path / "runs"
    deadline = time.time() + 30
    while time.time() < deadline:  # the three steps are on disk before the signal
        files = list(events.glob(f"*/events/p{pid}.jsonl"))
        if files and files[0].read_text().count('"step_end"') == 3:
            break
        time.sleep(0.1)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    # the signal's default action ends the job at once; a handler in Python would run only when
    # the native wait returns (its 300 s timeout): 60 s tells the two apart at any load
    while os.path.exists(f"/proc/{pid}") and time.time() - sent < 90:
        time.sleep(0.05)
    gone_after = time.time() - sent
    out, err = proc.communicate(timeout=400)
    assert gone_after < 60, f"the job took {gone_after:.1f} s to end"
    assert "the wait returned" not in out
    assert proc.returncode == -signal.SIGTERM  # the job's death by SIGTERM, passed on
    run = traindx.load_run(only_run_dir(events))
    assert len(run.steps) == 3  # written before the signal, still there
    assert run.manifest["signals_forwarded"] == ["SIGTERM"]
