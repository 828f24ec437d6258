"""--fix's ladder of global switches (issue 46, item 3): for a place slow for no known reason, the
switches its evidence makes worth trying, best predicted first, capped, each a measured arm; a
rung that cannot apply is skipped with why; a place a rule explains gets no ladder.

The places are findings built in code as gpu_places writes them (a slow place's evidence: phase,
GPU seconds by kernel family and precision, memory); the patches run in a real torch process;
one real CPU `--fix` of a checkpointed job shows the rung measured and judged."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from helpers import PY, diagnose

from traindx.analyzers.core.ab_verdict import Arm, Judgement, Measure
from traindx.analyzers.core.findings import Finding, Prescription, SourceEdit
from traindx.fixing.plan import ladder as L
from traindx.fixing.plan.planner import candidate_plans
from traindx.fixing.run.runner import ladder_line, ladder_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30


def slow_place(
    phase="forward", seconds=0.1, families=None, precisions=None, peak=10 * GiB, total=80 * GiB, **ev
):
    """A gpu.place_slow finding as gpu_places writes it."""
    return Finding(
        id="gpu.place_slow",
        title="a slow place",
        severity="high",
        analyzer="gpu_places",
        seconds_lost_per_step=0.8 * seconds,
        evidence={
            "module": "Net_0.Encoder_1",
            "phase": phase,
            "line": "model.py(12): forward",
            "gpu_s_per_step": seconds,
            "top_kernels": [{"name": "k", "family": "matmul", "label": "GEMM", "seconds": seconds}],
            "families": families or {"matmul": seconds},
            "precisions": precisions or {"fp32": seconds},
            "device_kind": "cuda",
            "memory_peak_bytes": peak,
            "memory_total_bytes": total,
            **ev,
        },
    )


def recompute(seconds=0.05, peak=1 * GiB, total=16 * GiB, device="cpu"):
    return Finding(
        id="gpu.recompute",
        title="forward recomputed",
        severity="high",
        analyzer="gpu_places",
        seconds_lost_per_step=seconds,
        evidence={
            "recompute_gpu_s_per_step": seconds,
            "modules": ["Block_0"],
            "memory_peak_bytes": peak,
            "memory_total_bytes": total,
            "device_kind": device,
        },
        prescriptions=(Prescription(kind="code", summary="checkpointing off", change={}, automatic=False),),
    )


def _rows(ladder, status):
    return {r["rung"]: r for r in ladder.rows if r["status"] == status}


def test_fp32_math_at_a_slow_place_offers_the_precision_switches_best_first(tmp_path):
    ladder = L.plan_ladder([slow_place()], ["python", "train.py"], str(tmp_path))
    names = [a.rung.name for a in ladder.arms]
    assert names[:2] == ["tf32", "bf16_autocast"] and len(names) <= L.LADDER_CAP
    gains = [a.gain for a in ladder.arms]
    assert gains == sorted(gains, reverse=True) and all(0 < g <= 0.08 for g in gains)
    skipped = _rows(ladder, "skipped")
    # no convolution, not the optimizer, memory not pressed, no recompute, no compile: not tried
    for rung in (
        "channels_last",
        "cudnn_benchmark",
        "foreach_optimizer",
        "fused_optimizer",
        "checkpoint_off",
    ):
        assert rung in skipped and skipped[rung]["why"], rung
    assert "under 20%" in skipped["channels_last"]["why"]
    assert "not pressed" in skipped["expandable_segments"]["why"]


def test_a_conv_place_near_the_memory_limit_is_capped_at_three_arms(tmp_path):
    place = slow_place(
        families={"conv": 0.08, "reduction": 0.02}, precisions={"fp32": 0.08, "?": 0.02}, peak=76 * GiB
    )
    ladder = L.plan_ladder([place], ["python", "train.py"], str(tmp_path))
    assert [a.rung.name for a in ladder.arms] == ["tf32", "bf16_autocast", "channels_last"]
    beyond = [r["rung"] for r in ladder.rows if "beyond the ladder" in r["why"]]
    assert set(beyond) == {"cudnn_benchmark", "expandable_segments"}


def test_cuda_switches_are_not_tried_on_a_cpu_place(tmp_path):
    place = slow_place(phase="optimizer", device_kind="cpu", families={"elementwise": 0.1})
    ladder = L.plan_ladder([place], ["python", "train.py"], str(tmp_path))
    assert [a.rung.name for a in ladder.arms] == ["foreach_optimizer"]
    skipped = _rows(ladder, "skipped")
    for rung in ("tf32", "bf16_autocast", "cudnn_benchmark", "expandable_segments", "fused_optimizer"):
        assert skipped[rung]["why"].startswith("CUDA only"), rung


def test_a_place_a_rule_explains_gets_no_ladder(tmp_path):
    """A rule that names the place's module and prescribes a change --fix can make owns it."""
    edit = SourceEdit(code={"file": "model.py", "line": 12, "before": "x", "after": "y"})
    rule = Finding(
        id="host_work.line",
        title="a rule",
        severity="high",
        analyzer="test",
        evidence={"module": "Net_0.Encoder_1.Linear_2"},
        prescriptions=(Prescription(kind="code", summary="edit", change=edit, automatic=True),),
    )
    ladder = L.plan_ladder([rule, slow_place()], ["python", "train.py"], str(tmp_path))
    assert ladder.arms == [] and ladder.rows[0]["why"].startswith("[host_work.line] names this place")
    # the same rule elsewhere in the model leaves the place unexplained
    other = dataclasses.replace(rule, evidence={"module": "Net_0.Head_3"})
    assert L.plan_ladder([other, slow_place()], ["python", "train.py"], str(tmp_path)).arms


