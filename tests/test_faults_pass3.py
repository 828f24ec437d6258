"""Fault rows of issue 39, third pass (no row of the first two): what a caller does around
`diagnose` reaches the job as it would bare. A reader that goes away (`| head`) is an EPIPE
for the job, not a job run to its end with exit 0; a descriptor the caller opened (`3>file`)
is the job's at the same number, not the shim's evidence file; `2>&1` into a pipe or a file
keeps the job's order of stdout and stderr; a private key printed line by line is hidden whole
in the run folder; a run folder with a non-ASCII name under LC_ALL=C (no UTF-8 coercion) gets
its report (was "internal error"). Each job is a second of plain Python (no torch)."""

import fcntl
import json
import os
import pty
import signal
import struct
import subprocess
import termios
import textwrap
import tty

from helpers import PY, ROOT

from traindx.analyzers.live.state import write_control
from traindx.fixing.run import confine as fix_confine
from traindx.profiler import launcher
from traindx.profiler.launcher import Options

KEY_BODY = "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAABlwAAAAdzc2gtcn"
# printed by the job (netrc, curl -u, a cookie, `k = v` with blanks, prose) or on its command line
PRINTED = ["n3tRcP4ssw0rd", "curlPassw0rd99", "csrfT0kenValue88", "wJalrXUtnFEMI/K7MDENG", "pw_LastLine42"]
ARGV = ["--hub-auth", "authArgValue66", "-u", "bob:argvCurlPw77"]
MIXED = textwrap.dedent(f"""
    import os, sys
    for i in range(50):
        os.write(1, b"O%d\\n" % i)
        os.write(2, b"E%d\\n" % i)
    print("-----BEGIN OPENSSH PRIVATE KEY-----", flush=True)
    print("{KEY_BODY}", flush=True)
    print("-----END OPENSSH PRIVATE KEY-----", flush=True)
    print("machine api.wandb.ai login alice password {PRINTED[0]}")
    print("curl -u alice:{PRINTED[1]} https://example.com")
    print("Cookie: sessionid=abc; csrftoken={PRINTED[2]}")
    print("aws_secret_access_key = {PRINTED[3]}EXAMPLEKEY")
    print("login failed for alice with password {PRINTED[4]}", flush=True)
    os.write(3, b"to the caller's fd 3\\n")
    os.close(1)
    os.write(2, b"stderr after stdout closed\\n")
    sys.exit(3)
""")
FLOOD = textwrap.dedent("""
    import sys
    block = b"x" * 65536
    try:
        for _ in range(800):  # 50 MB: a reader that left is seen at the first writes after it
            sys.stdout.buffer.write(block)
        sys.stdout.flush()
    except BrokenPipeError:
        sys.exit(7)
""")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "TRAINDX_RUN_DIR"}
    env.update(extra)
    return env


def _sh(script, cwd, **extra):
    return subprocess.run(
        ["bash", "-c", script], cwd=cwd, env=_env(**extra), capture_output=True, text=True, timeout=300
    )


def _files_text(folder):
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                yield os.path.join(root, name), f.read().decode("utf-8", "replace")


def test_the_callers_fds_order_and_a_printed_private_key(tmp_path):
    (tmp_path / "job.py").write_text(MIXED)
    bare = _sh(f"{PY} job.py 3>bare3.txt >bare.txt 2>&1; echo $?", tmp_path)
    run = tmp_path / "run"
    dx = _sh(
        f"{PY} -m traindx --quiet --no-pyspy --run-dir run -- {PY} job.py {' '.join(ARGV)} 3>dx3.txt >dx.txt 2>&1;"
        " echo $?",
        tmp_path,
    )
    assert bare.stdout.strip() == dx.stdout.strip() == "3"
    assert (tmp_path / "dx3.txt").read_text() == (tmp_path / "bare3.txt").read_text() != ""
    mine = (tmp_path / "dx.txt").read_text()
    assert "internal error" not in mine and "Traceback" not in mine
    assert mine.startswith((tmp_path / "bare.txt").read_text())  # the job's bytes, its order, then ours
    for path, text in _files_text(run):
        for secret in [KEY_BODY, *PRINTED, ARGV[1], ARGV[3]]:
            assert secret.split(":")[-1] not in text, (secret, path)
    assert "stderr after stdout closed" in (run / "log.txt").read_text()  # the lines after it kept


