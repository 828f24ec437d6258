"""Fault injection, issue 23 rows 4-7 (rows 1-3, the wrapper's own faults, are in
test_faults_run.py; secrets, row 6, in test_redact.py):

- every evidence file of a real run damaged in turn (binary garbage, cut in half, empty,
  missing; the manifest too): the analysis runs on what is left, says what it skipped in one
  line each, and never prints a traceback;
- every argument of every subcommand of `diagnose` and `kernel-cache` given bad values (a
  table walked from the parsers themselves) and the meaningless ones refused: one line, exit 2;
- an analyzer, or a step after them, that fails loses only its own result.

The runs damaged are real ones recorded on the project's H200 (tests/data, see their READMEs).
"""

import contextlib
import io
import json
import os
import shutil
import subprocess
import warnings

import pytest
from helpers import PY, ROOT, diagnose, example

import traindx
from traindx.cli import main as cli
from traindx.kernel_cache.cli import main as kernel_cache_cli

DATA = os.path.join(ROOT, "tests", "data")
SEED_RUN = os.path.join(DATA, "h200-seed-b17-tensor")  # FA4 recompiling: jit critical, gil high
TRACE_RUN = os.path.join(DATA, "h200-gpu-pathologies", "sync")  # has a torch.profiler window
RECORDING = os.path.join(DATA, "h200-fa4-b17-tensor-maxseqlen.speedscope.json")
GARBAGE = bytes(range(256)) * 16  # NUL bytes, invalid UTF-8, every control character


