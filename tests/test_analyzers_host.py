"""A cause for any slow line: host work between the measured calls, named at its line (live and
on recorded runs of a loaded machine, where time waiting for a core is no line's); threads
against cores; a gc.collect() called every step; a write run asynchronously."""

import os
import re
import shutil

import pytest
from analyzer_helpers import LOADED_LIGHTNING, _line_of, _one, _record
from helpers import PY, diagnose, only_run_dir

import traindx
from traindx.analyzers import analyze

HOST_LOOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs", "host_loop.py")


# -- a cause for any slow line: host work between the measured calls; threads against cores ------
def _line_of_text(path, text):
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if text in line:
                return n
    raise AssertionError(f"{text!r} not in {path}")


@pytest.fixture(scope="module")
def host_loop(tmp_path_factory):
    """A loop that sleeps 40 ms per step in a blocking read and burns 300 ms on odd steps."""
    return _record(
        tmp_path_factory,
        "host-loop",
        ["--steps", "30"],
        [PY, HOST_LOOP, "--steps", "40", "--read-seconds", "0.04", "--odd-seconds", "0.3"],
    )


@pytest.mark.slow  # one diagnose run with py-spy (~15 s on 2 busy cores)
def test_host_work_gets_a_finding_at_its_line_and_odd_steps_at_theirs(host_loop):
    findings = analyze(host_loop)
    host = [f for f in findings if f.analyzer == "host_work" and f.severity != "info"]
    read_line = _line_of_text(HOST_LOOP, "time.sleep(a.read_seconds)")
    read = [f for f in host if f.evidence.get("line") == read_line]
    assert len(read) == 1, (
        [(f.id, f.title, f.summary) for f in host],
        host_loop.missing,
        sorted(host_loop.pyspy),
    )
    read = read[0]
    assert read.evidence["file"].endswith("host_loop.py") and read.evidence["kind"] == "sleep"
    # 40 ms a step, measured from the training thread's samples beside the ledger's step time
    assert 0.02 <= read.seconds_lost_per_step <= 0.08, read.seconds_lost_per_step
    assert (read.evidence.get("period") or {}).get("period") is None  # it runs every step
    assert any("asynchronously" in p.summary for p in read.prescriptions)
    # the odd steps: named with period 2 at the line that runs only then (pure Python: busy())
    busy_lines = {
        _line_of_text(HOST_LOOP, "busy(a.odd_seconds)"),
        _line_of_text(HOST_LOOP, "while time.perf_counter() - t0 < seconds"),
        _line_of_text(HOST_LOOP, "n += 1"),
    }
    odd = [f for f in host if (f.evidence.get("period") or {}).get("period") == 2]
    assert odd, [(f.id, f.title, f.evidence.get("period")) for f in host]
    named = {f.evidence.get("line") for f in odd} | {
        c["line"] for f in odd for c in f.evidence.get("candidates") or []
    }
    assert named & busy_lines, [f.evidence for f in odd]
    # one parity (the work after an odd step's optimizer step is in the next step's record)
    assert len({s % 2 for s in odd[0].steps_affected}) == 1 and len(odd[0].steps_affected) >= 8
    # no prescription anywhere promises a gain <= 0
    assert all(
        p.expected_gain_s_per_step is None or p.expected_gain_s_per_step > 0
        for f in findings
        for p in f.prescriptions
    )


def test_line_periods_find_period_two_that_never_doubles_a_step():
    """+50 % on odd steps on one ledger line, with noise: period 2 on that line, and nothing on
    a line of noise alone; the slow-step search (2x the median) sees no period."""
    import numpy as np
    import pandas as pd

    from traindx.analyzers.model.stability import find_period, line_periods

    rng = np.random.default_rng(0)
    steps = np.arange(2, 42)
    fwd = 0.10 + rng.normal(0, 0.008, len(steps)) + np.where(steps % 2, 0.05, 0.0)
    opt = 0.02 + np.abs(rng.normal(0, 0.004, len(steps)))
    wall = fwd + opt
    led = pd.DataFrame(
        {
            "step": steps,
            "wall_s": wall,
            "forward_backward_s": fwd,
            "optimizer_s": opt,
            "unexplained_s": np.zeros(len(steps)),
        }
    )
    found = line_periods(led, float(wall.mean()))
    assert [(p["line"], p["period"], p["residue"]) for p in found] == [("forward_backward", 2, 1)]
    assert find_period(list(steps), list(wall)) is None