def test_a_reader_that_goes_away_is_an_epipe_for_the_job(tmp_path):
    (tmp_path / "flood.py").write_text(FLOOD)
    dx = _sh(
        f"{PY} -m traindx --quiet --no-pyspy --run-dir run -- {PY} flood.py 2>err.txt | head -c 10 >/dev/null;"
        " echo ${PIPESTATUS[0]}",
        tmp_path,
    )
    assert dx.stdout.strip() == "7"  # the job's own exit on BrokenPipeError, as bare
    assert "Traceback" not in (tmp_path / "err.txt").read_text()


def test_a_non_ascii_run_folder_under_a_c_locale_gets_its_report(tmp_path):
    (tmp_path / "job.py").write_text("import sys; print('plain'); sys.exit(2)\n")
    c_locale = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    dx = _sh(
        f"{PY} -m traindx --quiet --no-pyspy --run-dir 'run \u00fc' -- {PY} job.py", tmp_path, **c_locale
    )
    assert dx.returncode == 2
    assert "internal error" not in dx.stderr and "Traceback" not in dx.stderr
    assert (tmp_path / "run \u00fc" / "report.html").is_file()


CATCHER = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGINT, lambda s, f: sys.exit(42))
    print("ready", flush=True)
    time.sleep(10)
""")


def test_a_signal_ignored_by_the_caller_still_reaches_a_job_that_catches_it(tmp_path):
    # a shell script's background job (`diagnose ... &`) starts with SIGINT ignored; bare, the
    # job's own handler would take a `kill -INT`: under diagnose too (it was dropped)
    (tmp_path / "job.py").write_text(CATCHER)
    proc = subprocess.Popen(
        [PY, "-m", "traindx", "--quiet", "--no-pyspy", "--run-dir", "run", "--", PY, "job.py"],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 42


def test_a_run_folder_replaced_by_a_link_mid_run_is_not_written_through(tmp_path):
    # the live judge writes live.json (and stop/capture requests) into the run folder while the
    # job runs: a folder swapped for a link to a user's folder must not get them
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "run").symlink_to(victim)
    try:
        write_control(str(tmp_path / "run" / "live.json"), {"findings": {}})
    except OSError:
        pass
    assert os.listdir(victim) == []


def test_a_card_holds_no_password_from_the_models_config(tmp_path):
    # `diagnose card --model config.json` names the model by the config's _name_or_path: a URL
    # with a password there must not reach the card (cards are shared)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "vocab_size": 1000,
        "_name_or_path": "https://alice:cfgUrlPw123@hf.internal/m",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    run = os.path.join(ROOT, "tests", "data", "cpu-gc-hook", "run")
    args = [
        PY,
        "-m",
        "traindx",
        "card",
        run,
        "--model",
        "config.json",
        "--tokens-per-step",
        "4096",
        "-o",
        "c.yaml",
    ]
    done = subprocess.run(args, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    card = (tmp_path / "c.yaml").read_text()
    assert "cfgUrlPw123" not in card and "hf.internal" in card


CLOSED_JOB = textwrap.dedent("""
    import os, sys
    # one write: a second one could meet a pipe whose reader left (`| head -c 1`) and end the job
    # with its own BrokenPipeError, bare too; the test is about diagnose's code, not that race
    lines = ["stdin " + ("closed" if sys.stdin is None else "open"),
             "stdout " + ("closed" if sys.stdout is None else "open"), ""]
    os.write(2, chr(10).join(lines).encode())
    sys.exit(3)
