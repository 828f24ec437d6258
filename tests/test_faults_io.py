"""Fault rows of issue 39 (never harm, round two), items 2-4: the job's bytes pass through
diagnose unchanged (binary output, invalid UTF-8, a 3 MB line, carriage returns; stdin reaches
the job), log.txt keeps what it can read and says where it could not; no secret of the job's
(an env var with an unusual name, a token inside a URL argument, a config it prints as a dict,
JSON, YAML or k=v) in any file under the run folder, fix.json or --fix's copies of the job's
files; a run folder holding a planted symbolic link is refused before anything is written
through it; a run folder deleted mid-run leaves the job's exit code. Each job is a second of
plain Python (no torch)."""

import contextlib
import io
import json
import os
import shutil
import subprocess
import textwrap

import pytest
from helpers import PY, ROOT

from traindx.cli import main as cli
from traindx.fixing.run import model as fix_model
from traindx.fixing.run import scrub as fix_scrub

DATA = os.path.join(ROOT, "tests", "data")
SECRETS = {
    "MYCO_CRED": "credvalue-9912",
    "ACME_PASSCODE": "pc_value_7731",
    "SVC_AUTHZ": "authzvalue9917",
}
PRINTED = ["abcd1234efgh5678ijkl", "hunter2-hunter", "swordfish99", "plainsecretvalue", "opensesame42"]
URL_TOKEN = "TOKEN12345secret"
JOB = textwrap.dedent(f"""
    import json, os, sys
    out = sys.stdout.buffer
    data = bytes(range(256)) + b"\\n\\xff\\xfe not utf-8 \\xc3\\x28 here\\n" + b"progress 1%\\r2%\\r3%\\n"
    data += b"A" * (3 << 20) + b"\\nno newline at the end"
    out.write(data); out.flush()
    sys.stderr.buffer.write(b"err \\xff line\\r\\n"); sys.stderr.flush()
    print("stdin:", repr(sys.stdin.read()), file=sys.stderr)
    cfg = {{"lr": 0.001, "wandb_api_key": "{PRINTED[0]}", "db_password": "{PRINTED[1]}", "num_tokens": 4096}}
    print(cfg, file=sys.stderr)
    print(json.dumps(cfg), file=sys.stderr)
    print("db_password: {PRINTED[2]}", file=sys.stderr)
    print("  api_token: '{PRINTED[3]}'", file=sys.stderr)
    print("my_secret={PRINTED[4]} lr=0.1", file=sys.stderr)
    print("args", sys.argv, "env", [os.environ[k] for k in {sorted(SECRETS)!r}], file=sys.stderr)
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "expected.bin"), "wb") as f:
        f.write(data)
    sys.exit(3)
""")


def _diagnose(args, cwd, stdin=b"", env=None):
    full = {k: v for k, v in os.environ.items() if k != "TRAINDX_RUN_DIR"}
    full.update(env or {})
    return subprocess.run(
        [PY, "-m", "traindx", *args], cwd=cwd, env=full, input=stdin, capture_output=True, timeout=300
    )


def _files_under(folder):
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                yield os.path.join(root, name), f.read()


@pytest.fixture(scope="module")
def io_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("io")
    (tmp / "job.py").write_text(JOB)
    run_dir = tmp / "run"
    proc = _diagnose(
        [
            "--quiet",
            "--no-pyspy",
            "--no-nvml",
            "--run-dir",
            str(run_dir),
            "--",
            PY,
            "job.py",
            f"https://user:{URL_TOKEN}@git.example.com/repo.git",
        ],
        cwd=tmp,
        stdin=b"hi from the pipe\n",
        env=SECRETS,
    )
    return tmp, run_dir, proc


def test_the_jobs_bytes_pass_through_unchanged_and_stdin_reaches_it(io_run):
    tmp, _, proc = io_run
    assert proc.returncode == 3, proc.stderr[-2000:]  # the job's exit code
    assert proc.stdout == (tmp / "expected.bin").read_bytes()  # binary, invalid UTF-8, \r, 3 MB line
    assert b"err \xff line\r\n" in proc.stderr
    assert b"stdin: 'hi from the pipe\\n'" in proc.stderr


def test_log_keeps_what_it_can_read_and_says_where_it_could_not(io_run):
    _, run_dir, _ = io_run
    log = (run_dir / "log.txt").read_bytes().decode("utf-8")  # no newline translation
    assert "bytes of binary output, not kept in log.txt" in log
    assert "not utf-8" in log and "not text here, shown as \ufffd" in log
    assert "progress 1%\r2%\r3%" in log and "no newline at the end" in log
    assert "stdin: 'hi from the pipe\\n'" in log