@pytest.mark.slow  # one short diagnose run (~10 s)
def test_threads_above_the_cores_are_oversubscription_with_the_setting(tmp_path_factory):
    cores = len(os.sched_getaffinity(0))
    threads = 4 * cores
    out = tmp_path_factory.mktemp("threads")
    proc = diagnose(
        [
            "--out",
            "runs",
            "--quiet",
            "--no-pyspy",
            "--steps",
            "10",
            "--",
            PY,
            HOST_LOOP,
            "--steps",
            "12",
            "--width",
            "64",
            "--threads",
            str(threads),
        ],
        cwd=out,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = traindx.load_run(only_run_dir(out / "runs"))
    f = _one(analyze(run), "threads.oversubscribed")
    assert f.severity != "info"
    assert f.evidence["intra_op_threads"] == threads and f.evidence["cores"] == cores
    assert f.evidence["other_threads_cpu_s_per_step"] is not None
    # the job sets the count itself (torch.set_num_threads(a.threads)): OMP_NUM_THREADS would
    # change nothing; its own call's line, which the fix planner turns into its own flag
    line = _line_of(HOST_LOOP, "torch.set_num_threads(a.threads)")
    assert f.evidence["thread_call"] == {
        "file": HOST_LOOP,
        "line": line,
        "source": "torch.set_num_threads(a.threads)",
    }
    (code,) = f.prescriptions
    assert code.change["code"]["line"] == line
    wanted = int(code.change["code"]["after"].removeprefix("torch.set_num_threads(").rstrip(")"))
    assert 1 <= wanted <= cores and code.automatic
    from traindx.fixing.plan import planner as fixplan

    flag = fixplan.own_flag_option(code, [str(t) for t in run.command], str(out))
    assert flag is not None and flag.change["arg"]["set"] == {"--threads": str(wanted)}
    assert not any("env" in (p.change or {}) for p in f.prescriptions)
    assert "OMP_NUM_THREADS would change nothing" in code.summary


@pytest.mark.slow  # one short diagnose run (~10 s)
def test_threads_set_by_a_literal_in_the_job_prescribe_that_line_not_the_env(tmp_path_factory):
    from traindx.analyzers import codefix

    cores = len(os.sched_getaffinity(0))
    out = tmp_path_factory.mktemp("threads_literal")
    script = out / "train.py"
    script.write_text(
        "import torch\n"
        "from torch import nn\n\n"
        f"torch.set_num_threads({4 * cores})\n"
        "model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=1e-3)\n"
        "for step in range(12):\n"
        "    x = torch.randn(64, 64)\n"
        "    loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))\n"
        "    opt.zero_grad()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
    )
    # the variable is set, and changes nothing: the job's call comes after torch read it
    proc = diagnose(
        ["--out", "runs", "--quiet", "--no-pyspy", "--", PY, "train.py"],
        cwd=out,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = traindx.load_run(only_run_dir(out / "runs"))
    f = _one(analyze(run), "threads.oversubscribed")
    assert f.evidence["intra_op_threads"] == 4 * cores and f.evidence["job_sets_threads"]
    (code,) = f.prescriptions
    change = code.change["code"]
    assert (change["file"], change["line"]) == (str(script), 4)
    assert change["before"] == f"torch.set_num_threads({4 * cores})"
    assert 1 <= int(re.fullmatch(r"torch\.set_num_threads\((\d+)\)", change["after"])[1]) <= cores
    assert f"{script}:4" in code.summary and "OMP_NUM_THREADS would change nothing" in code.summary
    assert "set_num_threads(" in codefix.apply(change, script.read_text()).splitlines()[3]


def _oversubscribed_run(tmp_path, job, record_names=None):
    """A built record of `train.py` in folder `job` on 2 cores whose shim saw 8 intra-op threads
    the job set itself; record_names: 'switch' (the shim's record of the setter's caller) or
    'frame' (a sampled frame of the training thread) naming job/threadcfg.py, or None."""
    from records import RunBuilder

    b = RunBuilder(
        tmp_path / "run", command=["python", "train.py"], cwd=str(job), manifest={"host": {"cpus": 2}}
    )
    for s in range(8):
        b.step(0.2)
        b.event("cpu", step=s, proc_cpu_s=0.38, thread_cpu_s=0.1, running=2.5)
    b.event("cpu_threads", intra_op_threads=8, affinity_cores=2, cpu_count=2, step=7)
    cfg = str(job / "threadcfg.py")
    if record_names == "switch":
        b.event(
            "switch",
            name="num_threads",
            value=8,
            on=True,
            via="setter",
            caller={"file": cfg, "line": 3, "function": "<module>"},
            source="torch.set_num_threads(8)",
            step=0,
            changes=1,
        )
    elif record_names == "frame":
        b.event("host_frame", id=0, function="setup", file=cfg, line=3)
    return b.load()


@pytest.mark.parametrize("record_names", [None, "switch", "frame"])
def test_threads_set_in_a_file_the_job_ran_are_named_and_a_script_beside_it_never(tmp_path, record_names):
    """The job's own set_num_threads is looked for in the files the run shows it ran: its script
    and the modules its record names (the setter's caller, a sampled frame). A script of another
    job in the same folder, with the same literal count, is never named."""
    job = tmp_path / "job"
    job.mkdir()
    (job / "train.py").write_text(
        "import torch\nimport threadcfg\n\nmodel = torch.nn.Linear(4, 4)\nopt = torch.optim.SGD(model.parameters())\n"
        "for _ in range(8):\n    model(torch.randn(2, 4)).sum().backward()\n    opt.step()\n"
    )
    (job / "threadcfg.py").write_text("import torch\n\ntorch.set_num_threads(8)\n")
    (job / "checkpoint_every.py").write_text("import torch\n\ntorch.set_num_threads(8)\n")
    f = _one(analyze(_oversubscribed_run(tmp_path, job, record_names)), "threads.oversubscribed")
    assert f.evidence["intra_op_threads"] == 8 and f.evidence["job_sets_threads"]
    text = " ".join(
        [f.title, f.summary, str(f.evidence)] + [p.summary + str(p.change) for p in f.prescriptions]
    )
    assert "checkpoint_every.py" not in text
    if record_names is None:  # the job set it somewhere the record does not show: its script after set-up
        assert f.evidence["thread_call"] is None
        (code,) = f.prescriptions
        assert code.change["code"]["file"] == str(job / "train.py")
    else:
        assert f.evidence["thread_call"] == {
            "file": str(job / "threadcfg.py"),
            "line": 3,
            "source": "torch.set_num_threads(8)",
        }
        (code,) = f.prescriptions
        assert (code.change["code"]["file"], code.change["code"]["line"]) == (str(job / "threadcfg.py"), 3)
        assert f"{job / 'threadcfg.py'}:3" in f.evidence["threads_from"]


def test_a_prescription_priced_at_no_gain_promises_nothing():
    """The savings model can price a fix below zero (more DataLoader workers on cores the step
    already fills): the prescription keeps its change but promises no gain, and says why."""
    from traindx.analyzers.core.chains import without_losing_prescriptions
    from traindx.analyzers.core.findings import Finding, Prescription

    workers = Prescription(
        kind="code", summary="num_workers=2", change={"code": {"line": 3}}, expected_gain_s_per_step=-0.00126
    )
    f = Finding(
        id="dataloader.starvation",
        title="t",
        severity="high",
        analyzer="dataloader",
        summary="The step waits for its batches.",
        prescriptions=(
            workers,
            Prescription(kind="code", summary="a faster collate", expected_gain_s_per_step=0.2),
            Prescription(kind="env", summary="unpriced"),
        ),
    )
    out = without_losing_prescriptions(f)
    assert [p.expected_gain_s_per_step for p in out.prescriptions] == [None, 0.2, None]
    assert out.prescriptions[0].change == workers.change
    assert "-1.3 ms" in out.prescriptions[0].summary
    assert out.evidence["unpriced"][0]["expected_gain_s_per_step"] == -0.00126


def test_host_time_spent_waiting_for_a_core_is_not_charged_to_its_line():
    """A recorded healthy Lightning run on a loaded 2-core machine, with the training thread's
    run-queue delay per sample and per step (tests/data/cpu-lightning-loaded/healthy-runq): the
    thread ran ~8 ms of each ~60 ms step; the host intervals' wall time is mostly the thread
    waiting for a core at the line its time slice ended in (two samples), which the wall-clock
    split charged to the framework's call at 12 % and 7 % of the step."""
    from traindx.analyzers.host import work as host_work
    from traindx.derive import ledger

    run = traindx.load_run(os.path.join(LOADED_LIGHTNING, "healthy-runq"))
    steady = ledger.steady_rows(run, "0")
    step_s = float(steady["wall_s"].mean())
    code = ledger.host_code(run)
    code = code[code["step"].isin(steady["step"])]
    per_line = code.groupby(["line", "call"])[["seconds", "runq_s", "samples"]].sum()
    per_line[["seconds", "runq_s"]] /= len(steady)
    # what the wall-clock split said: a line at >= 10 % of the step (a medium finding at the
    # 10 % floor compute lines then had)...
    top = per_line.sort_values("seconds").iloc[-1]
    assert top["seconds"] / step_s >= 0.10, per_line
    # ...whose samples saw the thread waiting for a core most of the time
    assert top["runq_s"] >= 0.5 * top["seconds"] and top["samples"] < host_work.MIN_SAMPLES
    cpu = run.of_type("cpu")
    cpu = cpu[cpu["step"].isin(steady["step"])]
    assert float(cpu["thread_runq_s"].sum()) > 0.5 * float(steady["wall_s"].sum())
    found = [
        (f.id, f.severity, round(f.share_of_step, 3))
        for f in host_work.analyze(run)
        if f.share_of_step >= host_work.MIN_SHARE
    ]
    assert found == []
    assert [f for f in analyze(run) if f.severity != "info"] == []


def test_a_gc_pause_spent_waiting_for_a_core_is_not_charged_to_gc():
    """A recorded healthy Lightning run on a loaded 2-core machine (ten busy loops beside it,
    tests/data/cpu-lightning-loaded/gc-preempted), the shim timing each GC pause of >= 1 ms with
    the training thread's CPU clock: one young-generation pass in steady step 4 took 7.2 ms of
    wall time for 0.2 ms of CPU, more than the 4.1 ms of CPU the thread got in the whole 23 ms
    step. Priced by its wall time it was 31 % of that step and 5 % of the steady steps' time."""
    from traindx.analyzers.core import step_causes
    from traindx.analyzers.host import gc_pauses
    from traindx.derive import ledger
    from traindx.derive.steptables import compile_spans, event_seconds, gc_frame, run_t0, step_table

    run = traindx.load_run(os.path.join(LOADED_LIGHTNING, "gc-preempted"))
    spans = run.of_type("span")
    pause = spans[(spans["cat"] == "gc") & (spans["generation"] == 0)].iloc[-1]
    wall_s = (pause["t"] - pause["start"]) / 1e9
    cpu = run.of_type("cpu")
    step_cpu = float(cpu[cpu["step"] == 4]["thread_cpu_s"].iloc[0])
    assert wall_s > step_cpu > 20 * pause["cpu"]
    steady = ledger.steady_rows(run, "0")
    assert 4 in set(steady["step"])
    # what the wall clock said: GC above gc_pauses' floor, and step 4's cause
    assert steady["gc_s"].sum() / steady["wall_s"].sum() >= gc_pauses.MIN_SHARE
    t0 = run_t0(run)
    table, _ = step_table(run, t0)
    secs = event_seconds(table, compile_spans(run, t0), gc_frame(run))
    step_causes.classify_steps(table, secs)
    assert table.set_index("step").loc[4, "cause"] == "gc"
    step_causes.classify_steps(table, secs, step_causes.without_core_wait(run, table, secs, t0))
    assert table.set_index("step").loc[4, "cause"] == "normal"
    # the pause's own cost: its CPU, against the steps' own time
    lost, share = gc_pauses._from_ledger(run, "0", 0.0, 0.0)
    assert share < gc_pauses.MIN_SHARE and lost < 0.001
    assert [f.id for f in step_causes.analyze(run, []) + gc_pauses.analyze(run)] == []


GC_HOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "cpu-gc-hook")


def test_a_gc_collect_called_every_step_is_named_at_its_line(tmp_path):
    """A recorded run (tests/data/cpu-gc-hook) whose end-of-step hook calls gc.collect(): the
    shim's own samples of the training thread (the ledger's host code) hold host lines but
    none inside the collection, which py-spy saw. The gc finding names the call's line and
    its first prescription deletes it (a loaded machine or a quiet one: the shim's sampler
    never runs inside the call)."""
    from traindx.derive import ledger

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run_dir = tmp_path / "run"
    shutil.copytree(os.path.join(GC_HOOK, "run"), run_dir)
    for path in run_dir.rglob("*"):  # the recorded checkout's paths -> this checkout's
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="surrogateescape")
            path.write_text(text.replace("/work/wt/mend", repo), encoding="utf-8", errors="surrogateescape")
    run = traindx.load_run(str(run_dir))
    code = ledger.host_code(run)
    assert len(code) and not (code["line"] == 13).any()  # the host samples never saw the call
    found = analyze(run)
    top = [
        f
        for f in found
        if f.severity != "info" and f.cause is None and not f.id.startswith(("verdict.", "traindx."))
    ][0]
    assert top.id == "gc.gen2_in_step"
    assert [(s["file"], s["line"]) for s in top.evidence["call_sites"]] == [
        ("tests/jobs/gc_in_step_hook.py", 13)
    ]
    edit = top.prescriptions[0].change["code"]
    assert edit["op"] == "delete" and edit["line"] == 13 and edit["before"].strip() == "gc.collect()"
    assert edit["file"] == os.path.join(repo, "tests", "jobs", "gc_in_step_hook.py")
    assert not [f for f in found if f.id == "host_work.call_site"]  # folded into the gc finding


