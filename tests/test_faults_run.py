"""Fault rows of recording a run (issue 23, items 1-3): the job never depends on diagnose staying
alive, one run per folder, and a full disk is one line per file not written with the job's exit
code passed through. Real processes, real signals, a real full filesystem (a small tmpfs in a
user+mount namespace: `unshare -rm`, no privilege needed where user namespaces are allowed)."""

import json
import os
import shutil
import signal
import subprocess
import textwrap
import time

import pytest
from helpers import PY, diagnose

import traindx

# a job that prints on both streams every step and says, in a file, that it ended normally
SLOW_JOB = textwrap.dedent("""
    import sys, time, torch
    steps, marker = int(sys.argv[1]), sys.argv[2]
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
        print(f"step {step + 1} loss 0.5", flush=True)
        print(f"progress {step + 1}", file=sys.stderr, flush=True)
        time.sleep(0.15)
    print("job finished", flush=True)
    open(marker, "w").write("ended normally")
""")


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRAINDX_RUN_DIR", None)
    return env


def _wait_for(predicate, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def _step_ends(run_dir):
    return sum(p.read_text(errors="replace").count('"step_end"') for p in run_dir.glob("events/*.jsonl"))


def _diagnose_bg(args, cwd, out, err):
    return subprocess.Popen(
        [PY, "-m", "traindx", *args], cwd=cwd, env=_env(), stdout=out, stderr=err, stdin=subprocess.DEVNULL
    )


@pytest.mark.slow
def test_sigkill_of_diagnose_leaves_the_job_running_and_reanalysis_finishes_the_run(tmp_path):
    job, marker, run_dir = tmp_path / "job.py", tmp_path / "ended", tmp_path / "run"
    job.write_text(SLOW_JOB)
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = _diagnose_bg(
            ["--run-dir", str(run_dir), "--no-pyspy", "--", PY, str(job), "40", str(marker)],
            tmp_path,
            out,
            err,
        )
    try:
        _wait_for(lambda: _step_ends(run_dir) >= 3, 120, "3 steps")
    finally:
        proc.kill()  # SIGKILL: no handler, no cleanup in diagnose
        proc.wait(30)
    killed_at = _step_ends(run_dir)
    assert killed_at < 40
    # the job goes on printing on both streams and ends as it would have without diagnose
    _wait_for(marker.exists, 120, "the job to end after diagnose was killed")
    assert marker.read_text() == "ended normally"
    _wait_for(lambda: "job finished" in (run_dir / "log.txt").read_text(), 30, "the log's end")
    assert "job finished" in (tmp_path / "out.txt").read_text()  # still on the terminal
    log = (run_dir / "log.txt").read_text()
    assert "o step 40 loss 0.5" in log and "e progress 40" in log
    stamps = [int(line.split(" ", 1)[0]) for line in log.splitlines()]
    assert stamps == sorted(stamps)
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "running"

    proc = diagnose(["report", str(run_dir), "--reanalyze", "--quiet"], cwd=tmp_path, env=_env())
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "interrupted" in proc.stderr
    run = traindx.load_run(str(run_dir))
    assert run.manifest["status"] == "interrupted"
    assert "recorder" in run.missing and run.manifest["end_ns"]
    assert list(run.manifest["ranks"]) == ["0"]
    assert len(run.steps) == 40  # the steps after the kill are in the run too
    assert len(run.log_steps) == 40
    assert (run_dir / "report.html").exists()


DAEMON_JOB = textwrap.dedent("""
    import subprocess, sys
    # a helper left running after the job's end (a log shipper, a data server), printing into
    # the job's own stdout and stderr, which it inherited
    child = '''
    import os, sys, time
    folder = sys.argv[1]
    open(os.path.join(folder, "daemon.pid"), "w").write(str(os.getpid()))
    while not os.path.exists(os.path.join(folder, "stop")):
        print("daemon tick", flush=True)
        print("daemon tock", file=sys.stderr, flush=True)
        time.sleep(0.1)
    print("daemon last line", flush=True)
    open(os.path.join(folder, "daemon.done"), "w").write("printed its last line")
    '''
    subprocess.Popen([sys.executable, "-c", child, sys.argv[1]])
    print("job done", flush=True)
""")


@pytest.mark.slow
def test_a_daemon_the_job_starts_outlives_diagnose_which_does_not_wait_for_it(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(DAEMON_JOB)
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = _diagnose_bg(
            ["--run-dir", str(tmp_path / "run"), "--no-pyspy", "--", PY, str(job), str(tmp_path)],
            tmp_path,
            out,
            err,
        )
    try:
        # diagnose ends while the daemon still holds the job's output open
        assert proc.wait(240) == 0, (tmp_path / "err.txt").read_text()[-3000:]
        _wait_for((tmp_path / "daemon.pid").exists, 30, "the daemon")
        pid = int((tmp_path / "daemon.pid").read_text())
        os.kill(pid, 0)  # alive
        assert not (tmp_path / "daemon.done").exists()
        ticks = (tmp_path / "out.txt").read_text().count("daemon tick")
        _wait_for(
            lambda: (tmp_path / "out.txt").read_text().count("daemon tick") > ticks + 3,
            30,
            "the daemon's output after diagnose's end",
        )
    finally:
        (tmp_path / "stop").write_text("")
    # its last print after diagnose is gone reaches the terminal: no BrokenPipeError
    _wait_for((tmp_path / "daemon.done").exists, 60, "the daemon's last line")
    _wait_for(
        lambda: "daemon last line" in (tmp_path / "out.txt").read_text(),
        30,
        "the daemon's last line on the terminal",
    )
    err = (tmp_path / "err.txt").read_text()
    assert "Traceback" not in err and "BrokenPipe" not in err
    assert "job done" in (tmp_path / "run" / "log.txt").read_text()


WAITING_JOB = textwrap.dedent("""
    import os, sys, time, torch
    go = sys.argv[1]
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
        print(f"step {step + 1} loss 0.25", flush=True)
        while step == 1 and not os.path.exists(go):
            time.sleep(0.05)
""")


@pytest.mark.slow
def test_one_run_per_folder_in_use_refused_and_a_finished_one_never_merged_into(tmp_path):
    job, go, run_dir = tmp_path / "job.py", tmp_path / "go", tmp_path / "run"
    job.write_text(WAITING_JOB)
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        first = _diagnose_bg(
            ["--run-dir", str(run_dir), "--no-pyspy", "--", PY, str(job), str(go)], tmp_path, out, err
        )
    try:
        _wait_for(lambda: _step_ends(run_dir) >= 2, 120, "the first run's steps")
        second = diagnose(
            ["--run-dir", str(run_dir), "--no-pyspy", "--", PY, str(job), str(go)],
            cwd=tmp_path,
            env=_env(),
            timeout=120,
        )
        assert second.returncode == 2
        assert "Traceback" not in second.stderr
        (line,) = second.stderr.strip().splitlines()
        assert "in use" in line and str(run_dir) in line
    finally:
        go.write_text("")
    assert first.wait(240) == 0, (tmp_path / "err.txt").read_text()[-3000:]
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}

    third = diagnose(
        ["--run-dir", str(run_dir), "--no-pyspy", "--", PY, str(job), str(go)],
        cwd=tmp_path,
        env=_env(),
        timeout=120,
    )
    assert third.returncode == 2
    (line,) = third.stderr.strip().splitlines()
    assert "already holds a run" in line and "finished" in line
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    run = traindx.load_run(str(run_dir))
    assert len(run.steps) == 4 and list(run.manifest["ranks"]) == ["0"]
    assert len(list(run_dir.glob("events/p*.jsonl"))) == 1
    # a run folder that is a file is one line too
    (tmp_path / "afile").write_text("x")
    proc = diagnose(
        ["--run-dir", str(tmp_path / "afile"), "--", PY, "-c", "pass"], cwd=tmp_path, env=_env(), timeout=120
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# -- a full disk, for real -------------------------------------------------------------------
def _namespace_mounts():
    """A private tmpfs is possible here (unprivileged user namespaces, or root)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=16k none /mnt"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


needs_small_disk = pytest.mark.skipif(
    not _namespace_mounts(), reason="no user+mount namespace for a small tmpfs here"
)


def _in_small_disk(tmp_path, disk_kb, script, **env):
    """Run `script` (sh) with $DISK a fresh tmpfs of disk_kb KiB; $OUT stays on the real disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    full = dict(_env(), DISK=str(disk), OUT=str(tmp_path), PY=PY, **env)
    body = f'mount -t tmpfs -o size={disk_kb}k none "$DISK" && cd "$DISK" && {script}'
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", body], env=full, capture_output=True, text=True, timeout=400
    )


FILLING_JOB = textwrap.dedent("""
    import sys, time, torch
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
        print(f"step {step + 1} loss 0.5", flush=True)
        if step == 2:  # something else fills the disk (a checkpoint, another job)
            time.sleep(1)  # the first lines are in the log by then
            try:
                with open(sys.argv[1], "wb") as f:
                    while True:
                        f.write(b"x" * 4096)
                        f.flush()
            except OSError as exc:
                print("the disk is full:", exc.strerror, flush=True)
            for i in range(200):  # more than the log's last page holds
                print(f"after the disk filled: line {i:03d} " + "." * 80, flush=True)
            time.sleep(1.5)  # py-spy's dumps meet the full disk too
    sys.exit(5)
""")


@needs_small_disk
@pytest.mark.slow
def test_a_disk_that_fills_while_recording_is_one_line_per_file_and_the_exit_code_passes(tmp_path):
    (tmp_path / "job.py").write_text(FILLING_JOB)
    script = (
        '"$PY" -m traindx --quiet --dump-interval 0.3 --out "$DISK/runs" -- "$PY" "$OUT/job.py" '
        '"$DISK/filler" > "$OUT/out.txt" 2> "$OUT/err.txt"; echo $? > "$OUT/rc"; '
        'find "$DISK/runs" -name "*.tmp*" > "$OUT/stray"; cp -r "$DISK/runs" "$OUT/runs"'
    )
    proc = _in_small_disk(tmp_path, 512, script)
    assert proc.returncode == 0, proc.stderr
    err = (tmp_path / "err.txt").read_text()
    assert (tmp_path / "rc").read_text().strip() == "5", err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "the disk is full: No space left on device" in (tmp_path / "out.txt").read_text()
    terminal = (tmp_path / "out.txt").read_text()
    assert "step 6 loss" in terminal and "line 199" in terminal  # the terminal got it all
    not_written = [line for line in err.splitlines() if line.startswith("diagnose: not written")]
    assert any(
        "manifest.json was not finalised" in line and "No space left on device" in line
        for line in not_written
    ), err[-3000:]
    assert any("log.txt" in line for line in not_written), err[-3000:]
    assert (tmp_path / "stray").read_text() == ""  # no half-written .tmp left
    (run_dir,) = (tmp_path / "runs").iterdir()
    # nothing already written is lost: the manifest as it was, the log's first lines
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "running" and manifest["command"][-1].endswith("filler")
    assert "step 1 loss 0.5" in (run_dir / "log.txt").read_text()


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    """A small finished run (the same one for the re-analysis rows; each copies it first)."""
    folder = tmp_path_factory.mktemp("recorded")
    job = folder / "job.py"
    job.write_text(SLOW_JOB)
    proc = diagnose(
        [
            "--quiet",
            "--no-pyspy",
            "--run-dir",
            str(folder / "run"),
            "--",
            PY,
            str(job),
            "3",
            str(folder / "ended"),
        ],
        cwd=folder,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr
    return folder / "run"


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_reanalysis_past_a_file_size_limit_is_one_line_per_file_and_loses_nothing(tmp_path, recorded_run):
    # RLIMIT_FSIZE (ulimit -f) with SIGXFSZ ignored: the kernel refuses every write past 256 B
    # (EFBIG), as a full disk refuses them (ENOSPC); available to any user, CI included
    import resource

    run_dir = tmp_path / "run"
    shutil.copytree(recorded_run, run_dir)
    before = _files(run_dir)

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256, 256))

    proc = subprocess.run(
        [PY, "-m", "traindx", "report", str(run_dir), "--reanalyze", "--quiet"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if "not written" in line]
    assert {"findings.json", "ledger.csv", "report.html"} == {
        os.path.basename(line.split(" (")[0].split()[-1]) for line in lines
    }, proc.stderr
    assert all("File too large" in line for line in lines)
    after = _files(run_dir)
    assert after == before  # the previous findings, ledger and report whole; no stray .tmp


@needs_small_disk
@pytest.mark.slow
def test_reanalysis_on_a_full_disk_writes_elsewhere_only_and_loses_nothing(tmp_path, recorded_run):
    shutil.copytree(recorded_run, tmp_path / "run")
    script = (
        'cp -r "$OUT/run" "$DISK/run" && (dd if=/dev/zero of="$DISK/fill" bs=4k '
        '2>/dev/null; true) && (cd "$DISK/run" && find . -type f | sort | xargs sha256sum) '
        '> "$OUT/before"; '
        '"$PY" -m traindx report "$DISK/run" --reanalyze --quiet -o "$OUT/elsewhere.html" '
        '> "$OUT/out1" 2> "$OUT/err1"; echo $? > "$OUT/rc1"; '
        '"$PY" -m traindx report "$DISK/run" --reanalyze --quiet > "$OUT/out2" 2> "$OUT/err2"; '
        'echo $? > "$OUT/rc2"; (cd "$DISK/run" && find . -type f | sort | xargs sha256sum) '
        '> "$OUT/after"; rm "$DISK/fill"; mount -o remount,ro "$DISK" && '
        '"$PY" -m traindx report "$DISK/run" --reanalyze --quiet > "$OUT/out3" 2> "$OUT/err3"; '
        'echo $? > "$OUT/rc3"; "$PY" -m traindx --out "$DISK/runs" -- "$PY" -c pass '
        '> "$OUT/out4" 2> "$OUT/err4"; echo $? > "$OUT/rc4"'
    )
    proc = _in_small_disk(tmp_path, 1024, script)
    assert proc.returncode == 0, proc.stderr
    read = lambda name: (tmp_path / name).read_text()  # noqa: E731
    # -o elsewhere: the report is written there and the full run folder is not touched
    assert read("rc1").strip() == "0", read("err1")
    assert "Traceback" not in read("err1") and "not written" not in read("err1")
    assert "<html" in read("elsewhere.html").lower()
    # into the full run folder: one line per file not written, non-zero, no traceback
    assert read("rc2").strip() == "1", read("err2")
    assert "Traceback" not in read("err2")
    lines = read("err2").strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("diagnose: not written") for line in lines)
    assert all("No space left on device" in line for line in lines)
    assert {"findings.json", "ledger.csv", "report.html"} == {
        os.path.basename(line.split(" (")[0].split()[-1]) for line in lines
    }
    # nothing already written is lost, and no stray .tmp beside it
    assert read("before") == read("after")
    assert ".tmp" not in read("after")
    # a read-only run folder: the same lines; recording into one: refused before the job starts
    assert read("rc3").strip() == "1" and "Traceback" not in read("err3")
    assert read("err3").count("Read-only file system") == 3
    assert read("rc4").strip() == "2" and "Traceback" not in read("err4")
    (line,) = read("err4").strip().splitlines()
    # refused by the argument check (no permission to write there) or by the recorder
    assert ("Read-only file system" in line or "no permission to write" in line) and "runs" in line


