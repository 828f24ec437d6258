"""`diagnose --fix`'s four mechanisms (config, source patch, runtime patch, package overlay),
none of which edits the user's files, and the origin tracing a source patch starts from (issue 14)."""

import hashlib
import json
import os
import shutil
import subprocess

import pandas as pd
import pytest
from fix_helpers import _finding, _line_of
from helpers import PY, ROOT, diagnose

import traindx
from traindx.analyzers.core.findings import Prescription
from traindx.fixing.run.loop import plan_fixes

# -- issue 14: four mechanisms, none of which edits the user's files -----------------------------
# A held-out packed-sequence job laid out like a framework (tests/jobs/fix_packed): its collator
# makes `max_seqlen = seqlens.max()` (a 0-dim tensor) in one module, its attention layer passes
# it to FA4's flash_attn_varlen_func in another. Nothing in traindx knows these files.

FIX_JOB = os.path.join(ROOT, "tests", "jobs", "fix_packed")
FIX_STEPS = "6"  # a 5-step steady window (steps 1-5): enough for an interval


def _hashes(folder):
    out = {}
    for dirpath, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _packed_fix(root, env, run_dir, *extra, baseline_from=None, check=True):
    """`diagnose --fix` of the held-out job in root/user (a copy of it); a finished baseline of
    the same command can be handed in (the loop measures it once and reuses it)."""
    user = root / "user"
    if not user.exists():
        shutil.copytree(FIX_JOB, user, ignore=shutil.ignore_patterns("__pycache__"))
    if baseline_from is not None:
        os.makedirs(run_dir, exist_ok=True)
        shutil.copytree(baseline_from, run_dir / "baseline")
    # (--no-warm-up: the warm-up arm after a kept change is the seed test's business)
    proc = diagnose(
        [
            "--fix",
            "--no-pyspy",
            "--quiet",
            "--no-warm-up",
            "--steps",
            FIX_STEPS,
            *extra,
            "--run-dir",
            str(run_dir),
            "--",
            PY,
            "train.py",
            "--threads",
            "1",
        ],
        cwd=user,
        env=env,
        timeout=1200,
    )
    assert proc.returncode == 0 or not check, proc.stdout[-2000:] + proc.stderr[-4000:]
    comparison = json.loads((run_dir / "candidate" / "comparison.json").read_text())
    return user, comparison, proc


