"""Fault rows of issue 48 closed last: a `--log-regex` that backtracks for ever is bounded at record
and at report time (a one-line note, the rest of the report); `diagnose` itself runs no
sitecustomize of the job's (the job runs it once); a job in a non-ASCII folder under the C locale
gets the findings it gets under UTF-8; a job whose stdout is a regular file writes into that file
itself, as bare, while log.txt still gets its lines."""

import os
import subprocess
import textwrap

from helpers import PY

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