""")


def test_closed_std_streams_stay_closed_for_the_job_and_our_output_never_changes_its_code(tmp_path):
    (tmp_path / "job.py").write_text(CLOSED_JOB)
    bare = _sh(f"{PY} job.py <&- >&- 2>bare.txt; echo $?", tmp_path)
    dx = _sh(
        f"{PY} -m traindx --quiet --no-pyspy --run-dir run -- {PY} job.py <&- >&- 2>dx.txt; echo $?", tmp_path
    )
    assert bare.stdout.strip() == dx.stdout.strip() == "3"
    assert (tmp_path / "dx.txt").read_text().startswith((tmp_path / "bare.txt").read_text())
    assert "stdout closed" in (tmp_path / "bare.txt").read_text()
    # diagnose's own verdict into a reader that left (`| head -1`): the job's code still
    piped = _sh(
        f"{PY} -m traindx --no-pyspy --run-dir run2 -- {PY} job.py 2>&1 | head -c 1; echo ${{PIPESTATUS[0]}}",
        tmp_path,
    )
    assert piped.stdout.strip().endswith("3")


def test_a_job_run_in_a_terminal_sees_a_terminal(tmp_path):
    # bare in a terminal, a job's stdout is a terminal (colours, progress bars, line-buffered
    # prints, its width): under diagnose too, its bytes unchanged (no CR added)
    (tmp_path / "job.py").write_text(
        "import os, sys\nos.write(1, b'tty=%d cols=%d\\n' % (sys.stdout.isatty(), os.get_terminal_size().columns)"
        " if sys.stdout.isatty() else b'tty=0\\n')\nsys.exit(4)\n"
    )
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 97, 0, 0))
    tty.setraw(slave)
    proc = subprocess.Popen(
        [PY, "-m", "traindx", "--quiet", "--no-pyspy", "--run-dir", "run", "--", PY, "job.py"],
        cwd=tmp_path,
        env=_env(),
        stdout=slave,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: every writer closed
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 4
    assert out == b"tty=1 cols=97\n"


def test_a_job_started_in_a_deleted_folder_runs_as_it_would_bare(tmp_path):
    (tmp_path / "gone").mkdir()
    job = "import sys; print('ran'); sys.exit(3)"
    dx = _sh(
        f'cd gone && rmdir ../gone && {PY} -m traindx --quiet --no-pyspy --run-dir {tmp_path}/run -- {PY} -c "{job}"',
        tmp_path,
    )
    assert dx.returncode == 3, dx.stderr
    assert dx.stdout == "ran\n"


def test_fix_arms_never_get_the_callers_extra_descriptors(tmp_path, monkeypatch):
    # a `3>file` of the caller's reaches a plain run's job (above); an arm of --fix (in either
    # confinement) must not get it: every arm would write the caller's file
    (tmp_path / "proj" / "fix" / "A").mkdir(parents=True)
    confiner = fix_confine.Confiner(
        str(tmp_path / "proj" / "fix"), str(tmp_path / "proj"), method="copy", why="t"
    )
    plain = Options(cwd=str(tmp_path / "proj"))
    arm = confiner.prepare(str(tmp_path / "proj" / "fix" / "A"), plain, lambda *a: None)
    fd = os.open(os.devnull, os.O_WRONLY)
    os.set_inheritable(fd, True)
    monkeypatch.setattr(launcher, "CALLER_FDS", (fd,))
    try:
        assert fd in launcher.Job(["true"], str(tmp_path / "run"), plain)._caller_fds()
        assert fd not in launcher.Job(["true"], str(tmp_path / "run"), arm)._caller_fds()
    finally:
        os.close(fd)


FD_N = textwrap.dedent("""
    import os, sys
    try:
        os.write(int(sys.argv[1]), b"JOB-BYTES-ON-A-LOW-FD\\n")
        print("written")
    except OSError as exc:
        print("not written:", exc.strerror)
""")


def test_a_job_writing_a_low_fd_never_writes_our_evidence_plain_or_as_a_fix_arm(tmp_path, monkeypatch):
    # the shim's files are opened in the job's process: at the lowest free number (3) a job's
    # `os.write(3, ...)` wrote into its events file. They live at >= 100 now; and an arm of --fix,
    # not given the caller's `N>file`, finds /dev/null at N (the job runs on, writes nowhere)
    (tmp_path / "fdn.py").write_text(FD_N)
    plain = launcher.Job(
        [PY, "fdn.py", "3"], str(tmp_path / "plain"), Options(cwd=str(tmp_path), pyspy=False)
    )
    assert plain.run() == 0
    callers = tmp_path / "callers.txt"
    fd = os.open(callers, os.O_WRONLY | os.O_CREAT)
    os.set_inheritable(fd, True)
    monkeypatch.setattr(launcher, "CALLER_FDS", (fd,))
    try:
        options = Options(cwd=str(tmp_path), pyspy=False, caller_fds=False)
        assert launcher.Job([PY, "fdn.py", str(fd)], str(tmp_path / "arm"), options).run() == 0
    finally:
        os.close(fd)
    assert callers.read_text() == ""
    # under `ulimit -n 64` (no fd 100): still far above the job's numbers
    low = _sh(
        f"ulimit -n 64; {PY} -m traindx --quiet --no-pyspy --run-dir limited -- {PY} fdn.py 3", tmp_path
    )
    assert low.returncode == 0, low.stderr
    for run, said in (
        ("plain", "not written: Bad file descriptor"),
        ("arm", "written"),
        ("limited", "not written: Bad file descriptor"),
    ):
        assert (tmp_path / run / "log.txt").read_text().splitlines()[-1].endswith(said), run
        for path, text in _files_text(tmp_path / run):
            assert "JOB-BYTES-ON-A-LOW-FD" not in text, path
        assert os.listdir(tmp_path / run / "events"), run