def _in_process(main, argv):
    """(exit code, stdout, stderr) of a CLI entry point run here; an exception other than
    SystemExit propagates (it would have been a traceback)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return code, out.getvalue(), err.getvalue()


def _diagnose(*argv):
    return _in_process(cli.main, argv)


def _copy(src, dst):
    shutil.copytree(src, dst)
    for derived in ("findings.json", "report.html", "ledger.csv"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(dst, derived))
    return str(dst)


def _damage(path, how):
    if how == "garbage":
        with open(path, "wb") as f:
            f.write(GARBAGE)
    elif how == "half":
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
    elif how == "empty":
        open(path, "wb").close()
    elif how == "missing":
        os.remove(path)


def _steps(run_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return len(traindx.load_run(run_dir).steps)


# -- row 4: garbage evidence ----------------------------------------------------------------------
# (run, file, damage, what the warning names; None: a damage that loses nothing worth a line)
DAMAGES = [
    (SEED_RUN, "events/0.jsonl", "garbage", "events/0.jsonl: corrupt lines"),
    (SEED_RUN, "events/0.jsonl", "half", "last line is truncated"),
    (SEED_RUN, "pyspy/0-all.speedscope.json", "garbage", "is not a py-spy recording (binary data)"),
    (SEED_RUN, "pyspy/0-all.speedscope.json", "half", "is not a valid speedscope file"),
    (SEED_RUN, "pyspy/0-gil.speedscope.json", "empty", "holds no py-spy samples"),
    (SEED_RUN, "pyspy/0-dump.jsonl", "garbage", "0-dump.jsonl: corrupt lines"),
    (SEED_RUN, "nvml.csv", "garbage", "nvml.csv: no NVML header"),
    (SEED_RUN, "nvml.csv", "half", None),
    (SEED_RUN, "log.txt", "garbage", "lines without the launcher's time and stream skipped"),
    (SEED_RUN, "manifest.json", "garbage", "manifest.json is corrupt (not JSON); analysing the run's"),
    (SEED_RUN, "manifest.json", "missing", "no manifest.json; analysing the run's events"),
    (TRACE_RUN, "trace/0.json.gz", "garbage", "is not a readable torch.profiler trace (BadGzipFile"),
    (TRACE_RUN, "trace/0.json.gz", "half", "is not a readable torch.profiler trace"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "run,name,how,said", DAMAGES, ids=[f"{os.path.basename(r)}:{n}:{h}" for r, n, h, _ in DAMAGES]
)
def test_damaged_evidence_is_skipped_in_one_line_and_the_rest_analysed(tmp_path, run, name, how, said):
    steps = _steps(run)
    run_dir = _copy(run, tmp_path / "run")
    _damage(os.path.join(run_dir, name), how)
    code, out, err = _diagnose("report", run_dir, "--reanalyze", "--quiet")
    assert code == 0, err
    assert "Traceback" not in out + err
    assert out.strip() == os.path.join(run_dir, "report.html") and os.path.isfile(out.strip())
    with open(os.path.join(run_dir, "findings.json"), encoding="utf-8") as f:
        json.load(f)
    lines = [line for line in err.splitlines() if line.strip()]
    assert all(line.startswith("diagnose: warning: ") for line in lines), err
    if said:
        assert any(said in line for line in lines), err
    else:
        assert not lines, err
    if not name.startswith("events/"):  # what is left: every step the shim recorded still counts
        assert _steps(run_dir) == steps


@pytest.mark.slow
def test_a_run_whose_every_file_is_garbage_is_still_reported(tmp_path):
    run_dir = _copy(SEED_RUN, tmp_path / "run")
    for root, _, names in os.walk(run_dir):
        for name in names:
            _damage(os.path.join(root, name), "garbage")
    code, out, err = _diagnose("report", run_dir, "--reanalyze", "--quiet")
    assert code == 0 and "Traceback" not in out + err, err
    named = " ".join(err.splitlines())
    for name in ("manifest.json", "events/0.jsonl", "0-all.speedscope.json", "nvml.csv", "log.txt"):
        assert name in named, (name, err)
    # a folder with nothing of a run in it is still refused in one line
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = _diagnose("report", empty)
    assert code == 2 and err.strip().count("\n") == 0 and "not a traindx run" in err


@pytest.mark.slow
def test_a_manifest_with_fields_of_the_wrong_type_is_read_for_the_rest(tmp_path):
    steps = _steps(SEED_RUN)
    for wrong in ("x", 5, None):
        run_dir = _copy(SEED_RUN, tmp_path / f"run-{wrong}")
        path = os.path.join(run_dir, "manifest.json")
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        kept = manifest["command"]
        manifest = {k: (wrong if k != "command" else kept) for k in manifest}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(manifest, f)
        code, out, err = _diagnose("report", run_dir, "--reanalyze", "--quiet")
        assert code == 0 and "Traceback" not in out + err, err
        if wrong is not None:
            assert "of the wrong type or out of range ignored: " in err and "host" in err, err
        assert _steps(run_dir) == steps


@pytest.mark.slow
def test_events_with_fields_of_the_wrong_type_are_skipped_or_survived(tmp_path):
    """Each field of one event of each type given a value of another type (a string, a time no
    int64 holds, a list): whole JSON lines, so only their content says they are wrong."""
    events = os.path.join(SEED_RUN, "events", "0.jsonl")
    with open(events, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    first = {}
    for i, event in enumerate(lines):
        for key in event:
            if key != "type":
                first.setdefault((event["type"], key), i)
    for wrong in ("x", 1e300, [1]):
        run_dir = _copy(SEED_RUN, tmp_path / f"run-{type(wrong).__name__}")
        damaged = [dict(e) for e in lines]
        for (_, key), i in first.items():
            damaged[i][key] = wrong
        with open(os.path.join(run_dir, "events", "0.jsonl"), "w", encoding="utf-8") as f:
            f.write("\n".join(json.dumps(e) for e in damaged) + "\n")
        code, out, err = _diagnose("report", run_dir, "--reanalyze", "--quiet")
        assert code == 0 and "Traceback" not in out + err, err
        assert "0.jsonl: corrupt lines" in err, err  # the lines whose time is not a time
        assert all(line.startswith("diagnose: warning: ") for line in err.splitlines() if line)


@pytest.mark.slow  # 5-7 s
def test_damaged_derived_files_are_rebuilt_from_the_evidence(tmp_path, monkeypatch):
    """findings.json and the Parquet event tables are copies: damaged, they are made again."""
    monkeypatch.setenv("TRAINDX_CACHE", "1")
    run_dir = _copy(TRACE_RUN, tmp_path / "run")
    code, _, err = _diagnose("report", run_dir, "--reanalyze", "--quiet")
    assert code == 0, err
    with open(os.path.join(run_dir, "findings.json"), encoding="utf-8") as f:
        ids = [x["id"] for x in json.load(f)]
    tables = os.path.join(run_dir, "tables", "events")
    parquet = sorted(n for n in os.listdir(tables) if n.endswith(".parquet"))
    assert parquet
    for name in ("index.json", parquet[0]):
        for how in ("garbage", "half"):
            _damage(os.path.join(tables, name), how)
            code, out, err = _diagnose("report", run_dir, "--reanalyze", "--quiet")
            assert code == 0 and "Traceback" not in out + err, err
            with open(os.path.join(run_dir, "findings.json"), encoding="utf-8") as f:
                assert [x["id"] for x in json.load(f)] == ids
    _damage(os.path.join(run_dir, "findings.json"), "garbage")
    code, out, err = _diagnose("report", run_dir, "--quiet")
    assert code == 0 and "findings.json is unreadable" in err and err.count("\n") == 1, err
    with open(os.path.join(run_dir, "findings.json"), encoding="utf-8") as f:
        assert [x["id"] for x in json.load(f)] == ids


# -- row 5: every argument of every subcommand -----------------------------------------------------
def _parsers():
    """(entry point, argv prefix, parser) of every subcommand of diagnose and kernel-cache."""
    out = []
    for name in [cli.DEFAULT, *cli.SUBCOMMANDS]:
        _, parser = cli._parser_for(name)
        out.append((cli.main, [] if name == cli.DEFAULT else [name], parser))
    kc = kernel_cache_cli.build_parser()
    (sub,) = [a for a in kc._actions if a.__class__.__name__ == "_SubParsersAction"]
    for name, parser in sub.choices.items():
        out.append((kernel_cache_cli.main, [name], parser))
    return out


def _bad_values(tmp_path):
    a_file = tmp_path / "a_file.txt"
    a_file.write_bytes(GARBAGE)
    a_folder = tmp_path / "a_folder"
    a_folder.mkdir(exist_ok=True)
    return [
        "",
        "0",
        "-1",
        "-5.5",
        "nan",
        "inf",
        "1e999",
        "abc",
        "3:1",
        "x" * 300,
        "../..",
        str(a_file),
        str(a_folder),
        f"{a_file}/sub",
        "/nonexistent/dir/f.json",
        "/proc/1/x",
        "\u00e9t\u00e9",
    ]


def _walk_cases(tmp_path):
    """Every (entry point, argv, the argument under test) of the walk: each argument that takes
    a value, given each bad value, the others given placeholders that cannot start anything
    (a run folder that does not exist, a command that does not exist)."""
    missing = str(tmp_path / "no-such-run")
    cases = []
    for main, prefix, parser in _parsers():
        actions = [a for a in parser._actions if a.dest != "help"]
        positionals = [a for a in actions if not a.option_strings and a.nargs != "..."]
        options = [a for a in actions if a.option_strings and a.nargs != 0]
        tail = ["--", "/nonexistent/train"] if not prefix else []
        required = [x for a in options if a.required for x in (a.option_strings[0], "4194303")]
        for bad in _bad_values(tmp_path):
            for action in options:
                others = [
                    x
                    for a in options
                    if a.required and a is not action
                    for x in (a.option_strings[0], "4194303")
                ]
                argv = [
                    *prefix,
                    action.option_strings[0],
                    bad,
                    *others,
                    *[missing for _ in positionals],
                    *tail,
                ]
                cases.append((main, argv, action.option_strings[0]))
            for i, action in enumerate(positionals):
                values = [bad if j == i else missing for j in range(len(positionals))]
                cases.append((main, [*prefix, *required, *values, *tail], action.dest))
    return cases


@pytest.mark.slow
def test_every_argument_of_every_subcommand_fails_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(tmp_path / "fa4-cache"))
    cases = _walk_cases(tmp_path)
    assert len(cases) > 500  # every subcommand and option is in the walk
    walked = set()
    for main, argv, what in cases:
        code, out, err = _in_process(main, argv)
        assert "Traceback" not in out + err, (argv, err)
        lines = [line for line in err.splitlines() if line.strip()]
        if code != 0 and (lines or code != 1):  # exit 1 alone: a verdict (kernel-cache verify)
            assert code == 2 and len(lines) == 1, (argv, code, err)
            assert "error: " in lines[0], (argv, err)
        walked.add((tuple(argv[:1]), what))
    assert not os.path.exists(tmp_path / "runs")  # nothing was started, no run folder made


# (argv, what the one line must say): values that parse but mean nothing, refused
MEANINGLESS = [
    (["--pyspy-rate", "0", "--", "true"], "--pyspy-rate: 0 must be samples per second"),
    (["--dump-interval", "-1", "--", "true"], "--dump-interval: -1 must be a number >= 0"),
    (["--steps", "-3", "--", "true"], "--steps: -3 must be a whole number >= 0"),
    (["--disk-budget", "0", "--", "true"], "--disk-budget: 0 must be a number > 0"),
    (["--window", "nan", "--", "true"], "--window: 'nan' is not a finite number"),
    (["--keep-windows", "0", "--", "true"], "--keep-windows: 0 must be a whole number >= 1"),
    (["--torch-profile", "5-2", "--", "true"], "--torch-profile: '5-2'"),
    (["--node", "../etc", "--", "true"], "--node: '../etc'"),
    (["attach", "--pid", "0"], "--pid: 0 must be a process id"),
    (["attach", "--pid", "1", "--duration", "-2"], "--duration: -2 must be a number > 0"),
    (["analyze", "RUN", "--rate", "0"], "--rate: 0 must be a number > 0"),
    (["compare", "RUN", "RUN2", "--tokens-per-step", "-5"], "--tokens-per-step: -5 must be a number > 0"),
    (["compare", "RUN", "RUN2", "--window", "9:3"], "need 0 <= FIRST <= LAST"),
    (["card", "RUN", "--price-per-gpu-hour", "-2.5"], "--price-per-gpu-hour: -2.5 must be a number > 0"),
    (["card", "RUN", "--seq-len", "0"], "--seq-len: 0 must be a whole number >= 1"),
    (["card", "RUN", "--active-params=-1e9"], "--active-params: -1e9 must be a number > 0"),
    (["card", "RUN", "--gpu", "Z80"], "unknown GPU type"),
]
KERNEL_CACHE_MEANINGLESS = [
    (["warm", "--jobs", "0", "--spec", "hd=128"], "--jobs/-j: 0 must be a whole number >= 1"),
    (["warm", "--tp", "-2"], "--tp: -2 must be a whole number >= 1"),
    (["warm", "--num-sms", "0"], "--num-sms: 0 must be a whole number >= 1"),
    (["warm", "--arch", "sm_42"], "--arch sm_42: FA4 supports"),
]


def test_meaningless_values_are_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv, said in MEANINGLESS:
        argv = [str(tmp_path / a) if a in ("RUN", "RUN2") else a for a in argv]
        code, out, err = _diagnose(*argv)
        assert code == 2 and err.count("\n") == 1 and said in err, (argv, err)
    for argv, said in KERNEL_CACHE_MEANINGLESS:
        code, out, err = _in_process(kernel_cache_cli.main, argv)
        assert code == 2 and err.count("\n") == 1 and said in err, (argv, err)
    assert not (tmp_path / "runs").exists()


def test_help_lists_the_subcommands():
    code, out, _ = _diagnose("--help")
    assert code == 0
    listed = out.split("subcommands", 1)[1]
    for name in cli.SUBCOMMANDS:
        assert f"\n  {name} " in listed, name
    assert "kernel-cache" in listed


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """A real run of the CPU example (the folder the argument tests write beside)."""
    cwd = tmp_path_factory.mktemp("cpu-run")
    run_dir = cwd / "run"
    proc = diagnose(
        [
            "--quiet",
            "--no-pyspy",
            "--no-nvml",
            "--steps",
            "4",
            "--run-dir",
            str(run_dir),
            "--",
            PY,
            example("train_tiny.py"),
            "--steps",
            "4",
            "--seq-len",
            "32",
            "--d-model",
            "32",
        ],
        cwd=cwd,
        env={"OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir


@pytest.mark.slow
def test_the_tracebacks_of_the_issue_are_one_line_errors(tmp_path, cpu_run):
    """The 12 bad-argument tracebacks the fault pass found, as a user types them."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a folder\n")
    binary = tmp_path / "recording.bin"
    binary.write_bytes(GARBAGE)
    copy = tmp_path / "copy"
    shutil.copytree(cpu_run, copy)
    cases = [
        (["--", "/tmp"], "/tmp is a folder, not a command"),
        (["--run-dir", str(a_file), "--", PY, "-c", "pass"], "is a file, not a folder"),
        (["--run-dir", "/proc/traindx-run", "--", PY, "-c", "pass"], "proc file system"),
        (["--out", f"{a_file}/sub", "--", PY, "-c", "pass"], "is a file, not a folder"),
        (["analyze", str(binary)], "is not a py-spy recording (binary data)"),
        (["analyze", str(cpu_run), "-o", "/nonexistent/dir/f.json"], "/nonexistent/dir does not exist"),
        (["compare", str(cpu_run), str(copy), "--json", "/nonexistent/dir/c.json"], "does not exist"),
        (["compare", str(cpu_run), str(copy), "--json", str(tmp_path)], "is a folder; give a file path"),
        (["compare", str(cpu_run), str(cpu_run)], "are the same run"),
        (["compare", str(cpu_run), str(copy)], "is a copy of"),
        (["card", str(cpu_run), "-o", str(tmp_path)], "is a folder; give a file path"),
        (["card", str(cpu_run), "-o", "/nonexistent/dir/card.yaml"], "does not exist"),
        (["report", str(cpu_run), "--perfetto", f"{a_file}/t.json"], "is not a folder"),
    ]
    for argv, said in cases:
        proc = diagnose(argv, cwd=tmp_path, timeout=120)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert "Traceback" not in proc.stdout + proc.stderr, (argv, proc.stderr)
        assert proc.stderr.count("\n") == 1 and said in proc.stderr, (argv, proc.stderr)
    assert not (tmp_path / "runs").exists()  # `diagnose -- /tmp` left no "failed to start" folder
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    not_a_program = tmp_path / "not-a-program"
    not_a_program.write_bytes(GARBAGE)
    not_a_program.chmod(0o755)
    proc = diagnose(["--out", str(tmp_path / "elsewhere"), "--", str(not_a_program)], cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "cannot start" in proc.stderr, proc.stderr
    assert not os.listdir(tmp_path / "elsewhere")  # no "failed to start" run folder left
    proc = subprocess.run(
        [PY, "-m", "traindx.kernel_cache.cli.main", "unpack", "--cache-dir", str(a_file), str(binary)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "is a file, not a folder" in proc.stderr, proc.stderr


# -- row 7: an analyzer that fails loses only its own finding -------------------------------------
def _without_callers(src, dst):
    """The py-spy recording with every compiling stack cut at the compiler's entry (py-spy
    sometimes unwinds no caller): the compile sites then have no calling function."""
    from traindx.analyzers.jit.pyspy_signatures import COMPILER_PATH

    with open(src, encoding="utf-8") as f:
        doc = json.load(f)
    frames = doc["shared"]["frames"]
    cut = 0
    for profile in doc["profiles"]:
        samples = []
        for sample in profile["samples"]:
            inside = [k for k, i in enumerate(sample) if COMPILER_PATH.search(frames[i].get("file") or "")]
            if inside:  # keep py-spy's thread root frames (no file), drop the callers
                sample = [i for i in sample[: inside[0]] if not frames[i].get("file")] + sample[inside[0] :]
                cut += 1
            samples.append(sample)
        profile["samples"] = samples
    assert cut > 100
    with open(dst, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return dst


def test_a_compile_site_without_a_caller_keeps_the_critical_finding(tmp_path):
    recording = _without_callers(RECORDING, tmp_path / "no-callers.speedscope.json")
    code, out, err = _diagnose("analyze", recording, "--json")
    assert code == 0 and "Traceback" not in err, err
    (finding,) = [f for f in json.loads(out) if f["id"] == "jit.fa4_steady_recompile"]
    assert finding["severity"] == "critical"
    assert "flash_bwd_sm90.py" in finding["title"] and "backward" in finding["title"]
    # the same recording inside a run: the run's shim-based critical finding stays as well
    run_dir = _copy(SEED_RUN, tmp_path / "run")
    _without_callers(
        os.path.join(SEED_RUN, "pyspy", "0-all.speedscope.json"),
        os.path.join(run_dir, "pyspy", "0-all.speedscope.json"),
    )
    code, out, err = _diagnose("analyze", run_dir, "--json")
    assert code == 0 and "failed" not in err, err
    ids = {f["id"]: f["severity"] for f in json.loads(out)}
    assert ids.get("jit.fa4_steady_recompile") == "critical" and "gil.contention" in ids


def _analyzed(run_dir):
    from traindx.analyzers import analyze

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = traindx.load_run(run_dir)
    return run, analyze


@pytest.mark.slow
def test_a_failing_analyzer_loses_only_its_own_finding(tmp_path, monkeypatch):
    import importlib

    from traindx import analyzers
    from traindx.analyzers import AnalyzerFailedWarning

    run_dir = _copy(SEED_RUN, tmp_path / "run")
    run, analyze = _analyzed(run_dir)
    healthy = {f.id: f for f in analyze(run)}
    assert {"jit.fa4_steady_recompile", "gil.contention"} <= set(healthy)
    for name, lost in (("gil", "gil.contention"), ("jit", "jit.fa4_steady_recompile")):
        module = importlib.import_module(analyzers.MODULES[name])

        def broken(run, name=name):
            raise RuntimeError(f"{name} broke\non two lines")

        with monkeypatch.context() as m:
            m.setattr(module, "analyze", broken)
            run, analyze = _analyzed(run_dir)
            with pytest.warns(AnalyzerFailedWarning) as caught:
                findings = {f.id: f for f in analyze(run)}
        messages = [str(w.message) for w in caught if issubclass(w.category, AnalyzerFailedWarning)]
        assert len(messages) == 1 and "\n" not in messages[0] and f"'{name}' failed" in messages[0]
        assert lost not in findings and f"traindx.analyzer_failed.{name}" in findings
        others = {i for i, f in healthy.items() if f.analyzer != name}
        assert others <= set(findings), others - set(findings)
        assert findings[f"traindx.analyzer_failed.{name}"].severity == "info"


@pytest.mark.slow
def test_a_failing_step_after_the_analyzers_keeps_their_findings(tmp_path, monkeypatch):
    from traindx.analyzers import AnalyzerFailedWarning, codefix
    from traindx.analyzers.core import chains

    run_dir = _copy(SEED_RUN, tmp_path / "run")
    run, analyze = _analyzed(run_dir)
    healthy = {f.id for f in analyze(run)}
    for module, attr, step in ((chains, "link", "chains"), (chains, "apply_savings", "savings")):
        with monkeypatch.context() as m:
            m.setattr(module, attr, lambda *a, **k: 1 / 0)
            run, analyze = _analyzed(run_dir)
            with pytest.warns(AnalyzerFailedWarning, match=f"'{step}' failed"):
                ids = {f.id for f in analyze(run)}
        assert healthy | {f"traindx.analyzer_failed.{step}"} == ids
    # a code prescription whose check raises is kept as prose, never applied unchecked
    with monkeypatch.context() as m:
        m.setattr(codefix, "code_change", lambda *a, **k: 1 / 0)
        run, analyze = _analyzed(run_dir)
        findings = analyze(run)
    assert {f.id for f in findings} == healthy
    assert not any(
        (p.change or {}).get("code") and not p.change["code"].get("autotune_key")
        for f in findings
        for p in f.prescriptions
    )