def test_no_secret_in_any_file_under_the_run_folder(io_run):
    _, run_dir, _ = io_run
    secrets = [*SECRETS.values(), *PRINTED, URL_TOKEN]
    files = dict(_files_under(run_dir))
    assert str(run_dir / "manifest.json") in files and str(run_dir / "report.html") in files
    for path, data in files.items():
        for secret in secrets:
            assert secret.encode() not in data, (secret, path)
    log = files[str(run_dir / "log.txt")].decode()
    assert "'num_tokens': 4096" in log and "lr=0.1" in log and "git.example.com/repo.git" in log
    manifest = json.loads(files[str(run_dir / "manifest.json")])
    assert manifest["env"]["MYCO_CRED"] == "<redacted>"


def test_fix_json_and_the_copies_of_the_jobs_files_hold_no_secret(tmp_path, monkeypatch):
    """fix.json keeps the command in several places (a token inside a URL, a key that is also
    an env var's value); a scratch copy of the job's tree holds its config file."""
    monkeypatch.setenv("MYCO_CRED", SECRETS["MYCO_CRED"])
    command = [
        PY,
        "train.py",
        "--repo",
        f"https://user:{URL_TOKEN}@host/x.git",
        "--key",
        SECRETS["MYCO_CRED"],
    ]
    doc = {"command": command, "arms": [{"command": command, "apply": [" ".join(command)]}]}
    fix_model.write_fix_json(str(tmp_path / "fix.json"), doc)
    text = (tmp_path / "fix.json").read_text()
    assert URL_TOKEN not in text and SECRETS["MYCO_CRED"] not in text and "train.py" in text
    scratch = tmp_path / "scratch" / "cand-1" / "tree"
    scratch.mkdir(parents=True)
    (scratch / "config.yaml").write_text(
        f"lr: 0.1\nwandb:\n  api_key: {PRINTED[0]}\ndb_password: {PRINTED[1]}\n"
    )
    (scratch / ".env").write_text(f"MYCO_CRED={SECRETS['MYCO_CRED']}\n")
    user_file = tmp_path / "users.yaml"
    user_file.write_text(f"password: {PRINTED[2]}\n")
    os.link(user_file, scratch / "linked.yaml")  # a copy that is a hard link to the user's file
    run = tmp_path / "baseline"
    run.mkdir()
    (run / "manifest.json").write_text("{}")
    (run / "log.txt").write_text("left alone: a run folder was redacted by its recorder")
    assert fix_scrub.scrub_copies(str(tmp_path), command, os.environ) == []
    for name in ("config.yaml", ".env", "linked.yaml"):
        text = (scratch / name).read_text()
        assert not any(s in text for s in (*PRINTED, SECRETS["MYCO_CRED"])), (name, text)
    assert "lr: 0.1" in (scratch / "config.yaml").read_text()
    assert user_file.read_text() == f"password: {PRINTED[2]}\n"  # the user's own file untouched


def test_a_run_folder_with_a_planted_link_is_refused_and_nothing_written_through(tmp_path):
    victim = tmp_path / "victim"
    (victim / "procs").mkdir(parents=True)
    (victim / "lock").write_text("precious")
    (tmp_path / "job.py").write_text("print('ran')\n")
    for planted, target in (
        (".traindx.lock", victim / "lock"),
        ("procs", victim / "procs"),
        ("faults", victim),
    ):
        run_dir = tmp_path / f"run-{planted.strip('.')}"
        run_dir.mkdir()
        (run_dir / planted).symlink_to(target)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):  # in-process: fast
            code = cli.main(
                ["--quiet", "--no-pyspy", "--no-nvml", "--run-dir", str(run_dir), "--", PY, "job.py"]
            )
        err = err.getvalue()
        assert code == 2 and len(err.strip().splitlines()) == 1 and "symbolic link" in err, err
        assert not os.path.exists(run_dir / "manifest.json")
    assert (victim / "lock").read_text() == "precious" and os.listdir(victim / "procs") == []


def test_a_run_folder_deleted_mid_run_is_one_warning_and_the_jobs_exit_code(tmp_path):
    (tmp_path / "job.py").write_text(
        "import os, shutil, sys, time\ntime.sleep(0.3)\nshutil.rmtree(os.environ['TRAINDX_RUN_DIR'])\n"
        "print('deleted', flush=True)\ntime.sleep(0.3)\nsys.exit(5)\n"
    )
    proc = _diagnose(
        ["--quiet", "--no-nvml", "--run-dir", str(tmp_path / "run"), "--", PY, "job.py"], tmp_path
    )
    err = proc.stderr.decode()
    assert proc.returncode == 5 and proc.stdout == b"deleted\n", err
    assert err.count("diagnose:") == 1 and "deleted while the job ran" in err and "Traceback" not in err


def test_a_process_replaced_by_exec_is_reported_and_says_so(tmp_path):
    """Issue 39: a job that execs into another program under the same pid used to end in
    "internal error: shapes (60,) (40,)" (two programs' steps under one rank)."""
    run_dir = tmp_path / "run"
    shutil.copytree(os.path.join(DATA, "exec-replaced"), run_dir)
    proc = _diagnose(["report", str(run_dir)], tmp_path)
    err = proc.stderr.decode()
    assert proc.returncode == 0 and "internal error" not in err and "Traceback" not in err, err
    assert "replaced its program (exec)" in err and "p2911.1.jsonl" in err
    # the first program alone (its 12th step ends at the exec: no step end recorded)
    assert "11 steps recorded on 1 rank" in err + proc.stdout.decode()
    assert (run_dir / "report.html").is_file()


