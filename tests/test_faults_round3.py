"""Fault rows of issue 48 closed last: a `--log-regex` that backtracks for ever is bounded at record
and at report time (a one-line note, the rest of the report); `diagnose` itself runs no
sitecustomize of the job's (the job runs it once); a job in a non-ASCII folder under the C locale
gets the findings it gets under UTF-8; a job whose stdout is a regular file writes into that file
itself, as bare, while log.txt still gets its lines."""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest
from helpers import PY, ROOT

from traindx.profiler import logparse, rolling


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINDX_")}
    env.update(extra)
    return env


def _diagnose(args, cwd, timeout=300, **extra):
    return subprocess.run(
        [PY, "-m", "traindx", "--quiet", "--no-pyspy", *args],
        cwd=cwd,
        env=_env(**extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- a --log-regex that backtracks for ever -------------------------------------------------------
# (a|aa)+$ on 60 a's and a b: about 2^42 paths for Python's re (it never ends); the `regex`
# package's own optimisations do not save this one, its timeout does
BACKTRACKS = "(?P<step>(a|aa)+)$"
REGEX_JOB = textwrap.dedent("""
    import time
    print("step " + "a" * 60 + "b", flush=True)
    for i in range(4):
        time.sleep(0.05)
        print(f"step {i} loss {1 / (i + 1):.3f}", flush=True)
""")


def test_a_log_regex_that_backtracks_for_ever_is_bounded_live_and_in_report(tmp_path):
    (tmp_path / "job.py").write_text(REGEX_JOB)
    bare = subprocess.run([PY, "job.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    dx = _diagnose(["--log-regex", BACKTRACKS, "--run-dir", "run", "--", PY, "job.py"], tmp_path, timeout=120)
    assert dx.returncode == 0 and dx.stdout == bare.stdout, dx.stderr[-2000:]
    note = f"--log-regex '{BACKTRACKS}' took over"
    assert dx.stderr.count(note) == 1 and "Traceback" not in dx.stderr, dx.stderr[-2000:]
    assert "report:" in dx.stderr and (tmp_path / "run" / "report.html").is_file()
    # the recorded pattern is run again by every later report: bounded there too
    again = subprocess.run(
        [PY, "-m", "traindx", "report", "run", "--reanalyze"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0 and again.stderr.count(note) == 1, again.stderr[-2000:]
    assert "report:" in again.stderr


def test_the_rollers_log_thinning_gives_up_a_backtracking_regex_once():
    said = []
    thin = rolling.thin_log(logparse.compile_custom(BACKTRACKS), said.append)
    lines = [f"1 o step {'a' * 60}b"] * 3 + ["2 o step 7 loss 0.5"]
    note = {}
    kept = list(thin(iter(lines), note))
    assert kept == ["2 o step 7 loss 0.5"]  # the built-in formats still keep the step lines
    assert len(said) == 1 and "took over" in note["log_regex"]


# -- the installed commands run no sitecustomize of the job's -------------------------------------
SITE_JOB = (
    "import os\nwith open(os.path.join(os.path.dirname(__file__), 'ran.txt'), 'a') as f:\n"
    "    f.write(f'{os.getpid()}\\n')\nprint('the job site ran', flush=True)\n"
)


def _installed(tmp_path):
    """A fresh venv laid out as `pip install -e .` leaves it: the editable finder (copied from the
    test venv), the commands as installed (bin/ of the source tree: an installer copies a
    "#!/bin/sh" script as it is), the test venv's packages borrowed through a .pth line."""
    venv = tmp_path / "venv"
    subprocess.run([PY, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    vpy = str(venv / "bin" / "python")
    site = subprocess.run(
        [vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    here = sysconfig.get_paths()["purelib"]
    for finder in glob.glob(os.path.join(here, "__editable__*traindx*")):
        shutil.copy(finder, site)
    with open(os.path.join(site, "borrowed.pth"), "w") as f:
        f.write("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    for name in ("diagnose", "kernel-cache"):
        shutil.copy(os.path.join(ROOT, "bin", name), venv / "bin" / name)
    return venv


def test_the_installed_commands_run_no_sitecustomize_of_the_jobs(tmp_path):
    if not glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "__editable__*traindx*")):
        pytest.skip("traindx is not installed editable in this venv (its finder is copied)")
    venv = _installed(tmp_path)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITE_JOB)
    (tmp_path / "job.py").write_text("import os\nprint('job pid', os.getpid())\n")
    env = _env(PYTHONPATH=str(tmp_path / "site"))
    dx = subprocess.run(
        [str(venv / "bin" / "diagnose"), "--quiet", "--no-pyspy", "--run-dir", "run", "--", PY, "job.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert dx.returncode == 0 and "report:" in dx.stderr, dx.stderr[-2000:]
    job_pid = dx.stdout.split("job pid ")[1].split()[0]
    # the job's, once, as bare; none of diagnose's own nor its relay's
    assert (tmp_path / "site" / "ran.txt").read_text().split() == [job_pid]
    assert dx.stdout.count("the job site ran") == 1
    kc = subprocess.run(
        [str(venv / "bin" / "kernel-cache"), "ls", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert kc.returncode == 0 and "the job site ran" not in kc.stdout, kc.stderr[-2000:]
    assert (tmp_path / "site" / "ran.txt").read_text().split() == [job_pid]


# -- a job whose stdout is a regular file writes into it itself (A21) -----------------------------
FILE_JOB = textwrap.dedent("""
    import os, stat, sys
    print("regular", stat.S_ISREG(os.fstat(1).st_mode), "seekable", sys.stdout.seekable(), flush=True)
    for i in range(3):
        print(f"step {i} loss {1 / (i + 1):.3f}", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
""")


@pytest.mark.parametrize("redirect", [">> out.txt", "> out.txt 2>&1", "> out.txt 2> err.txt"])
def test_a_job_whose_stdout_is_a_file_writes_it_itself_and_log_txt_still_has_its_lines(tmp_path, redirect):
    (tmp_path / "job.py").write_text(FILE_JOB)
    seen = []
    for arm in ("bare", "dx"):
        (tmp_path / "out.txt").write_text("old\n")
        wrap = "" if arm == "bare" else f"{PY} -m traindx --quiet --no-pyspy --run-dir run -- "
        proc = subprocess.run(
            f"{wrap}{PY} job.py {redirect}",
            shell=True,
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        text = (tmp_path / "out.txt").read_text()
        seen.append(text.split("──")[0].split("----")[0])  # ours after the job's, with 2>&1
    assert seen[0] == seen[1], seen
    assert seen[1].startswith(("old\n" if ">>" in redirect else "") + "regular True seekable True\n")
    log = (tmp_path / "run" / "log.txt").read_text()
    assert " o step 2 loss 0.333" in log and "to stderr" in log and "old" not in log, log
