"""Fault rows of issue 48, untrusted run folders: a run folder received from someone else, or
damaged, is read as untrusted input by one layer (traindx.common.untrusted): no link followed,
no FIFO or device waited on, sizes and a gzip segment's inflation capped, JSON nesting bounded,
the manifest's fields range-checked. Each row damages a copy of a real recorded run
(tests/data/cpu-gc-hook) and runs the real command: a clear line and a finished command, never
a traceback, an internal error or a hang."""

import gzip
import json
import os
import resource
import shutil
import socket
import subprocess

import pytest
from helpers import PY, ROOT

from traindx.common import untrusted

BASE = os.path.join(ROOT, "tests", "data", "cpu-gc-hook", "run")
PID = "p10260"  # the recorded run's one process


def _run_dir(tmp_path, name="run"):
    run_dir = tmp_path / name
    shutil.copytree(BASE, run_dir, ignore=shutil.ignore_patterns("findings.json", "ledger.csv"))
    return run_dir


def _diagnose(*args, timeout=180, memory_gib=None):
    """`diagnose ARGS` as a user runs it (stdin closed: a command that waits hangs here)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINDX_RUN_DIR", "TRAINDX_DEBUG")}

    def limit():
        if memory_gib:
            resource.setrlimit(resource.RLIMIT_AS, (memory_gib << 30, memory_gib << 30))

    return subprocess.run(
        [PY, "-m", "traindx", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
        preexec_fn=limit,
    )


def _clean(proc, code=0):
    """The command ended with `code`, without a traceback or an internal error; its stderr."""
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


# several commands in one child process (a Python start and traindx's imports once, not per
# command), each with its own exit code and stderr; stdin closed and a timeout, as _diagnose
_MANY = """
import contextlib, io, json, sys
from traindx.cli.main import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    out.append([code, err.getvalue()])
print(json.dumps(out))
"""


def _diagnose_each(*commands, timeout=300):
    """[CompletedProcess-like (returncode, stderr)] of `diagnose ARGS` for each ARGS, run one
    after the other in one child process: for rows that read a folder and do not interfere."""
    proc = _diagnose_python(_MANY, [[str(a) for a in args] for args in commands], timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [
        subprocess.CompletedProcess(args, code, "", err)
        for args, (code, err) in zip(commands, json.loads(proc.stdout))
    ]


def _diagnose_python(code, argvs, timeout):
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINDX_RUN_DIR", "TRAINDX_DEBUG")}
    return subprocess.run(
        [PY, "-c", code, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def _set_manifest(run_dir, old, new):
    path = run_dir / "manifest.json"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def _report(run_dir, *extra, **kw):
    proc = _diagnose("report", run_dir, "--quiet", *extra, **kw)
    return proc


# -- the rows of the issue ----------------------------------------------------------------------
def test_a_fifo_log_is_skipped_in_one_line_not_waited_on(tmp_path):
    run_dir = _run_dir(tmp_path)
    os.remove(run_dir / "log.txt")
    os.mkfifo(run_dir / "log.txt")
    err = _clean(_report(run_dir, timeout=120))
    assert "log.txt: not read (a FIFO, not a file)" in err
    assert (run_dir / "report.html").is_file()


def test_a_pyspy_file_linked_to_dev_zero_refuses_the_folder_in_one_line(tmp_path):
    run_dir = _run_dir(tmp_path)
    path = run_dir / "pyspy" / f"{PID}-all.speedscope.json"
    os.remove(path)
    os.symlink("/dev/zero", path)
    err = _clean(_report(run_dir, timeout=120), code=2)
    assert f"holds a symbolic link (pyspy/{PID}-all.speedscope.json -> /dev/zero)" in err
    with pytest.raises(untrusted.Refused, match="symbolic link"):  # and no reader follows one
        untrusted.read_bytes(str(path))


@pytest.mark.parametrize("value", ["NaN", "Infinity", "1e308"])
def test_a_start_time_that_is_no_time_is_dropped_in_every_command(tmp_path, value):
    run_dir = _run_dir(tmp_path)
    _set_manifest(run_dir, '"start_ns": 1796139327150447657', f'"start_ns": {value}')
    nodes = tmp_path / "multi" / "nodes"
    shutil.copytree(run_dir, nodes / "a")
    said = "manifest.json: field of the wrong type or out of range ignored: start_ns"
    commands = (
        ["report", run_dir, "--quiet"],
        ["card", run_dir, "--tokens-per-step", "100", "-o", tmp_path / "card.yaml"],
        ["compare", _run_dir(tmp_path, "other"), run_dir],
        ["merge", tmp_path / "multi", "--quiet"],
        ["watch", run_dir],
        ["analyze", run_dir],
    )
    # the six commands in one child process (each reads the folder; none writes what another
    # reads but report's findings, which analyze and watch re-derive from the damaged manifest)
    for args, proc in zip(commands, _diagnose_each(*commands)):
        err = _clean(proc)
        assert said in err, (args[0], err)


def test_a_truncated_manifest_still_makes_a_card(tmp_path):
    run_dir = _run_dir(tmp_path)
    text = (run_dir / "manifest.json").read_text()
    (run_dir / "manifest.json").write_text(text[: len(text) // 2])
    card = tmp_path / "card.yaml"
    proc = _diagnose("card", run_dir, "--tokens-per-step", "100", "-o", card, timeout=120)
    assert "manifest.json is corrupt (not JSON)" in _clean(proc)
    assert "the model of run" in card.read_text()  # the folder stands for the unknown command


def test_an_events_line_nested_200000_deep_is_one_corrupt_line(tmp_path):
    run_dir = _run_dir(tmp_path)
    with open(run_dir / "events" / f"{PID}.jsonl", "a") as f:
        f.write("[" * 200_000 + "]" * 200_000 + "\n")
        f.write('{"type": "gc", "t": 1796139335000000000}\n')  # not the last line: not a cut one
    err = _clean(_report(run_dir, "--reanalyze", timeout=120))
    assert f"events/{PID}.jsonl: corrupt line" in err
    assert "Full garbage collections" in (run_dir / "findings.json").read_text()  # the rest analysed


@pytest.mark.slow  # writes and reads a gigabyte
def test_a_gzip_segment_that_inflates_to_a_gigabyte_is_refused_early(tmp_path):
    run_dir = _run_dir(tmp_path)
    segment = run_dir / "events" / f"{PID}.jsonl.s000001.gz"
    with gzip.open(segment, "wb", compresslevel=9) as f:
        for _ in range(1024):  # 1 GiB of blanks in ~1 MB
            f.write(b" " * (1 << 20))
    # the 1 GiB inflated (and Arrow's copy of it) would not fit in 2 GiB of address space
    err = _clean(_report(run_dir, "--reanalyze", timeout=300, memory_gib=2))
    assert f"{PID}.jsonl.s000001.gz: not read (" in err and "a decompression bomb?" in err
    assert "Full garbage collections" in (run_dir / "findings.json").read_text()


def test_watch_on_a_run_whose_recorder_is_gone_says_so_and_ends(tmp_path):
    run_dir = _run_dir(tmp_path)
    _set_manifest(run_dir, '"status": "finished"', '"status": "running"')
    err = _clean(_diagnose("watch", run_dir, timeout=120), code=1)
    assert "says `running`, but no diagnose records into it any more" in err
    assert "--reanalyze` marks it interrupted" in err


# -- rows nobody tried before (issue 48's fresh pass) ---------------------------------------------
def test_special_files_and_sizes_anywhere_in_the_folder_are_skipped_in_one_line(tmp_path):
    run_dir = _run_dir(tmp_path)
    os.makedirs(run_dir / "events" / "p99.jsonl")  # a folder where a file should be
    os.mkfifo(run_dir / "nvml.csv")
    os.mkfifo(run_dir / "findings.json")
    os.mkfifo(run_dir / "comparison.json")
    os.truncate(run_dir / "pyspy" / f"{PID}-dump.jsonl", 100 << 30)  # sparse: 100 GiB
    err = _clean(_report(run_dir, timeout=120))
    for said in (
        "p99.jsonl: not read (a folder, not a file)",
        "nvml.csv: unreadable (a FIFO, not a file)",
        "findings.json is unreadable (a FIFO, not a file)",
        "comparison.json is not readable JSON (a FIFO, not a file)",
        "dump.jsonl: not read (102400 MiB, larger than any evidence file)",
    ):
        assert said in err, said


def test_a_fifo_manifest_or_lock_never_hangs(tmp_path):
    run_dir = _run_dir(tmp_path)
    os.remove(run_dir / "manifest.json")
    os.mkfifo(run_dir / "manifest.json")
    assert "manifest.json unreadable (a FIFO, not a file)" in _clean(_report(run_dir, timeout=120))
    other = _run_dir(tmp_path, "locked")
    _set_manifest(other, '"status": "finished"', '"status": "running"')
    os.mkfifo(other / ".traindx.lock")
    _clean(_diagnose("watch", other, timeout=120), code=1)


def test_a_linked_sub_folder_is_refused_by_report_watch_and_merge(tmp_path):
    run_dir = _run_dir(tmp_path)
    shutil.move(run_dir / "events", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", run_dir / "events")
    for command in ("report", "watch"):
        err = _clean(_diagnose(command, run_dir, timeout=120), code=2)
        assert "holds a symbolic link (events -> " in err
    multi = tmp_path / "multi"
    os.makedirs(multi / "nodes")
    os.symlink(_run_dir(tmp_path, "node"), multi / "nodes" / "a")
    assert "holds a symbolic link (nodes/a -> " in _clean(_diagnose("merge", multi, timeout=120), code=2)


def test_manifest_fields_of_wrong_types_or_paths_are_dropped_in_one_line(tmp_path):
    run_dir = _run_dir(tmp_path)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest.update(
        command=5, ranks=[1], host="x", env={"A": 5}, options=[], gpus={"a": 1}, status=7, exit_code=1e400
    )
    manifest["nodes"] = ["../../../etc"]  # a node is a folder under nodes/, never a path
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    err = _clean(_report(run_dir, timeout=120))
    assert "ignored: command, gpus, host, env, options, ranks, exit_code, status, nodes" in err
    _clean(_diagnose("card", run_dir, "--tokens-per-step", "1", "-o", tmp_path / "c.yaml", timeout=120))


def test_event_values_no_table_can_hold_are_corrupt_lines(tmp_path):
    run_dir = _run_dir(tmp_path)
    with open(run_dir / "events" / f"{PID}.jsonl", "a") as f:
        f.write('{"type": "step_end", "t": 1e30, "step": 5}\n')
        f.write('{"type": "step_begin", "t": 1796139330000000000, "step": 99999999999999999999999}\n')
        f.write("{" * 5000 + "\n" + "\n" * 1_000_000)  # and a million blank lines
    err = _clean(_report(run_dir, "--reanalyze", timeout=120))
    assert f"events/{PID}.jsonl: corrupt lines" in err


@pytest.mark.slow  # writes and reads a gigabyte
def test_a_torch_trace_that_inflates_to_a_gigabyte_is_refused(tmp_path):
    run_dir = _run_dir(tmp_path)
    os.makedirs(run_dir / "trace")
    with gzip.open(run_dir / "trace" / "0.json.gz", "wb", compresslevel=9) as f:
        f.write(b'{"traceEvents": [')
        for _ in range(1024):
            f.write(b" " * (1 << 20))
        f.write(b"]}")
    err = _clean(_report(run_dir, "--reanalyze", timeout=300, memory_gib=2))
    assert "0.json.gz is not a readable torch.profiler trace" in err and "decompression bomb" in err


def test_the_reading_layer_bounds_nesting_and_inflation():
    assert untrusted.too_deep("[" * 65 + "]" * 65) and not untrusted.too_deep("[" * 64 + "]" * 64)
    assert not untrusted.too_deep('{"a": "' + "[" * 100 + '"}')  # brackets inside a string
    with pytest.raises(ValueError):
        untrusted.loads("[" * 200_000 + "]" * 200_000)
    assert untrusted.loads('{"a": [1, {"b": 2}]}') == {"a": [1, {"b": 2}]}


def _pointing_at(run_dir, theirs, hostname):
    """The run's frames point at `theirs` (its recorded checkout was /work/wt/mend), recorded on
    `hostname`."""
    for path in run_dir.rglob("*"):
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="surrogateescape")
            path.write_text(
                text.replace("/work/wt/mend", str(theirs)), encoding="utf-8", errors="surrogateescape"
            )
    _set_manifest(run_dir, '"hostname": "vm"', json.dumps({"hostname": hostname})[1:-1])


def test_a_folder_recorded_elsewhere_never_quotes_this_machines_files(tmp_path, monkeypatch):
    monkeypatch.delenv(untrusted.TRUST_ENV, raising=False)  # tests/conftest.py sets it
    theirs = tmp_path / "theirs"
    os.makedirs(theirs / "tests" / "jobs")
    lines = [f"# line {n}\n" for n in range(1, 40)]
    lines[12] = "    gc.collect()  # private-7781\n"  # the line the recorded gc.collect() was on
    (theirs / "tests" / "jobs" / "gc_in_step_hook.py").write_text("".join(lines))
    received = _run_dir(tmp_path, "received")
    _pointing_at(received, theirs, "elsewhere")
    err = _clean(_report(received, "--reanalyze", timeout=120))
    assert "was recorded on 'elsewhere': no file of this machine is read for its source lines" in err
    assert err.count("no file of this machine is read") == 1
    assert "private-7781" not in (received / "findings.json").read_text()
    assert "private-7781" not in (received / "report.html").read_text()
    local = _run_dir(tmp_path, "local")  # the same run recorded here: its line is quoted
    _pointing_at(local, theirs, socket.gethostname())
    _clean(_report(local, "--reanalyze", timeout=120))
    assert "private-7781" in (local / "findings.json").read_text()
    told = _run_dir(tmp_path, "told")  # received, with the user's word that the files are theirs
    _pointing_at(told, theirs, "elsewhere")
    monkeypatch.setenv(untrusted.TRUST_ENV, "1")
    _clean(_report(told, "--reanalyze", timeout=120))
    assert "private-7781" in (told / "findings.json").read_text()


def test_a_frame_naming_dev_zero_or_a_fifo_is_never_read():
    for path in ("/dev/zero", "/dev/stdin"):
        with pytest.raises(OSError):
            untrusted.local_text(path)


def test_a_received_folders_log_regex_that_backtracks_for_ever_is_not_run(tmp_path, monkeypatch):
    monkeypatch.delenv(untrusted.TRUST_ENV, raising=False)
    run_dir = _run_dir(tmp_path)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["options"]["log_regex"] = "step (?P<step>(a+)+)$"  # catastrophic on 'aaa...b'
    manifest["host"]["hostname"] = "elsewhere"
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    with open(run_dir / "log.txt", "a") as f:
        f.write(f"1796139335000000000 o step {'a' * 40}b\n")
    err = _clean(_report(run_dir, "--reanalyze", timeout=120))
    assert (
        "its --log-regex 'step (?P<step>(a+)+)$' is not run: the run was recorded on another machine" in err
    )


def _switch_run(path, step_of_switch):
    """A built record of 12 even steps whose job turned autograd anomaly detection on before its
    first step and off in step 6, inside the steady window; step_of_switch(step) is what each
    switch event's `step` field holds (the shim's step, None or absent in a damaged folder)."""
    from records import RunBuilder

    b = RunBuilder(path)
    caller = {"file": "/job/train.py", "line": 3, "function": "<module>"}
    for on, at in ((True, 0), (False, 6)):
        while b.next_step.get("0", 0) < at:
            b.step(0.1, spans=[("forward_backward", 0.06), ("optimizer", 0.02)])
        fields = {} if step_of_switch(at) is ... else {"step": step_of_switch(at)}
        b.event("switch", name="anomaly", value=on, on=on, via="setter", caller=caller, changes=1, **fields)
    while b.next_step["0"] < 12:
        b.step(0.1, spans=[("forward_backward", 0.06), ("optimizer", 0.02)])
    return b.load()


def test_switch_events_without_a_step_are_dated_by_their_time(tmp_path):
    """A damaged folder whose every switch event has a null step (or none at all): `switches`
    judged it from the event's time as from the step the shim writes, never failed (KeyError
    'step') nor took a switch turned off inside the steady window for one left on before it."""
    from traindx.analyzers import analyze

    def judged(name, step_of_switch):
        found = analyze(_switch_run(tmp_path / name, step_of_switch))
        assert not [f.id for f in found if f.title.startswith("analyzer ")], [f.title for f in found]
        return [(f.id, f.title, f.evidence["step"]) for f in found if f.id.startswith("switches.")]

    intact = judged("intact", lambda step: step)
    assert [(i, s) for i, _, s in intact] == [("switches.anomaly", 0)]
    assert judged("null", lambda step: None) == intact
    assert judged("absent", lambda step: ...) == intact