def test_checkpointing_off_only_where_the_memory_leaves_room(tmp_path):
    cmd, cwd = ["python", "train.py"], str(tmp_path)
    room = L.plan_ladder([recompute(peak=1 * GiB, total=16 * GiB)], cmd, cwd)
    assert [a.rung.name for a in room.arms] == ["checkpoint_off"] and room.arms[0].gain == pytest.approx(0.05)
    full = L.plan_ladder([recompute(peak=10 * GiB, total=16 * GiB)], cmd, cwd)
    assert full.arms == [] and "no room" in full.rows[0]["why"]
    unknown = L.plan_ladder([recompute(peak=None, total=None)], cmd, cwd)
    assert unknown.arms == [] and "unknown" in unknown.rows[0]["why"]


def test_a_compile_mode_rung_reads_the_jobs_torch_compile(tmp_path):
    script = tmp_path / "train.py"
    script.write_text('import torch\nm = torch.compile(torch.nn.Linear(2, 2), mode="max-autotune")\n')
    assert L.compile_modes(["python", str(script)], str(tmp_path)) == ("max-autotune",)
    place = slow_place(families={"elementwise": 0.1}, precisions={"?": 0.1})
    ladder = L.plan_ladder([place], ["python", str(script)], str(tmp_path))
    assert [a.rung.name for a in ladder.arms] == ["compile_default_mode"]


def test_ladder_arms_are_candidates_with_their_patch_or_env(tmp_path):
    place = slow_place(
        families={"conv": 0.08, "reduction": 0.02}, precisions={"fp32": 0.08, "?": 0.02}, peak=76 * GiB
    )
    candidates, listing = candidate_plans(
        ["python", "train.py"], [place], str(tmp_path), environ={}, cwd=str(tmp_path)
    )
    assert [c.plan.env for c in candidates] == [
        {"TRAINDX_RUNTIME_PATCHES": "fp32_matmul_high"},
        {"TRAINDX_RUNTIME_PATCHES": "bf16_autocast"},
        {"TRAINDX_RUNTIME_PATCHES": "channels_last"},
    ]
    assert all(c.finding == "gpu.place_slow" and c.mechanism == "runtime" for c in candidates)
    assert {r["status"] for r in listing.ladder} == {"offered", "skipped"}
    assert L.ladder_switch("channels_last") and L.ladder_switch("no_such_patch") is None


def _arm(name, summary, speedup, significant, interval):
    return Arm(
        name=name,
        dir=f"/fix/{name}",
        finding="gpu.place_slow",
        mechanism="runtime",
        summary=summary,
        exit_code=0,
        judgement=Judgement(Measure.MEDIAN, speedup, significant),
        speedup=speedup,
        speedup_ci95=interval,
        verdict="faster and numerically equivalent" if significant else "no gain",
        loss_parity=True,
    )


def test_the_report_says_which_rungs_ran_what_each_measured_and_which_was_kept(tmp_path):
    place = slow_place(families={"conv": 0.08, "reduction": 0.02}, precisions={"fp32": 0.08, "?": 0.02})
    ladder = L.plan_ladder([place], ["python", "train.py"], str(tmp_path))
    first, second, third = (a.prescription.summary for a in ladder.arms)
    arms = [
        _arm("candidate", first, 1.02, False, [0.95, 1.1]),
        _arm("candidate-2", second, 1.4, True, [1.3, 1.5]),
    ]
    rows = ladder_rows(ladder.rows, arms, kept=arms[1])
    by_rung = {r["rung"]: r for r in rows}
    ran = [r for r in rows if r["status"] == "measured"]
    assert [r["kept"] for r in ran] == [False, True]
    assert ran[1]["speedup"] == 1.4 and ran[1]["interval"] == [1.3, 1.5] and ran[1]["loss_parity"] is True
    assert by_rung[ladder.arms[2].rung.name]["status"] == "not measured"
    lines = [ladder_line(r) for r in rows]
    assert any("1.40x (95 % CI 1.30-1.50x)" in line and line.endswith(": kept") for line in lines)
    assert any("skipped" in line and "not pressed" in line for line in lines)