def test_a_job_that_fits_an_address_space_limit_bare_fits_under_diagnose(tmp_path):
    """Issue 39: under `ulimit -v` the shim's threads took 72 MiB of the job's address space
    each (a malloc arena and a stack): a job 35 MiB under its limit bare died of MemoryError
    under diagnose. The margin the shim needs now is stated in docs/overhead.md."""
    (tmp_path / "job.py").write_text(
        "import resource, sys\n"
        "assert resource.getrlimit(resource.RLIMIT_AS)[0] == 256 << 20\n"
        "block = bytearray(200 << 20)  # ~20 MiB of interpreter + 200 MiB: 35 MiB under the limit\n"
        "print('allocated', len(block) >> 20, 'MiB', flush=True)\n"
    )
    job = ["sh", "-c", f"ulimit -v {256 << 10}; exec {PY} job.py"]
    bare = subprocess.run(job, cwd=tmp_path, capture_output=True)
    assert bare.returncode == 0 and bare.stdout == b"allocated 200 MiB\n", bare.stderr
    proc = _diagnose(["--quiet", "--no-nvml", "--run-dir", str(tmp_path / "run"), "--", *job], tmp_path)
    assert proc.returncode == 0 and proc.stdout == b"allocated 200 MiB\n", proc.stderr.decode()[-2000:]


STOPPED_JOB = textwrap.dedent("""
    import os, subprocess, sys, time
    import torch
    torch.set_num_threads(1)
    w = torch.nn.Parameter(torch.ones(128, 128))
    opt = torch.optim.SGD([w], lr=0.01)
    x = torch.randn(32, 128)
    for step in range(40):
        loss = (x @ w).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 20 and sys.argv[1] != "0":  # someone stops the job, and continues it later
            me = os.getpid()
            subprocess.Popen(["sh", "-c", f"kill -STOP {me}; sleep {sys.argv[1]}; kill -CONT {me}"])
            time.sleep(0.5)  # the stop comes in this step (the rest of the loop takes 3 ms)
""")


@pytest.mark.slow  # a torch job (~10 s)
def test_a_job_stopped_by_sigstop_is_told_so_and_no_cause_in_its_code(tmp_path):
    """Issue 39: a job stopped with SIGSTOP got two high host-work findings (its pause blamed on
    the forward). The stop is the launcher's evidence (/proc state T): the report says "the job
    was stopped (SIGSTOP) for 2 s", its step's cause is the stop, no finding above low."""
    (tmp_path / "job.py").write_text(STOPPED_JOB)
    run_dir = tmp_path / "run"
    proc = _diagnose(
        ["--no-pyspy", "--no-nvml", "--run-dir", str(run_dir), "--", PY, "job.py", "2"], tmp_path
    )
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-3000:]
    findings = json.loads((run_dir / "findings.json").read_text())
    (stopped,) = [f for f in findings if f["id"] == "process.stopped"]
    assert stopped["title"].startswith("The job was stopped (SIGSTOP) for ")
    # stopped 2 s by construction; a load only delays the `kill -CONT` (seconds, not the whole run)
    assert 1.5 <= stopped["evidence"]["seconds"] <= 8, stopped["evidence"]
    assert "(the job was stopped (SIGSTOP))" in err  # the slowest step's cause
    loud = [f["title"] for f in findings if f["severity"] in ("medium", "high", "critical")]
    assert not loud, loud


def test_fix_arms_own_copies_of_the_jobs_folders_may_hold_links(tmp_path):
    """--fix's arm folder holds private copies of the job's folders with their links as they are
    (on a GPU machine a copy of /usr/local holds cuda-13 -> /etc/alternatives/cuda-13): the run
    is recorded; a link elsewhere in the same folder is still refused."""
    (tmp_path / "job.py").write_text("print('ran')\n")
    run_dir = tmp_path / "arm"
    (run_dir / "captured" / "top-0").mkdir(parents=True)
    (run_dir / "captured" / "top-0" / "cuda").symlink_to(tmp_path)
    args = [
        "--quiet",
        "--no-pyspy",
        "--no-nvml",
        "--run-dir",
        str(run_dir),
        "--",
        PY,
        str(tmp_path / "job.py"),
    ]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(args) == 0
    assert os.path.exists(run_dir / "manifest.json")
    other = tmp_path / "other"
    (other / "captured").mkdir(parents=True)
    (other / "notes").symlink_to(tmp_path)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert cli.main(args[:4] + [str(other)] + args[5:]) == 2
    assert "symbolic link" in err.getvalue()