@pytest.fixture(scope="module")
def packed_source_fix(tmp_path_factory, fa4_b17_path):
    root = tmp_path_factory.mktemp("packed")
    shutil.copytree(FIX_JOB, root / "user", ignore=shutil.ignore_patterns("__pycache__"))
    before = _hashes(root / "user")
    env = {"PYTHONPATH": fa4_b17_path, "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(root / "cache")}
    user, comparison, proc = _packed_fix(root, env, root / "fix")
    return {
        "root": root,
        "user": user,
        "before": before,
        "comparison": comparison,
        "proc": proc,
        "env": env,
        "fix": root / "fix",
    }


@pytest.mark.fa4
@pytest.mark.slow
def test_fix_patches_the_line_that_makes_the_tensor_on_a_scratch_copy(packed_source_fix):
    r = packed_source_fix
    fix_dir, user, comparison = r["fix"], r["user"], r["comparison"]
    made = _line_of(user / "packlib" / "collate.py", "seqlens.max()")
    passed = _line_of(user / "packlib" / "layers.py", "fout, flse = flash_attn_varlen_func")
    # the finding names both lines: where the tensor is made and where it reaches FA4
    findings = json.loads((fix_dir / "baseline" / "findings.json").read_text())
    leak = next(
        f
        for f in (findings["findings"] if isinstance(findings, dict) else findings)
        if f["id"] == "jit.fa4_steady_recompile"
    )
    assert f"packlib/collate.py:{made}" in leak["summary"]
    assert f"packlib/layers.py:{passed}" in leak["summary"]
    code = leak["prescriptions"][0]["change"]["code"]
    assert code["before"] == "max_seqlen = seqlens.max()"
    assert code["after"] == "max_seqlen = int(seqlens.max())"
    # fix.patch applies to a clean copy of the user's tree, and the user's tree is untouched
    patch = fix_dir / "fix.patch"
    clean = r["root"] / "clean"
    shutil.copytree(FIX_JOB, clean, ignore=shutil.ignore_patterns("__pycache__"))
    check = subprocess.run(["git", "apply", "--check", str(patch)], cwd=clean, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    subprocess.run(["git", "apply", str(patch)], cwd=clean, check=True)
    assert "max_seqlen = int(seqlens.max())" in (clean / "packlib" / "collate.py").read_text()
    assert _hashes(user) == r["before"]
    # the candidate ran the scratch copy, with the patched line, from the job's own folder (so
    # its relative paths, ../data and the like, mean what they meant)
    cand_manifest = json.loads((fix_dir / "candidate" / "manifest.json").read_text())
    assert cand_manifest["command"][1].startswith(str(fix_dir / "scratch"))
    assert cand_manifest["cwd"] == str(user)
    # and the recompiles are gone, with the same losses
    base, cand = comparison["baseline"], comparison["candidate"]
    assert base["compiles_in_window"] >= 2 and cand["compiles_in_window"] == 0
    assert comparison["speedup"] > 3 and comparison["speedup_ci95"][0] > 2
    assert comparison["loss_parity"]["passed"]
    assert comparison["verdict"] == "faster and numerically equivalent"
    change = comparison["changes"][0]
    assert change["mechanism"] == "source" and change["measured_step_time_s"] == cand["median_step_s"]
    assert change["predicted_step_time_s"] is not None
    fix = json.loads((fix_dir / "fix.json").read_text())
    assert any("git apply" in line for line in fix["apply"])
    assert any("(runtime)" in a for a in comparison["change"]["alternatives"])


@pytest.mark.fa4
@pytest.mark.slow
def test_fix_runtime_patch_proves_the_diagnosis_without_editing_code(packed_source_fix, tmp_path):
    r = packed_source_fix
    env = dict(r["env"], TRAINDX_FIX_MECHANISM="runtime")
    user, comparison, proc = _packed_fix(
        r["root"], env, tmp_path / "fix", baseline_from=r["fix"] / "baseline"
    )
    assert "reusing the finished run" in proc.stderr
    assert comparison["change"]["env"]["added"] == {"TRAINDX_RUNTIME_PATCHES": "fa4_int_max_seqlen"}
    assert not (tmp_path / "fix" / "fix.patch").exists() and _hashes(user) == r["before"]
    candidate = traindx.load_run(tmp_path / "fix" / "candidate")
    patched = candidate.events[candidate.events["type"] == "runtime_patch"]
    assert len(patched) == 1
    assert comparison["candidate"]["compiles_in_window"] == 0
    assert comparison["speedup"] > 3 and comparison["loss_parity"]["passed"]


def _b36_wheels(tmp_path):
    cached = os.path.join(ROOT, "tests", ".cache", "wheels")
    if os.path.isdir(cached) and any(n.startswith("flash_attn_4-4.0.0b36") for n in os.listdir(cached)):
        return cached
    proc = subprocess.run(
        [PY, "-m", "pip", "download", "-q", "--no-deps", "-d", str(tmp_path), "flash-attn-4==4.0.0b36"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        pytest.skip(f"no flash-attn-4 4.0.0b36 wheel: {proc.stderr.strip()[-200:]}")
    return str(tmp_path)


@pytest.mark.fa4
@pytest.mark.slow
def test_fix_overlay_upgrade_from_a_wheel_folder(packed_source_fix, tmp_path):
    r = packed_source_fix
    wheels = _b36_wheels(tmp_path / "wheels")
    # one arm: the overlay's own outcome, exit code included (no search past it)
    user, comparison, proc = _packed_fix(
        r["root"],
        r["env"],
        tmp_path / "fix",
        "--wheels",
        wheels,
        "--fix-tries",
        "1",
        baseline_from=r["fix"] / "baseline",
        check=False,
    )
    assert "overlay: installed" in proc.stderr
    assert comparison["overlay"]["installed"]["flash-attn-4"] == "4.0.0b36"
    loaded = {}
    for arm in ("baseline", "candidate"):
        run = traindx.load_run(tmp_path / "fix" / arm)
        row = run.events[run.events["type"] == "package_loaded"].iloc[0]
        loaded[arm] = (row["version"], row["file"])
    assert loaded["baseline"][0] == "4.0.0b17"
    assert loaded["candidate"][0] == "4.0.0b36"  # the candidate imported the overlay
    assert loaded["candidate"][1].startswith(str(tmp_path / "fix" / "overlay"))
    assert _hashes(user) == r["before"]
    assert any("pip install -U 'flash-attn-4>=4.0.0b26'" in a for a in comparison["change"]["apply"])
    if proc.returncode != 0:
        # On this CPU the newer FA4 reads the tensor max_seqlen's value on the host (sm_90), which
        # a fake device cannot serve; a GPU can. The loop must then say so, with the job's error.
        assert comparison["verdict"].startswith("candidate failed")
        assert any("DataDependentOutputException" in p for p in comparison["problems"])
    else:
        assert comparison["candidate"]["compiles_in_window"] == 0


def test_overlay_failure_is_one_line_and_the_candidate_falls_back(tmp_path):
    from traindx.fixing.run import overlay as fix_overlay

    (tmp_path / "empty").mkdir()
    with pytest.raises(fix_overlay.OverlayError) as exc:
        fix_overlay.install(
            str(tmp_path / "overlay"), ["flash-attn-4>=4.0.0b26"], wheels=str(tmp_path / "empty"), timeout=120
        )
    assert "could not install flash-attn-4>=4.0.0b26 from the wheels in" in exc.value.line
    assert "\n" not in exc.value.line and exc.value.tail  # pip's own last lines kept apart
    with pytest.raises(fix_overlay.OverlayError, match="no such folder"):
        fix_overlay.install(str(tmp_path / "o2"), ["x"], wheels=str(tmp_path / "missing"))


def test_plan_picks_the_preferred_mechanism_and_keeps_the_rest_listed(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "collate.py").write_text("def f(s):\n    max_seqlen = s.max()\n    return max_seqlen\n")
    code = Prescription(
        kind="code",
        summary="int at the origin",
        automatic=True,
        change={
            "code": {
                "file": str(source / "collate.py"),
                "line": 2,
                "before_line": "    max_seqlen = s.max()",
                "after_line": "    max_seqlen = int(s.max())",
            }
        },
    )
    runtime = Prescription(
        kind="runtime",
        summary="shim patch",
        automatic=True,
        change={"runtime": {"patch": "fa4_int_max_seqlen"}},
    )
    upgrade = Prescription(
        kind="upgrade",
        summary="upgrade",
        automatic=True,
        change={"upgrade": {"package": "flash-attn-4", "min_version": "4.0.0b26"}},
    )
    flag = Prescription(
        kind="arg",
        summary="fused attention",
        automatic=True,
        change={"arg": {"framework": "megatron", "set": {"--attention-backend": "fused"}}},
    )
    finding = _finding("jit.fa4_steady_recompile", code, runtime, upgrade, flag)
    cmd = ["python", str(source / "pretrain_gpt.py"), "--attention-backend", "flash"]
    old = os.getcwd()
    os.chdir(source)
    try:
        plan = plan_fixes(cmd, [finding], "r", environ={})
        assert [c["mechanism"] for c in plan.changes] == ["source"]
        assert plan.source_edits[0]["line"] == 2 and not plan.env
        plan = plan_fixes(cmd, [finding], "r", environ={"TRAINDX_FIX_MECHANISM": "runtime"})
        assert plan.env == {"TRAINDX_RUNTIME_PATCHES": "fa4_int_max_seqlen"}
        plan = plan_fixes(cmd, [finding], "r", environ={}, prefer="overlay")
        assert plan.overlays == ["flash-attn-4>=4.0.0b26"] and plan.fallbacks
        plan = plan_fixes(cmd, [finding], "r", environ={"TRAINDX_FIX_MECHANISM": "config"})
        assert plan.command[-2:] == ["--attention-backend", "fused"]  # the framework's flag
        assert sum("(source)" in a for a in plan.alternatives) == 1
        # a line that moved is found again; a line that is gone is not patched
        (source / "collate.py").write_text("import torch\n\ndef f(s):\n    max_seqlen = s.max()\n")
        plan = plan_fixes(cmd, [finding], "r", environ={})
        assert plan.source_edits[0]["line"] == 4
        (source / "collate.py").write_text("def f(s):\n    return s\n")
        plan = plan_fixes(cmd, [finding], "r", environ={})
        assert not plan.source_edits and plan.runtime_patches  # the next one applies
        assert any("no longer reads" in w for w in plan.warnings)
    finally:
        os.chdir(old)


def test_wrap_in_int_gives_code_that_parses():
    from traindx.analyzers.jit.jit import wrap_in_int

    assert wrap_in_int("    max_seqlen = seqlens.max()") == "    max_seqlen = int(seqlens.max())"
    assert (
        wrap_in_int('        "max_seqlen": cu_seqlens.diff().max(),')
        == '        "max_seqlen": int(cu_seqlens.diff().max()),'
    )
    assert (
        wrap_in_int("    max_seqlen=torch.max(lens), cu=cu,") == "    max_seqlen=int(torch.max(lens)), cu=cu,"
    )
    assert wrap_in_int("m = int(s.max())") is None  # already an int
    assert wrap_in_int("m = s.max(dim=0)") is None  # not a 0-dim max
    assert wrap_in_int("for x in y:") is None


def test_static_origin_scan_finds_the_assignment_in_the_job_source():
    from traindx.profiler.shim._traindx_shim import origins

    hits = origins.scan_file(os.path.join(FIX_JOB, "packlib", "collate.py"), {"max_seqlen"})
    line = _line_of(os.path.join(FIX_JOB, "packlib", "collate.py"), "seqlens.max()")
    assert hits == [(line, "max_seqlen", "    max_seqlen = seqlens.max()")]
    # the call site's variable name is what it searches for
    assert origins._call_names("attn(q, max_seqlen_q=batch.msl, max_seqlen_k=batch.msl)") == {"msl"}


def test_autotune_key_edit_drops_the_changing_argument(tmp_path):
    from traindx.fixing.plan import source as fix_source

    kernel = tmp_path / "kernels.py"
    kernel.write_text(
        "import triton\nimport triton.language as tl\n\n\n"
        "@triton.autotune(configs=[triton.Config({'BLOCK': 64}), triton.Config({'BLOCK': 128})],\n"
        "                 key=['n_tokens', 'D'])\n"
        "@triton.jit\n"
        "def rms_kernel(x, y, n_tokens, D, BLOCK: tl.constexpr):\n"
        "    pass\n"
    )
    edit = fix_source.autotune_key_edit("rms_kernel", ["n_tokens"], [str(kernel)])
    assert edit["line"] == 6 and edit["after_line"] == "                 key=['D'])"
    diff = fix_source.unified_diff(str(tmp_path), [edit])
    assert "-                 key=['n_tokens', 'D'])" in diff and "+                 key=['D'])" in diff
    assert fix_source.autotune_key_edit("rms_kernel", ["nothing"], [str(kernel)]) is None


def test_comparison_uses_one_window_and_no_interval_under_five_steps():
    from traindx.recipes import ab

    class Run:
        def __init__(self, times, profiled=()):
            self.steps = pd.DataFrame({"step": range(len(times)), "duration_s": times})
            self.log_steps = pd.DataFrame()
            self.events = pd.DataFrame()
            self.compiles = pd.DataFrame()
            self.spans = pd.DataFrame()
            self.manifest = {"exit_code": 0}
            self.command = ["python", "t.py"]
            self.path = "x"

    base, cand = Run([5.0, 1.0, 1.1, 1.0, 1.2, 1.0]), Run([2.0, 0.1, 0.11, 0.1])
    c = ab.compare_runs(base, cand)
    # the same steps on both sides (the candidate's 4), and no interval from 3 points
    assert c["baseline"]["window"] == c["candidate"]["window"] == [1, 3]
    assert c["speedup_ci95"] is None and "no confidence interval" in c["interval_note"]
    assert "per-step s" in ab.speedup_text(c)


def _autotune_run(tmp_path, kernel_file):
    """A run folder whose shim saw a Triton kernel of the job's own autotune at every step, its
    key's `n_rows` changing (as compiles.py records Autotuner.run)."""
    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    manifest = {
        "traindx_run": 1,
        "command": [PY, "train.py"],
        "cwd": str(tmp_path / "job"),
        "start_ns": 1,
        "end_ns": 2,
        "exit_code": 0,
        "status": "finished",
        "packages": {"flash-linear-attention": "0.3.0", "triton": "3.5.0"},
        "env": {},
        "options": {},
        "ranks": {},
        "missing": {},
        "host": {},
        "gpus": [],
    }
    (run / "manifest.json").write_text(json.dumps(manifest))
    t, lines = 10**18, []
    launch = _line_of(kernel_file, "rmsnorm_fwd[grid]")
    for step in range(8):
        lines.append({"type": "step_begin", "step": step, "t": t})
        tune = 1.5
        lines.append(
            {
                "type": "compile",
                "kind": "triton_autotune",
                "kernel": "rmsnorm_fwd",
                "start": t + 1000,
                "t": t + 1000 + int(tune * 1e9),
                "duration_s": tune,
                "step": step,
                "in_step": True,
                "thread": "MainThread",
                "thread_id": 1,
                "is_main_thread": True,
                "configs": 12,
                "caller": {"file": str(kernel_file), "line": launch, "function": "forward"},
                "key": repr({"n_rows": str(6000 + 97 * step), "D": "1024"}),
                "key_fields": {"n_rows": str(6000 + 97 * step), "D": "1024"},
            }
        )
        t += int((tune + 0.03) * 1e9)
        lines.append(
            {"type": "step_end", "step": step, "t": t, "source": "torch.optim", "duration_s": tune + 0.03}
        )
    (run / "events" / "0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


def test_triton_autotune_key_is_patched_in_the_kernels_own_terms(tmp_path):
    from traindx.analyzers.jit import jit

    job = tmp_path / "job"
    shutil.copytree(os.path.join(ROOT, "tests", "jobs", "fix_triton"), job)
    kernel_file = job / "fastnorm" / "kernels.py"
    run = traindx.load_run(_autotune_run(tmp_path, kernel_file))
    finding = next(f for f in jit.analyze(run) if f.id == "jit.autotune")
    assert finding.evidence["changing_key_fields"] == ["n_rows"]
    # Triton's own terms: no FLA_* switch for a kernel that is not flash-linear-attention's
    assert not any("FLA_" in json.dumps(p.change) for p in finding.prescriptions)
    first = finding.prescriptions[0]
    assert first.kind == "code" and first.automatic and "n_rows" in first.summary
    old = os.getcwd()
    os.chdir(job)
    try:
        plan = plan_fixes([PY, "train.py"], [finding], str(run.path), environ={})
    finally:
        os.chdir(old)
    edit = plan.source_edits[0]
    assert edit["file"] == str(kernel_file) and edit["after_line"].strip() == 'key=["D"])'
    from traindx.fixing.plan import source as fix_source

    diff = fix_source.unified_diff(str(job), plan.source_edits)
    assert diff.startswith("--- a/fastnorm/kernels.py\n+++ b/fastnorm/kernels.py\n")
    check = subprocess.run(
        ["git", "apply", "--check", "-"], cwd=job, input=diff, text=True, capture_output=True
    )
    assert check.returncode == 0, check.stderr


def test_origin_tracer_follows_the_tensor_back_to_where_it_was_made(monkeypatch):
    """The shim's tracer (origins.py) as FA4's entry drives it, on real torch tensors: armed by a
    tensor max_seqlen, it names the line that made the next one, through a `.to()` hop; a tensor
    that only a copy op touched (made in a DataLoader worker) goes to the source search."""
    import torch

    from traindx.profiler.shim._traindx_shim import origins

    seen = []
    monkeypatch.setattr(origins, "emit", lambda type_, **kw: seen.append(kw))
    monkeypatch.setattr(
        origins, "_state", {"armed": False, "done": False, "mode": None, "thread": None, "calls": 0}
    )
    lens = torch.tensor([5, 9, 3], dtype=torch.int32)

    def fa4_entry(**kwargs):
        # FA4's wrapped entry: the shim's hook runs one frame below the job's call (this test,
        # whose folder the source search then reads, as it reads a job's)
        origins._on_fa4_call((), kwargs, {})

    def collate():
        return lens.max()  # made here

    def move(t):
        return t.to(torch.int64)  # a hop on the way

    fa4_entry(max_seqlen_q=collate())  # arms the tracer
    assert origins._state["armed"] and torch._C._len_torch_function_stack() == 1
    made = collate()
    fa4_entry(max_seqlen_q=move(made))
    assert torch._C._len_torch_function_stack() == 0  # the mode is gone again
    event = seen[-1]
    assert event["method"] == "traced" and event["origin"]["function"] == "collate"
    assert event["origin"]["source"].strip() == "return lens.max()  # made here"
    assert [hop["function"] for hop in event["chain"]] == ["collate", "move"]

    seen.clear()
    monkeypatch.setattr(
        origins, "_state", {"armed": False, "done": False, "mode": None, "thread": None, "calls": 0}
    )
    from_worker = torch.tensor(9)  # as if unpickled from a worker
    fa4_entry(max_seqlen_q=from_worker)
    fa4_entry(max_seqlen_q=from_worker.clone())
    assert seen[-1]["method"] == "static" and seen[-1]["chain"][0]["op"] == "clone"
    # the search found the assignment that makes such a tensor in this folder's jobs
    assert any(c["source"].strip() == "max_seqlen = seqlens.max()" for c in seen[-1]["candidates"])
    assert torch._C._len_torch_function_stack() == 0