def test_a_relay_that_cannot_start_says_so_and_a_running_one_relays_and_logs_both_streams(
    tmp_path, monkeypatch
):
    from traindx.profiler import filetail
    from traindx.profiler.tee import OutputRelay

    # pytest's capture makes fds 1 and 2 files, which the job would get itself (tail_from,
    # test_faults_round3): the pipes are what this test is about
    monkeypatch.setattr(filetail, "tail_from", lambda fd: None)

    relay = OutputRelay(str(tmp_path / "log.txt"), 0, 0, lambda tag, text: None)
    relay.module = "traindx_no_such_module"  # the relay process dies at start
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="did not start"):
        relay.start()
    assert len(os.listdir("/proc/self/fd")) == fds  # the pipes are closed again

    relay = OutputRelay(str(tmp_path / "log.txt"), 0, 0, lambda tag, text: seen.append((tag, text)))
    seen = []
    out, err = relay.start()
    os.write(out, b"one\ntwo")
    os.write(err, b"three\n")
    os.close(out)
    os.close(err)
    relay.finish()
    # the job's bytes as read, unchanged (no newline added to "two")
    assert b"".join(d for t, d in seen if t == "o") == b"one\ntwo"
    assert b"".join(d for t, d in seen if t == "e") == b"three\n"
    logged = [line.split(" ", 2)[1:] for line in (tmp_path / "log.txt").read_text().splitlines()]
    assert sorted(logged) == [["e", "three"], ["o", "one"], ["o", "two"]]