def test_a_write_run_asynchronously_is_never_cut_off_at_exit(tmp_path):
    """host_work's "run it off the training thread" edit: a write (a file, a log line) goes on
    a non-daemon thread, so the run's end waits for it; a wait keeps a daemon thread (it may
    never end). Checked by running the edited statement the way the edit writes it."""
    import subprocess
    import sys

    from traindx.analyzers.host import work as host_work

    job = tmp_path / "loop.py"
    job.write_text(
        "import time\n"
        "def slow_write(path):\n"
        "    time.sleep(0.5)\n"
        "    open(path, 'w').write('done')\n"
        "slow_write(OUT)\n"
    )
    src = "slow_write(OUT)"
    (write,) = [
        p
        for p in host_work.line_prescriptions(
            "file", "loop.py:5", src, str(job), 5, 0.5, False, str(tmp_path)
        )
        if p.change
    ]
    (wait,) = [
        p
        for p in host_work.line_prescriptions(
            "sleep", "loop.py:5", src, str(job), 5, 0.5, False, str(tmp_path)
        )
        if p.change
    ]
    assert "daemon=False" in write.change["code"]["after"]
    assert "daemon=True" in wait.change["code"]["after"]
    out = tmp_path / "written.txt"
    edited = job.read_text().replace(src, write.change["code"]["after"].strip())
    script = tmp_path / "edited.py"
    script.write_text(f"OUT = {str(out)!r}\n" + edited)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == "done"  # the interpreter waited for the write


def test_host_code_whose_lines_call_no_library_still_names_the_top_line(monkeypatch):
    """py-spy samples in a host interval whose innermost frame is the job's own arithmetic have
    no library call (NaN in host_code's `call`). pandas' groupby drops NaN keys by default, so a
    step made only of such lines once left an empty table and an IndexError on an H200 run; the
    line must still be named, with no call."""
    from traindx.analyzers.gpu import idle as gpu_idle
    from traindx.derive import ledger

    run = traindx.load_run(os.path.join(LOADED_LIGHTNING, "healthy-runq"))
    code = ledger.host_code(run).copy()
    assert len(code)
    code["call"] = float("nan")
    monkeypatch.setattr(gpu_idle, "host_code", lambda _run: code)
    steps = sorted(set(code["step"]))
    top = gpu_idle._host_code_top(run, str(code["rank"].iloc[0]), steps)
    assert top is not None
    file, line, function, call, seconds = top
    assert call is None and line > 0 and seconds > 0
    heaviest = code.groupby(["file", "line"])["seconds"].sum().idxmax()
    assert (file, line) == heaviest
