"""The JIT analyzer end to end: the seed case (FA4 recompiling its backward because max_seqlen
is a tensor) reproduced on the CPU with the real flash-attn-4 4.0.0b17 and the newest release,
torch.compile recompiles, a py-spy recording from an H200 alone, and the healthy example.

Every case runs the real `diagnose` on a real example, as a user does."""

import json
import os
import re

import pytest
from conftest import fa4_available
from helpers import PY, ROOT, diagnose, example, recorded_runs_here
from records import RunBuilder

import traindx
from traindx.report.outputs import analyze_and_write, read_findings

FA4_SEED = example("fa4_seed.py")
FIXTURE = os.path.join(ROOT, "tests", "data", "h200-fa4-b17-tensor-maxseqlen.speedscope.json")
# small and quick: one layer, short sequences; the compile time is what costs
# the checkout the stored runs of tests/data/cpu-compile-recompiles were recorded in (its README)
RECORDED_IN = "/work/wt-suite"
SEED_ARGS = ["--min-len", "136", "--max-len", "192", "--tokens", "384", "--threads", "1"]
requires_fa4 = pytest.mark.skipif(not fa4_available(), reason="flash-attn-4 is not installed")


def _call_line():
    """The line of examples/fa4_seed.py that passes max_seqlen to flash_attn_varlen_func."""
    with open(FA4_SEED, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if "flash_attn_varlen_func(" in line and "max_seqlen_q=max_seqlen" in line:
                return n
    raise AssertionError("no flash_attn_varlen_func call passing max_seqlen in the example")


def _backward_arg_line():
    """The line of examples/fa4_seed.py's own call of FA4's backward that passes max_seqlen."""
    with open(FA4_SEED, encoding="utf-8") as f:
        lines = f.read().splitlines()
    start = next(n for n, line in enumerate(lines, 1) if "flash_attn_bwd(" in line)
    return next(n for n in range(start, start + 5) if "max_seqlen_q=max_seqlen" in lines[n - 1])


def _record(tmp_path_factory, name, command, env=None, steps=3, pyspy=False):
    cwd = tmp_path_factory.mktemp(name)
    run_dir = cwd / "run"
    options = ["--quiet", "--steps", str(steps), "--run-dir", str(run_dir)]
    if not pyspy:
        options.insert(0, "--no-pyspy")
    proc = diagnose([*options, "--", *command], cwd=ROOT, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return traindx.load_run(run_dir), read_findings(str(run_dir)), proc


def _jit(findings):
    return {f.id: f for f in findings if f.analyzer == "jit"}


# -- the seed case: 4.0.0b17, max_seqlen as a tensor -----------------------------------------------
@pytest.fixture(scope="module")
def b17_tensor(seed_fix):
    """The baseline arm of conftest's seed_fix (`diagnose --fix` of the seed job, py-spy on: the
    compiling thread's hold on the GIL is part of the finding), a plain recording of the job
    before any change; the process's stderr opens with its summary. This was a diagnose run of
    its own, of the same job with shorter sequences: test_fix.py's seed test runs it anyway."""
    _, fix_dir, _, proc = seed_fix
    run_dir = fix_dir / "baseline"
    return traindx.load_run(run_dir), read_findings(str(run_dir)), proc


@pytest.mark.fa4
@requires_fa4
@pytest.mark.slow
@pytest.mark.xdist_group("fa4_seed_fix")  # conftest's seed_fix, shared with test_fix.py
def test_b17_tensor_backward_recompiles_every_step_names_field_and_line(b17_tensor):
    run, findings, proc = b17_tensor
    assert run.manifest["packages"]["flash-attn-4"] == "4.0.0b17"
    found = _jit(findings)
    assert "jit.fa4_steady_recompile" in found, [(f.id, f.title) for f in findings]
    f = found["jit.fa4_steady_recompile"]
    assert f.severity in ("high", "critical")
    assert f.evidence["fa4_function"] == "_flash_attn_bwd"
    assert set(f.steps_affected) == {1, 2}  # every step after the first
    assert {"single_q_block", "single_k_block"} & set(f.evidence["changing_key_fields"])
    assert f.evidence["tensor_key_fields"]
    # compiled on the backward thread while the main thread waited
    assert f.evidence["on_main_thread"] is False
    assert "pt_autograd_0" in f.evidence["threads"]
    assert f.seconds_lost_per_step > 0.5 and f.share_of_step > 0.3
    line = _call_line()
    caller = f.evidence["caller"]
    assert caller["file"].endswith(os.path.join("examples", "fa4_seed.py")) and caller["line"] == line
    assert f"examples/fa4_seed.py:{line}" in f.summary
    # the first prescription is a real code change in the job's own file (where the tensor is
    # made when the tracer saw it, else at the FA4 call), never one of the job's flags: traindx
    # knows nothing of this script's --max-seqlen-as
    first = f.prescriptions[0]
    assert first.automatic and first.kind == "code" and "arg" not in first.change
    code = first.change["code"]
    assert code["file"].endswith(os.path.join("examples", "fa4_seed.py"))
    assert "int(" in code["after"] and "int(" not in code["before"]
    if code.get("role") == "call_site":
        # the job calls FA4's backward itself, with the max_seqlen its forward saved: the same
        # edit casts at that call too (the line of the call that names the argument)
        lines = {c["line"] for c in first.change.get("codes") or [code]}
        assert {line, _backward_arg_line()} <= lines, first.change
    upgrade = [p for p in f.prescriptions if p.kind == "upgrade"]
    assert upgrade and upgrade[0].change["upgrade"] == {"package": "flash-attn-4", "min_version": "4.0.0b26"}
    assert not any("--max-seqlen-as" in str(p.change) for p in f.prescriptions)
    # the terminal summary leads with it
    assert f"examples/fa4_seed.py:{line}" in proc.stderr
    # the headline is the root cause, whatever the machine's load: a GIL hold by the compiling
    # thread is its symptom (no prescription of its own, its seconds not counted again)
    roots = [x for x in findings if x.cause is None and x.severity != "info"]
    assert roots[0].id == "jit.fa4_steady_recompile", [(x.id, x.severity, x.cause) for x in findings]
    assert proc.stderr.index("Verdict:") < proc.stderr.index(f"examples/fa4_seed.py:{line}")
    for g in (x for x in findings if x.id == "gil.contention" and x.evidence.get("compiling")):
        assert g.cause == f.id and g.id in f.symptoms and g.prescriptions == ()
    assert not any(
        "off the training process" in p.summary for x in findings if x.cause is None for p in x.prescriptions
    )
    # savings come from the ledger's compile line over the steps after the kernel's first compile
    # (the finding names that step: the steps are the finding's, not chosen here) and never
    # exceed the step
    steady = run.ledger[run.ledger["step"] > f.evidence["first_step"]]
    assert len(steady) >= 2
    assert first.expected_gain_s_per_step <= steady["wall_s"].mean() + 1e-9
    assert first.expected_gain_s_per_step == pytest.approx(steady["compile_s"].mean(), rel=1e-6)


@pytest.mark.fa4
@requires_fa4
@pytest.mark.slow
@pytest.mark.xdist_group("fa4_seed_fix")  # conftest's seed_fix, shared with test_fix.py
def test_b17_tensor_shim_compile_events(b17_tensor):
    run, _, _ = b17_tensor
    compiles = run.compiles
    bwd = compiles[compiles["kernel"].str.startswith("_flash_attn_bwd:")]
    assert len(bwd) == 3 and list(bwd["step"]) == [0, 1, 2]
    assert set(bwd["thread"]) == {"pt_autograd_0"} and not bwd["is_main_thread"].any()
    fields = bwd.iloc[-1]["key_fields"]
    assert "single_q_block" in fields and "arch" in fields and "head_dim" in fields
    assert bwd.iloc[-1]["key_types"]["single_q_block"] == "Tensor"
    assert bwd.iloc[-1]["fa4"]["max_seqlen"]["max_seqlen_q"]["type"] == "Tensor"
    assert (bwd["duration_s"] > 0.1).all()
    calls = run.events[run.events["type"] == "fa4_call"]
    assert len(calls) >= 3
    call = calls.iloc[0]
    assert call["arg_types"]["max_seqlen_q"] == "Tensor" and call["is_main_thread"]
    assert call["caller"]["line"] == _call_line() and call["duration_s"] > 0
    assert list(calls["step"])[:3] == [0, 1, 2]


@pytest.mark.fa4
@requires_fa4
@pytest.mark.slow
@pytest.mark.xdist_group("fa4_seed_fix")  # conftest's seed_fix, shared with test_fix.py
def test_b17_tensor_gil_evidence_from_pyspy(b17_tensor):
    run, findings, _ = b17_tensor
    if "pyspy" in run.missing:
        pytest.skip(f"py-spy could not sample here: {run.missing['pyspy']}")
    f = _jit(findings)["jit.fa4_steady_recompile"]
    assert f.evidence["gil_share_compiling"] > 0.2


@pytest.mark.fa4
@requires_fa4
@pytest.mark.slow
@pytest.mark.xdist_group("fa4_seed_fix")  # conftest's seed_fix, shared with test_fix.py
def test_b17_tensor_pyspy_alone_counts_the_same_recompiles(b17_tensor):
    """What `diagnose attach` would have: the same run's py-spy recording without the shim."""
    from traindx.analyzers.jit.jit import analyze_recording

    run, _, _ = b17_tensor
    if ("0", "all") not in run.pyspy:
        pytest.skip(f"py-spy could not sample here: {run.missing.get('pyspy')}")
    found = [
        f
        for f in analyze_recording(run.pyspy[("0", "all")], recording_gil=run.pyspy.get(("0", "gil")))
        if f.id == "jit.fa4_steady_recompile"
    ]
    assert len(found) == 1, [f.title for f in found]
    ev = found[0].evidence
    assert ev["thread"] == "pt_autograd_0" and ev["is_main_thread"] is False
    assert ev["call_site"].startswith("_flash_attn_bwd (") and ev["compiles"] == 3
    assert ev["gil_share_compiling"] > 0.2


# -- 4.0.0b17 with an int: only the cold start ----------------------------------------------------
@pytest.mark.fa4
@requires_fa4
@pytest.mark.slow
def test_b17_int_only_cold_start_prescribes_kernel_cache(tmp_path_factory, fa4_b17_path):
    run, findings, _ = _record(
        tmp_path_factory,
        "b17-int",
        [PY, FA4_SEED, "--max-seqlen-as", "int", *SEED_ARGS],
        env={"PYTHONPATH": fa4_b17_path},
        steps=3,
    )
    found = _jit(findings)
    assert set(found) == {"jit.cold_start"}, [(f.id, f.title) for f in found.values()]
    bwd = run.compiles[run.compiles["kernel"].str.startswith("_flash_attn_bwd:")]
    assert len(bwd) == 1 and int(bwd.iloc[0]["step"]) == 0
    cold = found["jit.cold_start"]
    warm = [p for p in cold.prescriptions if p.kind == "precompile"]
    assert warm and warm[0].automatic
    assert warm[0].change["precompile"] == {"from_run": run.path}
    assert warm[0].change["env"]["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    assert "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR" in warm[0].change["env"]
    assert f"kernel-cache warm --from-run {run.path}" in warm[0].summary


# -- the newest release with a tensor: fixed upstream ---------------------------------------------
@pytest.mark.fa4
@requires_fa4
@pytest.mark.slow
def test_newest_fa4_tensor_no_steady_recompile(tmp_path_factory):
    run, findings, _ = _record(
        tmp_path_factory, "new-tensor", [PY, FA4_SEED, "--max-seqlen-as", "tensor", *SEED_ARGS], steps=3
    )
    version = run.manifest["packages"]["flash-attn-4"]
    assert re.match(r"4\.0\.0b(\d+)$", version) and int(version.split("b")[-1]) >= 26, version
    found = _jit(findings)
    assert "jit.fa4_steady_recompile" not in found, found
    assert "jit.cold_start" in found
    bwd = run.compiles[run.compiles["kernel"].str.startswith("_flash_attn_bwd:")]
    assert len(bwd) == 1


# -- py-spy alone: the H200 recording --------------------------------------------------------------
@pytest.mark.slow  # `diagnose analyze` of the whole H200 py-spy recording
def test_h200_pyspy_file_alone_finds_backward_recompiling_on_autograd_thread(tmp_path):
    out = tmp_path / "findings.json"
    proc = diagnose(["analyze", FIXTURE, "-o", str(out)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    findings = json.loads(out.read_text())
    steady = [f for f in findings if f["id"] == "jit.fa4_steady_recompile"]
    assert len(steady) == 1, [f["title"] for f in findings]
    f = steady[0]
    ev = f["evidence"]
    assert ev["call_site"].startswith("_flash_attn_bwd (flash_attn/cute/interface.py:")
    assert ev["is_main_thread"] is False and ev["thread"] != "MainThread"
    # the first backward call compiles cold; each of the 3 later calls compiles again
    assert ev["compiles"] == 4 and ev["calls_that_recompiled"] == [1, 2, 3]
    assert all(2.0 < s < 3.2 for s in ev["seconds_each"][1:])  # FACTS §1: 2.4-2.7 s each
    assert ev["kernel_source"].endswith("flash_bwd_sm90.py")
    assert f["severity"] == "critical"
    kinds = [p["kind"] for p in f["prescriptions"]]
    assert kinds[:2] == ["code", "upgrade"]
    printed = " ".join(proc.stderr.split())  # the terminal wraps long lines
    assert "_flash_attn_bwd compiling 4 times" in printed and "every later call" in printed
    # the forward compiled once: not a finding
    assert not [x for x in findings if "_flash_attn_fwd" in x["evidence"].get("call_site", "")]


def test_analyze_rejects_what_is_not_evidence(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("this is not a py-spy file\n")
    proc = diagnose(["analyze", str(bad)], cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "diagnose: error:" in proc.stderr
    proc = diagnose(["analyze", str(tmp_path / "missing")], cwd=tmp_path)
    assert proc.returncode != 0 and "no such run folder or file" in proc.stderr


# -- torch.compile on changing shapes -------------------------------------------------------------
def test_dynamo_recompiles_on_changing_shapes_with_reason(tmp_path):
    """examples/compile_dynamic.py (dynamic=False, a new sequence length every step, inductor),
    judged on its run recorded once (tests/data/cpu-compile-recompiles.README: a cold inductor
    compile of three shapes was ~80 s of the suite on CI); a real recompiling job recorded and
    fixed end to end: test_fix_classes.py's test_fix_compiles_with_dynamic_shapes_and_the_recompiles_stop."""
    recorded_runs_here("cpu-compile-recompiles", tmp_path, RECORDED_IN)
    run = traindx.load_run(str(tmp_path / "dynamo"))
    judged, _ = analyze_and_write(run)  # what the recording writes when its job ends
    findings = list(judged.findings)
    found = _jit(findings)
    assert "jit.dynamo_recompile" in found, [(f.id, f.title) for f in findings]
    f = found["jit.dynamo_recompile"]
    assert any("size mismatch at index 1" in r for r in f.evidence["reasons"])
    assert f.evidence["recompiles"] >= 2 and {1, 2} <= set(f.steps_affected)
    assert f.seconds_lost_per_step > 0
    # the advice is torch's own (mark_dynamic), never one of the script's flags
    assert "mark_dynamic" in f.prescriptions[0].summary
    assert not any("arg" in p.change for p in f.prescriptions)
    assert any("mark_dynamic" in p.summary and "dynamic=True" in p.summary for p in f.prescriptions)
    # the re-analysis of the same folder gives the same finding
    proc = diagnose(["analyze", run.path, "--json"], cwd=run.path)
    assert proc.returncode == 0, proc.stderr
    again = [d for d in json.loads(proc.stdout) if d["id"] == "jit.dynamo_recompile"]
    assert again and again[0]["evidence"]["reasons"] == f.evidence["reasons"]
    assert os.path.exists(os.path.join(run.path, "findings.json"))


# -- the healthy example: no jit finding at any severity: tests/test_analyzers.py
# (test_healthy_example_has_no_jit_finding, on that module's recorded healthy run)


# -- what cannot run on a CPU: Triton autotuning, other frameworks' commands ------------------------
def _synthetic_run(path, command, compiles, step_s=1.0, steps=4, packages=None, caller_file="/job/model.py"):
    """A run folder as the shim writes it (Triton cannot run without a GPU), built in code
    (tests/records.py): steps of step_s seconds and the given compile events (kind, kernel,
    step, seconds, key_fields), those of one step one after the other as a job makes them."""
    built = RunBuilder(path, command=command, packages=packages)
    for _ in range(steps):
        built.step(step_s)
    into = {}  # seconds into each step taken by its compiles so far
    for kind, kernel, step, seconds, fields, *extra in compiles:
        at = into.get(step, 0.0) + 1e-6
        into[step] = at + seconds
        caller = {"file": caller_file, "line": 7, "function": "forward"}
        built.compile(
            step, seconds, kernel, kind, fields, at_s=at, caller=caller, **(extra[0] if extra else {})
        )
    return built.load()


def test_autotune_again_after_warmup_names_the_changing_key(tmp_path):
    compiles = [
        ("triton_autotune", "chunk_fwd_kernel", s, 0.4, {"T": str(1000 + 64 * s), "H": "8"}) for s in range(4)
    ]
    # flash-linear-attention's kernel (its code launches it: the caller is in fla/)
    run = _synthetic_run(
        tmp_path / "run",
        ["python", "train.py"],
        compiles,
        packages={"flash-linear-attention": "0.6.0"},
        caller_file="/site-packages/fla/ops/gla/chunk.py",
    )
    f = _jit(traindx.analyze(run))["jit.autotune"]
    assert f.evidence["changing_key_fields"] == ["T"] and set(f.steps_affected) == {1, 2, 3}
    assert f.seconds_lost_per_step == pytest.approx(0.4)
    envs = [p.change.get("env", {}) for p in f.prescriptions]
    # FLA 0.6.0's own settings that change something: FLA_CACHE_RESULTS is already on by
    # default there (fla/utils/env.py), so it is not prescribed; fuzzy lookup of tuned configs is
    assert not any("FLA_CACHE_RESULTS" in e for e in envs)
    assert any(e.get("FLA_CACHE_MODE") == "fuzzy" and "FLA_CONFIG_DIR" in e for e in envs)
    assert "a size that changes with the data" in f.prescriptions[0].summary
    assert any("TRITON_CACHE_DIR" in e for e in envs)
    # a kernel of the job's own: Triton's terms only, even with FLA installed (issue 14)
    run = _synthetic_run(
        tmp_path / "own", ["python", "train.py"], compiles, packages={"flash-linear-attention": "0.6.0"}
    )
    f = _jit(traindx.analyze(run))["jit.autotune"]
    assert not any("FLA_" in json.dumps(p.change) for p in f.prescriptions)
    assert f.prescriptions[0].kind == "code" and "autotune_key" in f.prescriptions[0].change["code"]


@pytest.mark.parametrize(
    "command, env, expected",
    [
        (
            ["torchrun", "pretrain_gpt.py", "--attention-backend", "flash"],
            {},
            {"arg": {"framework": "megatron", "set": {"--attention-backend": "fused"}}},
        ),
        (
            ["megatron", "sft", "--model", "Qwen/Qwen3.5-35B-A3B", "--attention_backend", "flash_4"],
            {},
            {"arg": {"framework": "ms-swift", "set": {"--attention_backend": "flash_2"}}},
        ),
        (["python", "train.py"], {"NVTE_FLASH_ATTN": "1"}, {"env": {"NVTE_FLASH_ATTN_V4": "0"}}),
    ],
)
def test_backend_switch_is_recognised_from_the_command(tmp_path, command, env, expected):
    from traindx.analyzers.jit.jit import backend_switches

    run = _synthetic_run(tmp_path / "run", command, [])
    run.manifest["env"] = env
    assert expected in [p.change for p in backend_switches(run)]


@pytest.mark.slow  # `diagnose analyze` of the whole H200 py-spy recording
def test_raw_collapsed_pyspy_file_gives_the_same_finding(tmp_path):
    """py-spy's raw format (collapsed stacks with sample counts) read with its sampling rate."""
    doc = json.loads(open(FIXTURE, encoding="utf-8").read())
    frames = doc["shared"]["frames"]
    lines = []
    for profile in doc["profiles"]:
        for sample in profile["samples"]:
            parts = [
                f"{frames[i]['name']} ({frames[i]['file']}:{frames[i]['line']})"
                if frames[i].get("file")
                else frames[i]["name"]
                for i in sample
            ]
            lines.append(";".join(parts) + " 1")
    raw = tmp_path / "probe.txt"
    raw.write_text("\n".join(lines) + "\n")
    proc = diagnose(["analyze", str(raw), "--rate", "50", "--json"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (f,) = [x for x in json.loads(proc.stdout) if x["id"] == "jit.fa4_steady_recompile"]
    assert f["evidence"]["compiles"] == 4 and f["evidence"]["is_main_thread"] is False
    assert all(2.0 < s < 3.2 for s in f["evidence"]["seconds_each"][1:])


def test_first_steps_autotune_seconds_are_in_the_cold_start_with_the_warm_up(tmp_path):
    """FLA on an H200: 28.9 s of autotuning in step 0 beside 2.9 s of first compiles. The cold
    start carries both, names the autotuning, and prescribes kernel-cache warm --from-run."""
    compiles = []
    for k in range(5):
        kernel = f"chunk_kernel_{k}"
        compiles.append(("triton", kernel, 0, 0.58, {"BLOCK": "64"}, {"autotune_of": kernel}))
        compiles.append(
            (
                "triton_autotune",
                kernel,
                0,
                28.9 / 5,
                {"T": "8192", "H": "8"},
                {
                    "bench_s": 28.9 / 5,
                    "jit_s": 0.58,
                    "key_names": ["T", "H"],
                    "module": "fla.ops.gated_delta_rule.chunk",
                },
            )
        )
    run = _synthetic_run(
        tmp_path / "run",
        ["python", "train.py"],
        compiles,
        step_s=40.0,
        steps=4,
        packages={"flash-linear-attention": "0.6.0", "triton": "3.6.0"},
        caller_file="/site-packages/fla/ops/gated_delta_rule/chunk.py",
    )
    jit = [f for f in traindx.analyze(run) if f.analyzer == "jit"]
    assert [f.id for f in jit] == ["jit.cold_start"], [(f.id, f.title) for f in jit]
    cold = jit[0]
    assert cold.evidence["cold_autotune_seconds"] == pytest.approx(28.9, abs=0.01)
    assert cold.evidence["cold_compile_seconds"] == pytest.approx(2.9, abs=0.01)
    assert "28.9 s autotuning 5 kernel(s)" in cold.title
    first = cold.prescriptions[0]
    assert first.kind == "precompile" and first.change["precompile"]["from_run"] == run.path
    assert "kernel-cache warm --from-run" in first.command
    assert all(
        p.expected_gain_s_per_step is None or p.expected_gain_s_per_step > 0 for p in cold.prescriptions
    )


def test_a_reautotune_and_its_recompiles_are_one_finding(tmp_path):
    """A Triton kernel whose autotune key changes tunes again and compiles the configs it
    benchmarks: one jit.autotune finding with both seconds, no second recompile finding."""
    compiles = []
    for s in range(4):
        fields = {"n": str(96 + 64 * s)}
        compiles.append(("triton_autotune", "scale_add", s, 0.3, fields, {"key_names": ["n"], "configs": 2}))
        compiles.extend(("triton", "scale_add", s, 0.1, {}, {"autotune_of": "scale_add"}) for _ in range(2))
    run = _synthetic_run(tmp_path / "run", ["python", "train.py"], compiles, step_s=1.0, steps=4)
    jit = [f for f in traindx.analyze(run) if f.analyzer == "jit"]
    # the first step's tuning is the cold start (another cause: first use); nothing else
    assert sorted(f.id for f in jit) == ["jit.autotune", "jit.cold_start"], [(f.id, f.title) for f in jit]
    f = next(f for f in jit if f.id == "jit.autotune")
    assert f.evidence["changing_key_fields"] == ["n"]
    assert f.evidence["recompiles_while_tuning"] == 6
    # 0.3 s benchmarking + 2 x 0.1 s compiles per later step
    assert f.seconds_lost_per_step == pytest.approx(0.5, abs=0.02)
    assert set(f.removes["categories"]) == {"autotune", "compile"}
