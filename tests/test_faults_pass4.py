"""Fault pass four (issue 48; docs/faults.md, replayed whole by bench/fault_pass4.py): the rows
it fixed and a cheap set of those that held. A path the user names for an output (-o, --json)
that is a link, a device or a FIFO is written through, never renamed onto (as root that replaced
/dev/null); --run-dir never takes a user's non-empty folder; a job killed by a signal ends
diagnose by that signal; the job's own modules (numbers.py, token.py beside its script) win over
the standard ones the shim and the relay imported, as bare."""

import contextlib
import io
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
from helpers import PY, ROOT

from traindx.cli.main import main as cli
from traindx.common import atomic
from traindx.kernel_cache.cli import main as kernel_cache_cli
from traindx.profiler.manifest import RunDirRefused, claim_run_dir, refuse_a_foreign_folder
from traindx.profiler.shim._traindx_shim import shadowing
from traindx.report import outputs

RUN = os.path.join(ROOT, "tests", "data", "cpu-gc-hook", "run")


def _in_process(main, argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def _copy_of_the_run(tmp_path):
    import shutil

    shutil.copytree(RUN, tmp_path / "run")
    return str(tmp_path / "run")


def _env():
    return {k: v for k, v in os.environ.items() if not k.startswith("TRAINDX_")}


# -- B06/B07: a user's output path is written through, as a shell's `>` ------------------------
def test_an_output_through_a_link_keeps_the_link_and_writes_its_target(tmp_path):
    target = tmp_path / "shared" / "out.json"
    target.parent.mkdir()
    target.write_text("old")
    (tmp_path / "out.json").symlink_to(target)
    outputs.write_json_file(str(tmp_path / "out.json"), {"a": 1})
    assert (tmp_path / "out.json").is_symlink()
    assert '"a": 1' in target.read_text()
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_an_output_over_a_hard_linked_or_a_private_file_keeps_its_other_name_and_mode(tmp_path):
    mine = tmp_path / "mine.json"
    mine.write_text("old")
    os.link(mine, tmp_path / "shared.json")
    outputs.write_json_file(str(tmp_path / "shared.json"), {"a": 1})
    assert '"a": 1' in mine.read_text()  # renamed onto, the other name kept the old text
    private = tmp_path / "private.json"
    private.write_text("old")
    private.chmod(0o600)
    outputs.write_json_file(str(private), {"b": 2})
    assert '"b": 2' in private.read_text() and oct(private.stat().st_mode & 0o777) == "0o600"


def test_an_output_into_a_fifo_reaches_its_reader_and_the_fifo_stays(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    atomic.write_text(str(fifo), "through the fifo\n", user_path=True)
    reader.join(10)
    assert got == [b"through the fifo\n"]
    assert os.path.exists(fifo) and not os.path.isfile(fifo)


def test_dev_stdout_as_an_output_prints_and_stays_a_link(tmp_path):
    # `diagnose compare A B --json /dev/stdout`: /dev/stdout is a link to /proc/self/fd/1; as
    # root, a rename onto it replaced the link with a file (and /dev/null with a file)
    link = tmp_path / "stdout"
    link.symlink_to("/proc/self/fd/1")
    code = (
        "import sys; from traindx.common import atomic; "
        f"atomic.write_text({str(link)!r}, 'printed\\n', user_path=True)"
    )
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "printed\n"
    assert link.is_symlink()


def test_a_run_folders_own_files_are_never_written_through_a_link(tmp_path):
    # the run folder's writes are never through a link: a link planted there is refused (one
    # line, LinkRefused), its target untouched
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (tmp_path / "findings.json").symlink_to(victim)
    with pytest.raises(atomic.LinkRefused):
        atomic.write_json(str(tmp_path / "findings.json"), [])
    assert victim.read_text() == "mine"


@pytest.mark.skipif(os.geteuid() != 0, reason="a character device is made with mknod (root)")
def test_every_output_option_into_a_null_device_leaves_it_a_device(tmp_path):
    import stat

    run = _copy_of_the_run(tmp_path)  # analyze and report also write into the run folder
    null = tmp_path / "null"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    for argv in (
        ["analyze", run, "-o", null],
        ["compare", run, os.path.join(ROOT, "tests", "data", "h200-seed-b17-tensor"), "--json", null],
        ["report", run, "--quiet", "-o", null],
    ):
        code, _, err = _in_process(cli, argv)
        assert code == 0, (argv, err)
        assert stat.S_ISCHR(os.lstat(null).st_mode), argv


# -- B01/B02: --run-dir never takes a user's folder ------------------------------------------
def test_a_users_non_empty_folder_is_refused_as_a_run_folder(tmp_path):
    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    (proj / "report.html").write_text("the user's own")
    with pytest.raises(RunDirRefused, match="not empty and holds no run"):
        refuse_a_foreign_folder(str(proj))
    for ok in (tmp_path / "new", tmp_path / "empty"):
        if ok.name == "empty":
            ok.mkdir()
        refuse_a_foreign_folder(str(ok))  # new or empty: taken
    fix_root = tmp_path / "fixroot" / "baseline"
    fix_root.mkdir(parents=True)
    (fix_root / "manifest.json").write_text("{}")
    refuse_a_foreign_folder(str(fix_root.parent))  # --fix's root of arms: traindx's
    claim_run_dir(str(tmp_path / "empty")).release()


def test_diagnose_into_the_users_project_folder_is_one_line_and_touches_nothing(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.log").write_text("the user's log\n")
    (proj / "job.py").write_text("print('ran')\n")
    for run_dir, cwd in ((str(proj), tmp_path), (".", proj)):
        done = subprocess.run(
            [PY, "-m", "traindx", "--quiet", "--run-dir", run_dir, "--", PY, "job.py"],
            cwd=cwd,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.count("\n") == 1 and "not empty and holds no run" in done.stderr
    assert sorted(os.listdir(proj)) == ["job.py", "train.log"]
    assert (proj / "train.log").read_text() == "the user's log\n"


# -- A03-A05: a signal death passes through ---------------------------------------------------
@pytest.mark.slow
def test_a_job_killed_by_a_signal_ends_diagnose_by_the_same_signal(tmp_path):
    jobs = {
        signal.SIGKILL: "import os, signal\nprint('x', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n",
        signal.SIGINT: "raise KeyboardInterrupt\n",  # Python ends by SIGINT, as bare
    }
    for sig, text in jobs.items():
        job = tmp_path / f"job{int(sig)}.py"
        job.write_text(text)
        bare = subprocess.run([PY, str(job)], capture_output=True, timeout=60)
        done = subprocess.run(
            [os.path.join(os.path.dirname(PY), "diagnose"), "--quiet", "--no-pyspy"]
            + ["--run-dir", str(tmp_path / f"run{int(sig)}"), "--", PY, str(job)],
            capture_output=True,
            env=_env(),
            timeout=120,
        )
        assert bare.returncode == done.returncode == -sig, done.stderr[-400:]
        assert done.stdout == bare.stdout
        assert done.stderr.startswith(bare.stderr)
        assert (tmp_path / f"run{int(sig)}" / "report.html").is_file()  # the report came first


# -- A20: the job's own modules ---------------------------------------------------------------
def test_the_first_sys_path_entry_of_each_command_line(tmp_path):
    script = tmp_path / "sub" / "train.py"
    script.parent.mkdir()
    script.write_text("")
    here = os.getcwd()
    cases = [
        (["python", str(script), "--lr", "1"], str(script.parent)),
        (["python", "-u", "-W", "ignore", "-X", "dev", str(script)], str(script.parent)),
        (["python", "-c", "pass"], here),
        (["python", "-m", "pkg", "x"], here),
        (["python", "-"], here),
        (["python"], here),
    ]
    for argv, folder in cases:
        assert shadowing.first_path_entry(argv, safe_path=False) == folder, argv
    assert shadowing.first_path_entry(["python", str(script)], safe_path=True) is None  # -P, -I


def test_a_module_the_shim_added_is_dropped_when_the_jobs_folder_has_its_own(tmp_path, monkeypatch):
    (tmp_path / "fp4_mine.py").write_text("MINE = 1\n")
    before = set(sys.modules)
    monkeypatch.setitem(sys.modules, "fp4_mine", textwrap)  # as if the shim had imported it
    monkeypatch.setitem(sys.modules, "fp4_other", textwrap)  # the job has no file of that name
    monkeypatch.setattr(sys, "orig_argv", ["python", str(tmp_path / "job.py")])
    assert shadowing.unshadow(before) == ["fp4_mine"]
    assert "fp4_mine" not in sys.modules and "fp4_other" in sys.modules


@pytest.mark.slow
def test_a_job_importing_its_own_token_and_numbers_gets_them_as_bare(tmp_path):
    # numbers.py, token.py: standard names the shim (and, under `-m`, the relay's tokenize) loaded
    for name in ("numbers", "token", "random", "json"):
        (tmp_path / f"{name}.py").write_text(f"MINE = {name!r}\n")
    (tmp_path / "job.py").write_text(
        "import numbers, token, random, json\nprint([m.MINE for m in (numbers, token, random, json)])\n"
    )
    bare = subprocess.run([PY, "job.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    done = subprocess.run(
        [os.path.join(os.path.dirname(PY), "diagnose"), "--quiet", "--run-dir", "run", "--", PY, "job.py"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bare.returncode == done.returncode == 0, done.stderr
    assert done.stdout == bare.stdout == "['numbers', 'token', 'random', 'json']\n"
    assert "Traceback" not in done.stderr and "relay did not start" not in done.stderr


# -- rows that held: bad input is one line ----------------------------------------------------
BAD_INPUT = [
    (cli, ["report"], "the following arguments are required: RUN"),  # C01
    (cli, ["report", "/etc"], "is not a traindx run"),  # C02
    (cli, ["analyze", "EMPTY"], "is not a traindx run"),  # C04
    (cli, ["merge", RUN], "has no node parts"),  # C08
    (cli, ["watch", "NOWHERE"], "no such run folder"),  # C10
    (cli, ["attach", "--pid", "4000000", "--duration", "1"], "no process with pid 4000000"),  # C13
    (cli, ["--log-regex", "(", "--", "true"], "--log-regex"),  # C14
    (cli, ["--out", "NOTES", "--", "true"], "is a file, not a folder"),  # B03
    (kernel_cache_cli.main, ["unpack", "--cache-dir", "EMPTY", "NOTES"], "is not a tarball"),  # C18
    (kernel_cache_cli.main, [], "a command is needed: warm"),  # C17 (was: the help alone)
]


@pytest.mark.parametrize(
    "main,argv,said", BAD_INPUT, ids=[" ".join(a[:2]) or "kernel-cache" for _, a, _ in BAD_INPUT]
)
def test_bad_input_is_one_line_and_a_non_zero_exit(tmp_path, monkeypatch, main, argv, said):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("text\n")
    (tmp_path / "empty").mkdir()
    names = {"EMPTY": "empty", "NOWHERE": "nowhere", "NOTES": "notes.txt"}
    code, out, err = _in_process(main, [names.get(a, a) for a in argv])
    assert code != 0 and err.count("\n") == 1 and said in err, (argv, code, err)
    assert "Traceback" not in out + err and "internal error" not in err
    assert sorted(os.listdir(tmp_path)) == ["empty", "notes.txt"]  # nothing made, nothing changed


# -- A39: a full stream is the job's write error ----------------------------------------------
@pytest.mark.slow
def test_a_job_printing_into_dev_full_fails_as_bare(tmp_path):
    (tmp_path / "job.py").write_text(
        "import sys, time\nfor i in range(200):\n    print('x' * 100)\n    time.sleep(0.01)\n"
        "print('ran to the end', file=sys.stderr)\n"
    )
    with open("/dev/full", "wb") as full:
        bare = subprocess.run([PY, "job.py"], cwd=tmp_path, stdout=full, stderr=subprocess.PIPE, timeout=60)
        done = subprocess.run(
            [PY, "-m", "traindx", "--quiet", "--no-pyspy", "--run-dir", "run", "--", PY, "job.py"],
            cwd=tmp_path,
            env=_env(),
            stdout=full,
            stderr=subprocess.PIPE,
            timeout=120,
        )
    assert bare.returncode == done.returncode == 1
    assert b"ran to the end" not in done.stderr  # (its error reads EPIPE where bare reads ENOSPC)


# -- C27: a reader that went away (`diagnose analyze --json RUN | head -1`) -------------------
def test_a_reader_that_went_away_ends_every_command_quietly_with_its_own_exit(tmp_path):
    """stdout a pipe whose reader is gone before the first write (EPIPE, deterministic): every
    command that prints there ends with its own exit, as ripgrep does (the job's 3 passes through;
    the run's report is still written), without a traceback, an internal error or the
    interpreter's "Exception ignored" at its exit flush."""
    import shutil

    for name in ("base", "fix"):
        shutil.copytree(os.path.join(ROOT, "tests", "data", "cpu-gc-freeze-pair", name), tmp_path / name)
    base, fix = tmp_path / "base", tmp_path / "fix"
    rows = {
        "analyze --json": ([PY, "-m", "traindx", "analyze", "--json", base], 0),
        "report --quiet": ([PY, "-m", "traindx", "report", "--quiet", fix], 0),
        "card": ([PY, "-m", "traindx", "card", base, "--tokens-per-step", "64"], 0),
        "compare": ([PY, "-m", "traindx", "compare", base, fix], 0),
        "kernel-cache env": ([PY, "-m", "traindx.kernel_cache.cli", "env"], 0),
        "a job": (
            [PY, "-m", "traindx", "--quiet", "--no-pyspy", "--run-dir", tmp_path / "run", "--"]
            + [PY, "-c", "import sys; sys.exit(3)"],
            3,
        ),
    }
    read, write = os.pipe()
    os.close(read)
    procs = {
        row: subprocess.Popen(
            list(map(str, argv)), stdout=write, stderr=subprocess.PIPE, env=_env(), cwd=tmp_path
        )
        for row, (argv, _) in rows.items()
    }
    os.close(write)
    for row, proc in procs.items():
        err = proc.communicate(timeout=180)[1].decode()
        assert proc.returncode == rows[row][1], (row, err[-2000:])
        for said in ("Traceback", "internal error", "Exception ignored", "Broken pipe"):
            assert said not in err, (row, err[-2000:])
    assert os.path.getsize(tmp_path / "run" / "report.html") > 0


# -- C24: an output on a full disk is one line ------------------------------------------------
def test_an_output_into_a_full_device_is_one_line_and_leaves_it_a_device(tmp_path):
    import stat

    run = _copy_of_the_run(tmp_path)
    for argv in (
        ["card", run, "--active-params", "1e6", "--tokens-per-step", "64", "-o", "/dev/full"],
        ["analyze", run, "-o", "/dev/full"],
    ):
        code, _, err = _in_process(cli, argv)  # (analyze prints its verdict first)
        assert code == 2 and "Traceback" not in err and "internal error" not in err, (argv, err)
        assert err.splitlines()[-1] == "diagnose: error: cannot write /dev/full: No space left on device", err
        assert stat.S_ISCHR(os.lstat("/dev/full").st_mode)


# -- D07: the shim's import hook is not in the job's traceback ---------------------------------
def test_a_hooked_module_that_raises_shows_the_jobs_traceback_only(tmp_path, monkeypatch):
    import traceback

    from traindx.profiler.shim._traindx_shim import importhooks

    (tmp_path / "fp4_hooked.py").write_text("x = 1\nraise ValueError('its own error')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    called = []
    importhooks.on_import("fp4_hooked", called.append)
    monkeypatch.setattr(sys, "meta_path", [importhooks._finder, *sys.meta_path])
    try:
        import fp4_hooked  # noqa: F401
    except ValueError:
        shown = traceback.format_exc()
    finally:
        sys.modules.pop("fp4_hooked", None)
        importhooks._callbacks.pop("fp4_hooked", None)
    assert "its own error" in shown and "fp4_hooked.py" in shown
    assert "importhooks" not in shown and "_traindx_shim" not in shown, shown
    assert called == []  # the module never loaded: no hook ran on half a module