def test_the_shim_flips_each_switch_in_a_real_torch_process():
    """The patches as a candidate arm asks for them: checkpoint calls its function directly, a
    conv runs in NHWC, the optimizer is built with foreach, compile's mode is dropped."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from _traindx_shim import importhooks, ladder_patches\n"
        "ladder_patches.register(); importhooks.install()\n"
        "import torch\n"
        "from torch.utils.checkpoint import checkpoint\n"
        "calls = []\n"
        "def f(x):\n"
        "    calls.append(torch.is_grad_enabled()); return x * 2\n"
        "x = torch.randn(4, requires_grad=True)\n"
        "checkpoint(f, x, use_reentrant=False).sum().backward()\n"
        "conv = torch.nn.Conv2d(3, 4, 3)\n"
        "y = conv(torch.randn(2, 3, 8, 8))\n"
        "opt = torch.optim.SGD(conv.parameters(), lr=0.1)\n"
        "print(len(calls), y.is_contiguous(memory_format=torch.channels_last),"
        " conv.weight.is_contiguous(memory_format=torch.channels_last), opt.param_groups[0]['foreach'])\n"
    )
    env = dict(os.environ, TRAINDX_RUNTIME_PATCHES="checkpoint_off,channels_last,optimizer_foreach")
    out = subprocess.run(
        [sys.executable, "-c", code, os.path.join(ROOT, "profiler", "shim")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    # the function ran once (checkpoint would run it again in backward), NHWC, foreach
    assert out.stdout.split() == ["1", "True", "True", "True"]


@pytest.mark.slow
def test_fix_measures_the_checkpointing_rung_of_a_real_cpu_job(tmp_path):
    """A real CPU job whose blocks run through torch.utils.checkpoint: the baseline names the
    recompute, the ladder's checkpoint_off rung is the arm, measured against the baseline with
    loss parity, and fix.json says what it measured and whether it was kept. Kept only when the
    judge found it significantly faster (this test asserts the report is honest either way)."""
    job = os.path.join(ROOT, "tests", "jobs", "checkpointed_mlp.py")
    fix_dir = tmp_path / "fix"
    proc = diagnose(
        ["--fix", "--no-pyspy", "--steps", "16", "--torch-profile", "6-7", "--fix-tries", "1"]
        + ["--run-dir", str(fix_dir), "--", PY, job],
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fix = json.loads((fix_dir / "fix.json").read_text())
    rows = [r for r in fix["ladder"] if r["rung"] == "checkpoint_off"]
    assert len(rows) == 1 and rows[0]["finding"] == "gpu.recompute", fix["ladder"]
    row = rows[0]
    assert row["status"] == "measured" and row["speedup"] is not None
    arm = next(a for a in fix["arms"] if a["dir"] == row["dir"])
    assert arm["exit_code"] == 0 and arm["loss_parity"] is not False
    # the candidate ran with the switch flipped, and no longer recomputes
    events = "".join(
        open(os.path.join(row["dir"], "events", f)).read()
        for f in os.listdir(os.path.join(row["dir"], "events"))
    )
    assert '"patch": "checkpoint_off"' in events
    findings = json.loads(open(os.path.join(row["dir"], "findings.json")).read())
    assert "gpu.recompute" not in {f["id"] for f in findings}
    assert row["kept"] == (fix["best"] == row["dir"]) and row["significant"] == arm["significant"]
    if row["kept"]:  # kept: significantly faster, or the fastest arm with parity not slower
        assert arm["judged_speedup"] >= 1.0
    assert "ladder: [gpu.recompute] checkpoint_off" in proc.stdout + proc.stderr


def test_a_named_mechanism_s_own_rung_is_predicted_at_the_mechanism_s_price(tmp_path):
    # the NCHW mechanism priced its transposes and NCHW kernels at 13.4 ms a step (an H100 run
    # measured 12.5 ms saved by channels_last); the rung's rule of thumb over convolution time
    # alone said 2.2 ms
    nchw = Finding(
        id="gpu.layout_nchw",
        title="convolutions in the NCHW layout",
        severity="high",
        analyzer="gpu_places",
        seconds_lost_per_step=0.0134,
        evidence={"families": {"conv": 0.0073, "norm": 0.0127}, "device_kind": "cuda"},
    )
    ladder = L.plan_ladder([nchw], ["python", "train.py"], str(tmp_path))
    (arm,) = [a for a in ladder.arms if a.rung.name == "channels_last"]
    assert arm.gain == pytest.approx(0.0134)
