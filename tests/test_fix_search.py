"""`diagnose --fix` on jobs shaped like public scripts: every concrete edit a measured candidate,
the search past a broken one, an arm measured again when a neighbour slowed it (issue 21)."""

import json
import os
import shutil
import subprocess

import numpy as np
import pytest
from fix_helpers import _line_of
from helpers import PY, diagnose
from records import RunBuilder

import traindx
from traindx.analyzers.codefix.flags import flag_value
from traindx.analyzers.core.findings import Prescription
from traindx.fixing.run.loop import set_flags


# -- every concrete edit a measured candidate (issue 21) ---------------------------------------------
def _job(name):
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs", name)


def _git_apply_to_clean_copy(tmp_path, files, patch):
    """fix.patch applies with `git apply` to a clean copy of the user's tree; returns the copy."""
    import shutil

    clean = tmp_path / "clean"
    clean.mkdir()
    for f in files:
        shutil.copy(f, clean / os.path.basename(f))
    subprocess.run(["git", "init", "-q"], cwd=clean, check=True)
    proc = subprocess.run(["git", "apply", str(patch)], cwd=clean, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return clean


def test_source_edits_delete_insert_and_own_flags(tmp_path):
    from traindx.fixing.plan import source as fix_source
    from traindx.fixing.plan.planner import own_flag_option

    script = tmp_path / "train.py"
    script.write_text(
        "import argparse, gc\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('--workers', type=int, default=0)\n"
        "p.add_argument('--log-every', dest='every', type=int, default=1)\n"
        "args = p.parse_args()\n"
        "model = dict(a=1,\n"
        "             b=2)\n"
        "for step in range(3):\n"
        "    if step % args.every == 0:\n"
        "        gc.collect()\n"
    )
    edits = [
        {"file": str(script), "line": 10, "before": "gc.collect()", "after": "", "op": "delete"},
        {
            "file": str(script),
            "line": 6,
            "last_line": 7,
            "before": "model = dict(a=1,",
            "after": "import gc; gc.freeze()",
            "op": "insert_after",
        },
    ]
    text = fix_source.patched_text(str(script), [fix_source.resolve_edit(e) for e in edits])
    lines = text.splitlines()
    assert lines[7] == "import gc; gc.freeze()"  # after the statement's last line
    assert lines[-1] == "        pass"  # the emptied block stays Python
    import ast

    ast.parse(text)
    flags = fix_source.argparse_flags(str(script))
    assert flags["every"]["flag"] == "--log-every" and flags["workers"]["default"] == 0
    assert fix_source.periodic_flag(str(script), 10, flags)["flag"] == "--log-every"
    code = Prescription(
        kind="code",
        summary="workers",
        automatic=True,
        change={
            "code": {
                "file": str(script),
                "line": 12,
                "before": "DataLoader(ds, num_workers=args.workers)",
                "after": "DataLoader(ds, num_workers=2, persistent_workers=True)",
            }
        },
    )
    flag = own_flag_option(code, ["python", str(script)], str(tmp_path))
    assert flag.change == {"arg": {"framework": "argparse", "set": {"--workers": "2"}}}
    # a config system with dotted overrides (minGPT's CfgNode: `--trainer.num_workers=0`), no
    # add_argument to read: the flag on the command line whose last part names the attribute
    trainer = tmp_path / "trainer.py"
    trainer.write_text("loader = DataLoader(ds, num_workers=config.num_workers)\n")
    code = Prescription(
        kind="code",
        summary="workers",
        automatic=True,
        change={
            "code": {
                "file": str(trainer),
                "line": 1,
                "before": "DataLoader(ds, num_workers=config.num_workers)",
                "after": "DataLoader(ds, num_workers=2, persistent_workers=True)",
            }
        },
    )
    command = ["python", "chargpt.py", "--trainer.batch_size=16", "--trainer.num_workers=0"]
    flag = own_flag_option(code, command, str(tmp_path))
    assert flag.change == {"arg": {"framework": "argparse", "set": {"--trainer.num_workers": "2"}}}
    assert set_flags(command, flag.change["arg"]["set"])[-1] == "--trainer.num_workers=2"
    assert own_flag_option(code, ["python", "chargpt.py", "--trainer.batch_size=16"], str(tmp_path)) is None


@pytest.mark.slow
def test_fix_engine_searches_past_a_broken_candidate_to_the_train_loader(tmp_path):
    """Python API, no argparse: the first candidate (the job's own --workers flag) is broken on
    purpose (its command gets an unknown flag: the job exits 2); the search goes on to the next
    one, the code edit of the loader the steps iterate (the train loader, not the test loader
    built after it with the same kwargs), measures it and keeps it in fix.patch."""
    from traindx.fixing.run.loop import FixOptions, _default_job, fix
    from traindx.profiler.launcher import Options

    job = _job("fix_two_loaders.py")
    events = []

    def run_job(command, run_dir, options):
        if os.path.basename(run_dir) == "candidate":
            command = command + ["--no-such-flag"]
        return _default_job(command, run_dir, options)

    result = fix(
        [PY, job],
        FixOptions(
            record=Options(steps=16, pyspy=False, extra_env={"OMP_NUM_THREADS": "1"}),
            run_dir=str(tmp_path / "fix"),
            cwd=str(tmp_path),
            reporter=events.append,
            run_job=run_job,
        ),
    )
    assert result.status == "done" and result.exit_code == 0
    first, second = result.arms[:2]
    assert first["mechanism"] == "config" and first["exit_code"] == 2 and not first["significant"]
    assert second["mechanism"] == "source" and second["significant"], second
    assert second["speedup"] >= 1.5 and second["loss_parity"] is True
    assert result.best == second["dir"]
    assert second["predicted_step_time_s"] and second["measured_step_time_s"]
    fix_json = json.loads((tmp_path / "fix" / "fix.json").read_text())
    assert fix_json["best"] == second["dir"] and len(fix_json["arms"]) == 2
    patch = (tmp_path / "fix" / "fix.patch").read_text()
    train_line = _line_of(job, "train_loader = DataLoader(")
    assert f"@@ -{train_line - 3}," in patch and "test_loader" not in "".join(
        l for l in patch.splitlines() if l.startswith(("+", "-")) and not l.startswith(("+++", "---"))
    )
    assert "+train_loader = DataLoader(Samples(400), shuffle=False, num_workers=2" in patch
    clean = _git_apply_to_clean_copy(tmp_path, [job], tmp_path / "fix" / "fix.patch")
    assert "num_workers=2" in (clean / "fix_two_loaders.py").read_text()
    assert any(e.kind == "comparison" for e in events) and any(
        "trying the next candidate" in e.text for e in events
    )
    # the card engine, no argparse: the kept arm's card carries its loss-parity check
    card = traindx.card(traindx.load_run(result.best), traindx.CardOptions(tokens_per_step=8))
    assert card.result.tokens_per_s_per_gpu > 0 and card.correctness["result"] == "pass"


def _checkpoint_record(command, run_dir, steps, slowed=1.0, seed=0):
    """The run folder tests/jobs/checkpoint_every.py's command leaves, built on a fake clock:
    each step ~60 ms of compute, and on every --save-every-th step its two torch.save calls
    (line 58 of the job, 180 ms each), every step `slowed` times as long (a neighbour on its
    core); the loss it prints in log.txt. What the loop reads of an arm, and nothing a load on
    this machine can move."""
    job = command[1]
    every = int(flag_value(command, "--save-every"))
    save = {"caller": {"file": job, "line": _line_of(job, "torch.save("), "function": "<module>"}}
    rng = np.random.default_rng(seed)
    b = RunBuilder(run_dir, command=command, cwd=os.path.dirname(run_dir))
    log = []
    for step in range(steps):
        spans = [("backward", 0.04 * rng.uniform(0.95, 1.05)), ("optimizer", 0.02 * rng.uniform(0.95, 1.05))]
        if step % every == every - 1:
            spans += [("io", 0.18 * rng.uniform(0.95, 1.05), {**save, "call": "torch.save"})] * 2
        b.step(sum(s[1] for s in spans) * slowed, spans=spans)
        log.append(f"{b.clock().ns} o step {step} loss {0.5 / (step + 1):.4f}\n")
    b.manifest.update(exit_code=0, status="finished")
    b.write()
    with open(os.path.join(run_dir, "log.txt"), "w") as f:
        f.writelines(log)
    return 0


def test_an_arm_slowed_by_a_neighbour_is_measured_again_and_judged_by_its_quicker_run(tmp_path):
    """During the first candidate arm only, a neighbour takes the job's core: each of that run's
    steps takes 8 times as long (so the arm misses its predicted gain). The loop measures it
    again, the candidate then the baseline (A B B A), judges each side by its quicker run, and
    keeps the change with a significant gain. Each arm's run is the record the checkpoint job's
    command leaves (_checkpoint_record), built, so no load decides the judgement; the same loop
    over real runs of that job: test_fix_measures_a_slowed_arm_again_with_real_runs_of_the_job."""
    from traindx.fixing.run.loop import FixOptions, fix
    from traindx.profiler.launcher import Options

    order = []
    work = tmp_path / "work"
    work.mkdir()

    def run_job(command, run_dir, options):
        name = os.path.basename(run_dir)
        order.append(name)
        slowed = 8.0 if name == "candidate" else 1.0
        return _checkpoint_record(command, run_dir, options.steps, slowed, seed=len(order))

    events = []
    result = fix(
        [PY, _job("checkpoint_every.py"), "--save-every", "2", "--steps", "60", "--vocab", "400000"],
        FixOptions(
            record=Options(steps=36, pyspy=False),
            run_dir=str(tmp_path / "fix"),
            cwd=str(work),
            tries=1,
            reporter=events.append,
            run_job=run_job,
        ),
    )
    assert order == ["baseline", "candidate", "candidate-again", "baseline-again"], (order, result.arms)
    _assert_measured_again_and_kept(tmp_path / "fix", result, events)


@pytest.mark.slow
@pytest.mark.serial  # the checkpoint job's period-2 cost, judged by its mean: alone
def test_fix_measures_a_slowed_arm_again_with_real_runs_of_the_job(tmp_path):
    """The loop of the test above over real runs of tests/jobs/checkpoint_every.py (the one test
    of a real repeat: the repeated arms started as processes and loaded): the baseline, the
    candidate's second run and the baseline's second run are the job's, recorded. The first
    candidate run is the one a neighbour slowed, built from the baseline's own record with every
    step 3 times as long (a real slowed run was 8x the candidate's steps, ~20 s of the test).
    Then the prescribed edit, and it pays (the checkpoint_every row of test_fix_applies_the_
    prescribed_edit_and_it_pays, checked here): --save-every raised, >= 1.5x by the means."""
    from traindx.fixing.run.loop import FixOptions, _default_job, fix
    from traindx.profiler.launcher import Options

    order = []
    work = tmp_path / "work"
    work.mkdir()

    def run_job(command, run_dir, options):
        order.append(os.path.basename(run_dir))
        if os.path.basename(run_dir) != "candidate":
            return _default_job(command, run_dir, options)
        baseline = traindx.load_run(str(tmp_path / "fix" / "baseline"))
        b = RunBuilder(run_dir, command=command, cwd=str(work))
        for d in baseline.steps["duration_s"]:
            b.step(3 * float(d))
        b.manifest.update(exit_code=0, status="finished")
        b.write()
        return 0

    events = []
    result = fix(
        # a checkpoint ~4x the step's compute: the change wins ~3x, well clear of the noise
        # of a loaded machine in a period-2 cost's mean (2x measured 1.48x, interval from 0.99)
        [PY, _job("checkpoint_every.py"), "--save-every", "2", "--steps", "60", "--vocab", "400000"]
        + list(SAVE_IN_MEMORY),
        FixOptions(
            record=Options(steps=36, pyspy=False, extra_env={"OMP_NUM_THREADS": "1"}),
            run_dir=str(tmp_path / "fix"),
            cwd=str(work),
            tries=1,
            reporter=events.append,
            run_job=run_job,
        ),
    )
    assert order == ["baseline", "candidate", "candidate-again", "baseline-again"], (order, result.arms)
    for name in ("candidate-again", "baseline-again"):  # the job's own runs, as the baseline's
        manifest = json.loads((tmp_path / "fix" / name / "manifest.json").read_text())
        assert manifest["status"] == "finished" and manifest["pid"], manifest
    _assert_measured_again_and_kept(tmp_path / "fix", result, events)


def _assert_measured_again_and_kept(root, result, events):
    """The first pair lost (the disturbed run is never the one judged), the repeat judged on the
    quicker runs, and the prescribed edit kept: the job's own --save-every raised, judged by the
    means (a period-2 cost: the median sits in one mode), no patch of the job's source."""
    arm = result.arms[0]
    first = arm["repeat"]["first"]
    assert first["judged_speedup"] < 1, first
    assert first["judged_speedup"] < arm["judged_speedup"], arm
    assert arm["repeat"]["judged_on"][1] == str(root / "candidate-again"), arm
    assert arm["mechanism"] == "config" and result.best == arm["dir"], arm
    assert arm["significant"], arm
    assert any("measured again" in e.text for e in events)
    comparison = json.loads((root / "candidate" / "comparison.json").read_text())
    assert any(p.startswith("measured twice") for p in comparison["problems"])
    fix_json = json.loads((root / "fix.json").read_text())
    kept = fix_json["kept"]
    assert kept["dir"] == arm["dir"] and kept["judged_speedup"] >= 1.5, kept
    assert kept["loss_parity"] is not False
    assert kept["predicted_step_time_s"] is not None and kept["measured_step_time_s"] is not None
    assert comparison["speedup_statistic"] == "mean", comparison["step_periods"]
    assert "--save-every 20" in " ".join(fix_json["apply"]), fix_json["apply"]
    assert not (root / "fix.patch").exists()


def test_merge_engine_returns_the_merged_run(tmp_path):
    """`traindx.merge(run_dir)`: the node parts of a multi-node run merged and loaded."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import synth_run

    run_dir = str(tmp_path / "RUN")
    synth_run.write_multinode(run_dir, nodes=2, per_node=2, steps=6, seed=1)
    run = traindx.merge(run_dir)
    assert isinstance(run, traindx.RunRecord) and run.manifest["status"] == "merged"
    assert len(run.manifest["nodes"]) == 2 and set(run.steps["rank"]) == {"0", "1", "2", "3"}
    assert os.path.isfile(os.path.join(run_dir, "clock.json"))
    from traindx.common.errors import UserError

    with pytest.raises(UserError, match="not a multi-node run"):
        traindx.merge(str(tmp_path))


# the checkpoints in memory where the machine has room: a save then costs its serialization, not
# whatever else the disk is doing (beside a test suite one disk write took 0.67 s against the
# others' 0.12-0.22 s, and the candidate's one save in its window decided the interval)
SAVE_IN_MEMORY = (
    ["--save-dir", "/dev/shm"]
    if os.path.isdir("/dev/shm")
    and os.access("/dev/shm", os.W_OK)
    and shutil.disk_usage("/dev/shm").free > 2**30
    else []
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "job,args,steps,mechanism,expect",
    [
        ("fix_gc_every_step.py", ["--index-size", "150000"], 16, "source", "-    gc.collect()"),
        # (the checkpoint every 2 steps raised by the job's own --save-every, a period-2 cost
        # judged by its mean: checked on the serial --fix of that job above,
        # test_fix_measures_a_slowed_arm_again_with_real_runs_of_the_job)
        ("fix_hf_workers.py", [], 16, "config", "--workers 2"),
    ],
)
def test_fix_applies_the_prescribed_edit_and_it_pays(tmp_path, job, args, steps, mechanism, expect):
    """Jobs shaped like public scripts, one cause each costing >= 40 % of the step: a per-step
    gc.collect() (removed by a source patch), an HF Trainer whose dataloader_num_workers comes from the job's
    --workers (the flag set, not a literal)."""
    path = _job(job)
    fix_dir = tmp_path / "fix"
    proc = diagnose(
        [
            "--fix",
            "--no-pyspy",
            "--quiet",
            "--steps",
            str(steps),
            "--fix-tries",
            "2",
            "--run-dir",
            str(fix_dir),
            "--",
            PY,
            path,
            *args,
        ],
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fix = json.loads((fix_dir / "fix.json").read_text())
    kept = fix["kept"]
    assert kept and kept["mechanism"] == mechanism and kept["significant"], fix["arms"]
    # judged by the median, or by the mean for a periodic cost (the median sits in one mode)
    assert kept["judged_speedup"] >= 1.5 and kept["loss_parity"] is not False
    assert kept["predicted_step_time_s"] is not None and kept["measured_step_time_s"] is not None
    if mechanism == "source":
        patch = fix_dir / "fix.patch"
        assert expect in patch.read_text()
        before = open(path).read()
        clean = _git_apply_to_clean_copy(tmp_path, [path], patch)
        assert "    gc.collect()\n" not in (clean / job).read_text() and open(path).read() == before
    else:
        assert expect in " ".join(fix["apply"]) and not (fix_dir / "fix.patch").exists()


@pytest.mark.slow
def test_fix_moves_unneeded_host_work_of_a_lightning_step_to_a_thread(tmp_path):
    """A real Lightning Trainer whose training_step reads a file and waits for a slow store on
    every step, the result unused (most of the step): --fix runs that line's work on a thread in
    a patched copy, >= 1.5x with loss parity, and fix.patch applies to a clean copy."""
    path = _job("fw_lightning.py")
    fix_dir = tmp_path / "fix"
    proc = diagnose(
        [
            "--fix",
            "--no-pyspy",
            "--quiet",
            "--steps",
            "16",
            "--fix-tries",
            "2",
            "--run-dir",
            str(fix_dir),
            "--",
            PY,
            path,
            "--max-steps",
            "60",
            "--side-read",
            "0.08",
        ],
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fix = json.loads((fix_dir / "fix.json").read_text())
    kept = fix["kept"]
    assert kept and kept["finding"] == "host_work.code" and kept["mechanism"] == "source", fix["arms"]
    assert kept["significant"] and kept["judged_speedup"] >= 1.5 and kept["loss_parity"] is not False
    patch = (fix_dir / "fix.patch").read_text()
    assert (
        "-            blob = open(__file__" in patch
        and "threading').Thread(target=lambda: time.sleep(" in patch
    )
    clean = _git_apply_to_clean_copy(tmp_path, [path], fix_dir / "fix.patch")
    ast_ok = compile((clean / "fw_lightning.py").read_text(), "fw_lightning.py", "exec")
    assert ast_ok is not None


# -- an arm whose only change failed to apply is not run ------------------------------------------
def test_a_plan_whose_only_change_failed_has_nothing_left_to_measure():
    """The planner's decision: a source patch (or an overlay) that failed, with nothing else in
    the plan, leaves nothing to measure; a fallback, an env, a precompile still do."""
    from traindx.fixing.plan.planner import Plan

    row = {"finding": "f", "mechanism": "source", "summary": "edit", "failed": True}
    edit = [{"file": "train.py", "line": 1, "before": "a", "after": "b"}]
    assert not Plan(command=["python", "train.py"], source_edits=edit, changes=[row]).changes_left
    assert Plan(
        command=["python", "train.py"], source_edits=edit, changes=[dict(row, failed=False)]
    ).changes_left
    fallback = {"finding": "f", "mechanism": "runtime", "summary": "patch", "instead_of": "source"}
    assert Plan(command=["python"], runtime_patches=["p"], changes=[row, fallback]).changes_left
    assert Plan(command=["python"], env={"X": "1"}, changes=[row]).changes_left
    assert Plan(command=["python"], precompile=["run"], changes=[row]).changes_left


def test_an_arm_whose_only_change_failed_is_recorded_not_run_and_the_search_goes_on(tmp_path, monkeypatch):
    """The first candidate's source edit does not parse (its patch fails at the arm's preparation)
    and nothing else is in its plan: it is not run (no job started for it), fix.json's arm and the
    next arm's search say why, the terminal too; the next candidate is measured. Each job here is
    a recorded run copied into the arm's folder."""
    from traindx.fixing.plan.planner import Candidate, Plan
    from traindx.fixing.run import runner
    from traindx.fixing.run.loop import FixOptions, FixResult
    from traindx.profiler.launcher import Options

    recorded = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "cpu-gc-hook", "run")
    script = tmp_path / "train.py"
    script.write_text("x = 1\nprint(x)\n")
    command = [PY, str(script)]
    broken = Plan(
        command=command,
        source_edits=[{"file": str(script), "line": 1, "before": "x = 1", "after": "x = (", "finding": "f"}],
        changes=[
            {"finding": "f", "mechanism": "source", "summary": "edit x", "predicted_saving_s_per_step": 0.1}
        ],
    )
    env_plan = Plan(
        command=command,
        env={"X_FLAG": "1"},
        changes=[
            {
                "finding": "g",
                "mechanism": "config",
                "summary": "X_FLAG=1",
                "predicted_saving_s_per_step": 0.05,
            }
        ],
    )
    candidates = [
        Candidate(broken, "f", "source", "edit x", 0.1),
        Candidate(env_plan, "g", "config", "X_FLAG=1", 0.05),
    ]
    monkeypatch.setattr(runner, "candidate_plans", lambda *a, **k: (candidates, Plan(command=command)))
    ran, events = [], []

    def run_job(command, run_dir, options):
        ran.append(os.path.basename(run_dir))
        shutil.rmtree(run_dir)
        shutil.copytree(recorded, run_dir, ignore=shutil.ignore_patterns("findings.json", "report.html"))
        return 0

    root = tmp_path / "fix"
    root.mkdir()
    options = FixOptions(run_dir=str(root), repeat_inconclusive=False, warm_up_after_fix=False)
    result = FixResult(root=str(root), status="baseline", exit_code=0, baseline=str(root / "baseline"))
    say = lambda kind, text="", **data: events.append((kind, text))  # noqa: E731
    runner.run_loop(command, options, Options(cwd=str(tmp_path)), str(tmp_path), run_job, say, result, None)

    assert ran == ["baseline", "candidate-2"], ran
    first, second = result.arms
    assert first["exit_code"] is None and not first["significant"] and first["speedup"] is None
    assert "source patch failed" in first["not_run"] and "does not parse" in first["not_run"], first
    assert first["verdict"].startswith("not run: ") and second.get("not_run") is None
    assert result.exit_code == 0 and result.best != first["dir"]
    search = json.loads((root / "candidate-2" / "comparison.json").read_text())["search"]
    assert search[0]["arm"] == "candidate" and search[0]["not_run"] == first["not_run"]
    said = [text for _, text in events]
    assert any(t.startswith("candidate: not run: source patch failed") for t in said), said
    assert not any("the candidate runs with no source change" in t for t in said), said
