"""The analyzers of the usual suspects, each on a real job that has the problem (examples/
pathologies.py) and on the healthy example, which must stay silent (nothing above 'info').

The GPU-only analyzers (allocator retries, launch-bound steps, clock throttling) cannot see a GPU
here: they are checked for silence on real CPU runs, and their logic on copies of a real run
folder into which GPU evidence was WRITTEN BY THE TEST in the recorded formats (nvml.csv columns
of the NVML sampler, the shim's `alloc` events, a kineto-shaped trace). Those tests say so in
their names (`synthetic_gpu_evidence`).
"""

import gzip
import json
import os
import re
import shutil

import pytest
from helpers import PY, diagnose, example, only_run_dir

import traindx
from traindx.analyzers import analyze
from traindx.analyzers import evidence as ev
from traindx.profiler.nvml import COLUMNS as NVML_COLUMNS

PATHOLOGIES = example("pathologies.py")
TINY = example("train_tiny.py")
MY_ANALYZERS = {
    "gil",
    "dataloader",
    "gc_pauses",
    "host_sync",
    "allocator",
    "launch_bound",
    "gpu_clocks",
    "ranks",
    "stability",
    "host_work",
    "threads",
}
HOST_LOOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs", "host_loop.py")
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")


def _record(tmp_path_factory, name, diagnose_args, job):
    out = tmp_path_factory.mktemp(name)
    proc = diagnose(["--out", "runs", "--quiet", *diagnose_args, "--", *job], cwd=out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return traindx.load_run(only_run_dir(out / "runs"))


def _pathology(tmp_path_factory, pathology, diagnose_args=("--no-pyspy",), *job_args):
    return _record(
        tmp_path_factory,
        pathology,
        list(diagnose_args),
        [PY, PATHOLOGIES, "--pathology", pathology, *job_args],
    )


def _mine(findings):
    return [f for f in findings if f.analyzer in MY_ANALYZERS]


def _one(findings, finding_id):
    hits = [f for f in findings if f.id == finding_id]
    assert len(hits) == 1, [(f.id, f.severity, f.summary) for f in findings]
    return hits[0]


def _above_info_of(findings, analyzer):
    return [(f.id, f.severity) for f in findings if f.analyzer == analyzer and f.severity != "info"]


def _above_info(findings):
    return [(f.id, f.severity, f.summary) for f in _mine(findings) if f.severity != "info"]


# -- the healthy example: every analyzer silent, with py-spy and the torch.profiler window ------
# (the default window profiles GPU jobs only; on this CPU job it is asked for explicitly)
@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return _record(
        tmp_path_factory, "healthy", ["--torch-profile", "3-4"], [PY, TINY, "--steps", "14", "--threads", "1"]
    )


@pytest.mark.slow
def test_default_torch_profile_window_stands_down_on_a_cpu_job(tmp_path):
    proc = diagnose(
        ["--out", "runs", "--quiet", "--no-pyspy", "--steps", "6", "--", PY, TINY, "--threads", "1"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = traindx.load_run(only_run_dir(tmp_path / "runs"))
    skipped = run.events[run.events["type"] == "torch_profile_skipped"]
    assert "no CUDA" in skipped["reason"].iloc[0]
    assert not len(run.events[run.events["type"] == "torch_profile"])


def test_healthy_example_is_silent(healthy):
    assert len(healthy.steps) == 14
    assert ("0", "gil") in healthy.pyspy or "pyspy" in healthy.missing
    assert len(healthy.torch_trace), "the default torch.profiler window recorded nothing"
    assert _above_info(analyze(healthy)) == []


def test_default_torch_profile_window_is_stored_for_perfetto_and_left_out_of_the_statistics(healthy):
    path = os.path.join(healthy.path, "trace", "0.json.gz")
    with gzip.open(path, "rt") as f:
        doc = json.load(f)  # Perfetto and chrome://tracing read this Chrome-trace JSON as is
    assert doc["traceEvents"] and doc["baseTimeNanoseconds"] > 0
    windows = healthy.events[healthy.events["type"] == "torch_profile"]
    assert list(windows["first_step"]) == [3] and list(windows["last_step"]) == [4]
    from traindx.analyzers.evidence import steady_steps

    assert not steady_steps(healthy)["step"].isin([3, 4]).any()
    # the trace lies on the run's clock: its ops fall inside the profiled steps
    ops = healthy.torch_trace[healthy.torch_trace["cat"] == "cpu_op"]
    steps = healthy.steps.set_index("step")
    assert ops["start_ns"].min() >= steps.loc[3, "start_ns"] - 50_000_000
    assert ops["end_ns"].max() <= steps.loc[4, "end_ns"] + 50_000_000


def test_profiler_window_leaves_the_job_output_alone(healthy):
    # kineto's "USDT: ... profiler_start" lines would land in the job's stderr
    assert not healthy.log["text"].str.contains("profiler_start|profiler_stop").any()


JOB_WITH_ITS_OWN_PROFILER = """
import sys, torch
start = int(sys.argv[1])
m = torch.nn.Linear(8, 1); opt = torch.optim.SGD(m.parameters(), 0.1)
prof = torch.profiler.profile()
for step in range(8):
    if step == start:
        prof.start()
    loss = m(torch.randn(4, 8)).sum(); opt.zero_grad(); loss.backward(); opt.step()
    if step == 6:
        prof.stop()
        print("own profiler events:", len([e for e in prof.events() if e.name == "aten::addmm"]))
"""


@pytest.mark.parametrize("job_starts_at", [2, 4])  # before the window (3-4), inside it
@pytest.mark.slow
def test_a_job_that_profiles_itself_keeps_its_profiler(tmp_path, job_starts_at):
    (tmp_path / "job.py").write_text(JOB_WITH_ITS_OWN_PROFILER)
    proc = diagnose(
        [
            "--out",
            "runs",
            "--quiet",
            "--no-pyspy",
            "--torch-profile",
            "3-4",
            "--",
            PY,
            "job.py",
            str(job_starts_at),
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = int(re.search(r"own profiler events: (\d+)", proc.stdout)[1])
    assert events >= 7 - job_starts_at  # one addmm per step it profiled
    run = traindx.load_run(only_run_dir(tmp_path / "runs"))
    if job_starts_at == 2:  # already profiling: the window stands down
        assert "own" in run.events[run.events["type"] == "torch_profile_skipped"]["reason"].iloc[0]
    else:  # the window closes (its trace kept) before the job's profiler starts
        window = run.events[run.events["type"] == "torch_profile"].iloc[0]
        assert window["ended_by"] == "the job started its own profiler"


def test_bad_torch_profile_window_is_a_one_line_error(tmp_path):
    proc = diagnose(["--out", "runs", "--torch-profile", "5-2", "--", PY, TINY], cwd=tmp_path)
    assert proc.returncode != 0
    assert "--torch-profile" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_profiler_window_cut_short_by_the_job_end_is_still_written(tmp_path_factory):
    run = _record(
        tmp_path_factory,
        "short",
        ["--no-pyspy", "--torch-profile", "2-50"],
        [PY, TINY, "--steps", "4", "--threads", "1"],
    )
    window = run.events[run.events["type"] == "torch_profile"].iloc[0]
    assert window["ended_by"] == "job exit" and int(window["first_step"]) == 2
    assert len(run.torch_trace)


@pytest.mark.slow
def test_default_window_stands_down_on_long_steps(tmp_path_factory):
    out = tmp_path_factory.mktemp("long")
    proc = diagnose(
        ["--out", "runs", "--quiet", "--no-pyspy", "--", PY, TINY, "--steps", "6", "--threads", "1"],
        cwd=out,
        env={"TRAINDX_TORCH_PROFILE_MAX_STEP_S": "0.0001"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = traindx.load_run(only_run_dir(out / "runs"))
    skipped = run.events[run.events["type"] == "torch_profile_skipped"]
    assert len(skipped) == 1 and "--torch-profile" in skipped["reason"].iloc[0]
    assert not os.path.exists(os.path.join(run.path, "trace"))


# -- GIL --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_gil_burning_thread_is_named_with_its_function(tmp_path_factory):
    run = _pathology(
        tmp_path_factory, "gil", ("--pyspy-rate", "100", "--torch-profile", "off"), "--steps", "40"
    )
    finding = _one(analyze(run), "gil.contention")
    assert finding.evidence["thread"] == "word-counter"
    assert finding.evidence["hottest_frames"][0]["function"] == "count_words_in_python"
    assert finding.evidence["hottest_frames"][0]["file"].endswith("pathologies.py")
    # the share a busy machine leaves the thread varies (0.25-0.6 seen): above the analyzer's
    # floor and worth a medium or high finding is what the user reads
    from traindx.analyzers import gil

    assert finding.evidence["gil_share"] >= gil.MIN_SHARE
    assert finding.severity in ("medium", "high")
    assert "count_words_in_python" in finding.prescriptions[-1].summary


def test_gil_from_the_seed_reports_py_spy_file_alone():
    """The H200 recording of the seed case (py-spy --gil --idle, FA4 4.0.0b17, tensor
    max_seqlen): the autograd thread holds the GIL while the CuTe DSL compiles."""
    from traindx.analyzers.gil import analyze_recording
    from traindx.profiler import speedscope

    path = os.path.join(os.path.dirname(__file__), "data", "h200-fa4-b17-tensor-maxseqlen.speedscope.json")
    finding = _one(analyze_recording(speedscope.load(path)), "gil.contention")
    assert "BackwardCFunction.apply" in finding.evidence["thread"]
    assert finding.evidence["compiling"] and finding.evidence["gil_share"] > 0.5
    assert "base_dsl/compiler.py" in finding.evidence["hottest_leaf_frames"][0]["file"]
    assert finding.prescriptions[0].kind == "precompile"


def test_real_h200_seed_run_gil_holder_named_and_gpu_analyzers_silent():
    """A run recorded on the H200 (tests/data/h200-seed-b17-tensor: FA4 4.0.0b17, tensor
    max_seqlen, real NVML samples and torch.cuda.memory_stats events): the autograd thread holds
    the GIL while it compiles; the GPU clock and allocator analyzers see real GPU evidence with
    nothing wrong in it (no retries; clock reasons idle/power cap only) and stay silent."""
    run = traindx.load_run(os.path.join(os.path.dirname(__file__), "data", "h200-seed-b17-tensor"))
    assert len(run.gpu) and len(run.alloc)  # real GPU evidence, not a CPU run
    findings = analyze(run)
    finding = _one(findings, "gil.contention")
    assert finding.evidence["thread"] == "Dummy-1"  # the autograd engine's thread
    assert "base_dsl/compiler.py" in finding.evidence["hottest_leaf_frames"][0]["file"]
    # the hold is the recompile seen from the GIL: a symptom under the jit finding, with no
    # prescription of its own ("take the pure-Python work off the process" would be wrong)
    root = _one(findings, "jit.fa4_steady_recompile")
    assert finding.cause == root.id and finding.id in root.symptoms and root.cause is None
    assert finding.prescriptions == ()
    assert findings[0].id == root.id  # the headline is the root cause
    # its compiles run in every steady step: the steady window pays for the hold
    assert finding.severity == "high"
    assert finding.evidence["steady_window"]["gil_share_of_steady_steps"] > 0.5
    assert [
        f.id
        for f in findings
        if f.analyzer in ("gpu_clocks", "allocator", "launch_bound", "host_sync", "dataloader", "gc_pauses")
    ] == []


def test_real_h200_cold_start_compile_holding_the_gil_is_only_info():
    """The fixed seed case on the H200 (int max_seqlen): the autograd thread compiles once, in
    step 0, holding the GIL; the steady steps do not pay for that, so the GIL finding is info
    (the cold start is the jit analyzer's)."""
    run = traindx.load_run(os.path.join(os.path.dirname(__file__), "data", "h200-fa4-int-cold-start"))
    finding = _one(analyze(run), "gil.contention")
    assert finding.severity == "info" and finding.seconds_lost_per_step == 0
    assert finding.evidence["steady_window"]["share_of_them_in_steady_steps"] == 0


H200_PATHOLOGIES = os.path.join(os.path.dirname(__file__), "data", "h200-gpu-pathologies")


def _h200(name):
    return traindx.load_run(os.path.join(H200_PATHOLOGIES, name))


def test_real_h200_runs_launch_bound_and_syncs_found_healthy_silent():
    """Runs of examples/gpu_pathologies.py recorded on the H200 (real kineto CUDA traces, NVML,
    memory_stats): the GPU paths of launch_bound and host_sync, and silence where nothing is
    wrong (the healthy run; an allocator that does not retry)."""
    healthy = analyze(_h200("none"))
    assert _above_info(healthy) == []
    launch = _one(analyze(_h200("launch_bound")), "gpu.launch_bound")
    assert launch.evidence["gpu_busy_share"] < 0.2 and launch.evidence["median_kernel_us"] < 10
    assert launch.evidence["kernels_per_step"] > 1000 and launch.severity == "high"
    sync = _one(analyze(_h200("sync")), "sync.host_device")
    assert sync.evidence["device_in_trace"] and sync.severity != "info"
    assert sync.evidence["call_sites"][0]["function"] == "forward"
    assert sync.evidence["call_sites"][0]["file"].endswith("gpu_pathologies.py")
    assert 0 < sync.seconds_lost_per_step < 0.5 * _h200("sync").steps["duration_s"].median()
    no_retries = _h200("alloc_no_retry")
    assert (no_retries.alloc["num_alloc_retries"] == 0).all()
    assert not [f for f in analyze(no_retries) if f.analyzer == "allocator"]


def test_real_h200_allocator_retries_and_power_cap():
    retries = _one(analyze(_h200("alloc_retries")), "alloc.retries")
    assert retries.evidence["alloc_retries_in_steady_steps"] > 0
    assert retries.evidence["cost_method"].startswith("cudaMalloc/cudaFree")  # measured, GPU trace
    assert retries.seconds_lost_per_step > 0 and retries.severity in ("medium", "high")
    env = retries.prescriptions[0]
    assert env.automatic and env.change == {"env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
    # an H200 under large bf16 GEMMs: at the power cap (reason 0x4), which is only reported
    findings = analyze(_h200("power"))
    cap = _one(findings, "gpu.power_cap")
    assert cap.severity == "info" and cap.evidence["capped_share"] > 0.5
    assert 600 < cap.evidence["median_power_w"] < 800
    assert not [f for f in findings if f.id == "gpu.throttle"]


# -- DataLoader -------------------------------------------------------------------------------
def _line_of(path, text):
    with open(path) as f:
        return next(n for n, line in enumerate(f, 1) if text in line)


@pytest.mark.slow
def test_dataloader_starvation_prescribes_workers_at_the_construction_line(tmp_path_factory):
    # py-spy (the whole run) and the torch.profiler window (steps 3-4) both see it
    run = _pathology(
        tmp_path_factory, "dataloader", ("--pyspy-rate", "50", "--torch-profile", "3-4"), "--steps", "16"
    )
    finding = _one(analyze(run), "dataloader.starvation")
    # how much: the time ledger (shim-timed DataLoader.__next__), whatever py-spy managed to
    # sample; the torch.profiler window agrees
    assert finding.evidence["source"] == "time ledger"
    assert finding.evidence["torch_profiler"]["share"] >= 0.2
    assert finding.share_of_step >= 0.2 and finding.severity in ("medium", "high")
    assert finding.evidence["dataloader"]["num_workers"] == 0
    assert finding.evidence["hottest_frames_inside"][0]["function"] == "slow_collate"
    code = finding.prescriptions[0].change["code"]
    assert code["file"] == PATHOLOGIES
    assert code["line"] == _line_of(PATHOLOGIES, "num_workers=0, collate_fn=slow_collate")
    assert "num_workers=0" in code["before"]
    workers = int(re.search(r"num_workers=(\d+)", code["after"])[1])
    assert workers >= 2 and "persistent_workers=True" in code["after"]
    # its scalar reads are CPU data in a collate, not host-device syncs
    assert not [f for f in analyze(run) if f.id == "sync.host_device"]


# -- GC ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_gen2_collections_in_steps_and_gc_freeze_cuts_them(tmp_path_factory):
    run = _pathology(tmp_path_factory, "gc", ("--no-pyspy", "--torch-profile", "off"), "--steps", "16")
    finding = _one(analyze(run), "gc.gen2_in_step")
    assert finding.evidence["gen2_collections"] >= 1 and finding.steps_affected
    assert finding.evidence["longest_gen2_pause_s"] > 0.05
    assert finding.severity in ("medium", "high")
    assert any("gc.freeze()" in p.summary for p in finding.prescriptions)
    # the prescription applied (examples/pathologies.py --gc-freeze): the long-lived index leaves
    # the collector's view; what is left is the per-step churn of the example, far cheaper
    fixed = _pathology(
        tmp_path_factory, "gc", ("--no-pyspy", "--torch-profile", "off"), "--steps", "16", "--gc-freeze"
    )
    after = [f for f in analyze(fixed) if f.id == "gc.gen2_in_step"]
    if after:
        assert after[0].evidence["longest_gen2_pause_s"] < 0.5 * finding.evidence["longest_gen2_pause_s"]
        assert after[0].seconds_lost_per_step < 0.6 * finding.seconds_lost_per_step


# -- host-device syncs ------------------------------------------------------------------------
@pytest.mark.slow
def test_item_inside_the_forward_is_found_in_the_profiler_window(tmp_path_factory):
    run = _pathology(tmp_path_factory, "sync", ("--no-pyspy", "--torch-profile", "2-3"), "--steps", "6")
    windows = run.events[run.events["type"] == "torch_profile"]
    assert (int(windows["first_step"].iloc[0]), int(windows["last_step"].iloc[0])) == (2, 3)
    finding = _one(analyze(run), "sync.host_device")
    top = finding.evidence["call_sites"][0]
    assert top["function"] == "forward" and top["file"].endswith("pathologies.py")
    assert top["per_step"] == 4  # one .item() per layer, --layers 4
    assert finding.severity == "low" and finding.seconds_lost_per_step is None  # no GPU here


# -- periodic slow steps ----------------------------------------------------------------------
@pytest.mark.slow
def test_periodic_checkpoint_is_found_with_its_period(tmp_path_factory):
    # 34 steps: on a loaded machine the warm-up can take up to half the steps (steady.warmup_count)
    # and the period needs its repeats in what is left
    run = _pathology(
        tmp_path_factory,
        "periodic",
        ("--no-pyspy", "--torch-profile", "off"),
        "--steps",
        "34",
        "--every",
        "4",
        "--checkpoint-seconds",
        "0.25",
    )
    findings = analyze(run)
    steady = ev.steady_steps(run, "0")
    assert any(f.id == "steps.periodic_slow" for f in findings), (
        [(f.id, f.title) for f in findings],
        list(steady["step"]),
        [round(d, 3) for d in run.steps.sort_values("step")["duration_s"]],
    )
    finding = _one(findings, "steps.periodic_slow")
    assert finding.evidence["period"] == 4
    assert "saving checkpoint" in finding.evidence["log_lines_in_slow_steps"][0]["text"]
    assert finding.severity in ("medium", "high")
    assert any("async_save" in p.summary for p in finding.prescriptions)


def test_a_period_far_above_a_loaded_machines_noise_is_still_found():
    """10 ms steps, a 0.25 s save every 4th step, and eight steps elsewhere 3x slow (a busy
    machine): the 2x set is too noisy for a period (10 saves among 18 slow steps), the saves
    alone are not."""
    from traindx.analyzers.stability import find_period

    steps = list(range(2, 42))
    noise = {5, 6, 9, 16, 22, 25, 30, 36}  # no period of their own
    durations = [0.25 if s % 4 == 3 else 0.030 if s in noise else 0.010 for s in steps]
    assert find_period(steps, [0.010 if d == 0.25 else d for d in durations]) is None
    period, residue, hits = find_period(steps, durations)
    assert (period, residue) == (4, 3) and hits == [s for s in steps if s % 4 == 3]


def test_period_detection_ignores_noise_without_a_period():
    from traindx.analyzers.stability import find_period

    steps = list(range(2, 30))
    noisy = [
        0.02,
        0.09,
        0.02,
        0.02,
        0.03,
        0.02,
        0.11,
        0.02,
        0.02,
        0.02,
        0.02,
        0.08,
        0.02,
        0.02,
        0.02,
        0.02,
        0.02,
        0.02,
        0.10,
        0.02,
        0.03,
        0.02,
        0.02,
        0.02,
        0.02,
        0.02,
        0.02,
        0.09,
    ]
    assert find_period(steps, noisy) is None
    every_five = [0.5 if s % 5 == 0 else 0.02 for s in steps]
    assert find_period(steps, every_five)[0] == 5


# -- ranks ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_rank_gloo_job_names_the_rank_that_stalls_the_other(tmp_path_factory):
    run = _record(
        tmp_path_factory,
        "straggler",
        ["--no-pyspy", "--torch-profile", "3-4"],
        [
            TORCHRUN,
            "--nproc-per-node",
            "2",
            PATHOLOGIES,
            "--pathology",
            "straggler",
            "--steps",
            "10",
            "--slow-seconds",
            "0.2",
        ],
    )
    assert set(run.steps["rank"]) == {"0", "1"}
    finding = _one(analyze(run), "ranks.straggler")
    assert finding.evidence["straggler"] == "1"
    waits = finding.evidence["wait_in_collectives_per_step_s"]
    assert waits["0"] - waits["1"] > 0.1
    assert 0.1 < finding.seconds_lost_per_step < 0.4
    assert "sleep" in finding.evidence["straggler_does"]["call"]


# -- GPU-only analyzers: silence on real CPU runs, logic on synthetic GPU evidence ---------------
def _copy_run(run, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(run.path, dest)
    return dest


@pytest.mark.slow  # 7 s (its call alone, the shared run aside)
def test_synthetic_gpu_evidence_thermal_throttle_is_found_power_cap_is_only_info(healthy, tmp_path):
    dest = _copy_run(healthy, tmp_path)
    steps = healthy.steps
    t0, t1 = int(steps["start_ns"].min()), int(steps["end_ns"].max())
    # the analyzer reads the samples of its steady window (the profiled steps in it): on a
    # loaded machine the fixture's warm-up can reach half the run, so the throttled half is that
    # window's second half (the window without the profiled steps was shorter: 34 % throttled)
    from traindx.analyzers.gpu_clocks import steady_span

    start, end = steady_span(healthy)
    mid = (start + end) // 2
    rows = []
    n = 200
    for i in range(n):
        t = t0 + (t1 - t0) * i // n
        # shape of a real H200 under load (FACTS §4): 100 % util, ~690 W, reason 0x4 power cap;
        # the second half also thermally throttled (0x20 SwThermal | 0x40 HwThermal) at 1100 MHz
        throttled = t >= mid
        rows.append(
            [t, 0, 100, 40, 1100 if throttled else 1455, 60 * 2**30, 690.0, 0x4 | (0x60 if throttled else 0)]
        )
    with open(dest / "nvml.csv", "w") as f:
        f.write(",".join(NVML_COLUMNS) + "\n")
        f.writelines(",".join(map(str, r)) + "\n" for r in rows)
    findings = analyze(traindx.load_run(dest))
    throttle = _one(findings, "gpu.throttle")
    assert set(throttle.evidence["reasons"]) == {"SwThermalSlowdown", "HwThermalSlowdown"}
    assert throttle.evidence["median_throttled_sm_clock_mhz"] == 1100
    assert throttle.severity in ("medium", "high")
    assert _one(findings, "gpu.power_cap").severity == "info"
    assert throttle.evidence["reference_sm_clock_mhz"] == 1455
    # throttled in every sample: no unthrottled clock of its own, so its maximum SM clock (the
    # run's GPU inventory) is the reference, not the throttled clock itself
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["gpus"] = [{"index": 0, "name": "NVIDIA H200", "max_sm_clock_mhz": 1980}]
    (dest / "manifest.json").write_text(json.dumps(manifest))
    for r in rows:
        r[4], r[7] = 1100, 0x4 | 0x60
    with open(dest / "nvml.csv", "w") as f:
        f.write(",".join(NVML_COLUMNS) + "\n")
        f.writelines(",".join(map(str, r)) + "\n" for r in rows)
    always = _one(analyze(traindx.load_run(dest)), "gpu.throttle")
    assert always.evidence["reference_sm_clock_mhz"] == 1980
    assert always.severity in ("medium", "high")
    assert "never ran unthrottled" in always.summary
    # power cap alone (a GPU at full load) is never above info
    for r in rows:
        r[4], r[7] = 1455, 0x4
    with open(dest / "nvml.csv", "w") as f:
        f.write(",".join(NVML_COLUMNS) + "\n")
        f.writelines(",".join(map(str, r)) + "\n" for r in rows)
    # (gpu_clocks' own findings: the fixture's other analyzers are judged by the healthy tests;
    # with GPU samples in the run a CPU job's own batch building is no longer held to the
    # CPU-only floor, and a loaded machine can lift it to 5 %)
    assert list(_above_info_of(analyze(traindx.load_run(dest)), "gpu_clocks")) == []


def test_synthetic_gpu_evidence_allocator_retries_prescribe_expandable_segments(healthy, tmp_path):
    dest = _copy_run(healthy, tmp_path)
    retries = 0
    with open(dest / "events" / "0.jsonl", "a") as f:
        for row in healthy.steps.itertuples():
            retries += 2 if row.step % 3 == 0 else 0
            # the keys the shim writes from torch.cuda.memory_stats() (steps._emit_alloc)
            f.write(
                json.dumps(
                    {
                        "type": "alloc",
                        "t": int(row.end_ns) + 1,
                        "step": int(row.step),
                        "num_alloc_retries": retries,
                        "num_ooms": 0,
                        "num_sync_all_streams": retries,
                        "num_device_alloc": 100 + retries,
                        "num_device_free": retries,
                        "allocated_bytes_all_current": 50 * 2**30,
                        "allocated_bytes_all_peak": 70 * 2**30,
                        "reserved_bytes_all_current": 78 * 2**30,
                        "reserved_bytes_all_peak": 79 * 2**30,
                        "inactive_split_bytes_all_current": 12 * 2**30,
                    }
                )
                + "\n"
            )
        f.write(
            json.dumps(
                {
                    "type": "empty_cache",
                    "t": int(healthy.steps["end_ns"].iloc[6]) - 1000,
                    "step": int(healthy.steps["step"].iloc[6]),
                    "caller": {"file": "/job/train.py", "line": 88, "function": "train_step"},
                    "source": "torch.cuda.empty_cache()",
                }
            )
            + "\n"
        )
    finding = _one(analyze(traindx.load_run(dest)), "alloc.retries")
    assert finding.evidence["alloc_retries_in_steady_steps"] > 0
    env = [p for p in finding.prescriptions if p.kind == "env"]
    assert env[0].change == {"env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
    assert env[0].automatic
    code = [p for p in finding.prescriptions if p.kind == "code"]
    assert code[0].change["code"]["file"] == "/job/train.py" and code[0].change["code"]["line"] == 88
    # already set: not prescribed again
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["env"]["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    (dest / "manifest.json").write_text(json.dumps(manifest))
    again = _one(analyze(traindx.load_run(dest)), "alloc.retries")
    assert not [p for p in again.prescriptions if p.kind == "env"]


def _kineto_trace(path, base_ns, steps, kernel_us, gap_us, per_step):
    """A trace in kineto's Chrome-trace shape: cpu_op/cuda_runtime on the host, kernels on a
    device stream, µs relative to baseTimeNanoseconds."""
    events = []
    for row in steps.itertuples():
        t = (int(row.start_ns) - base_ns) / 1000 + 100
        for k in range(per_step):
            events.append(
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": "cudaLaunchKernel",
                    "pid": 1,
                    "tid": 1,
                    "ts": t,
                    "dur": 4.0,
                    "args": {},
                }
            )
            events.append(
                {
                    "ph": "X",
                    "cat": "kernel",
                    "name": f"void elementwise_kernel<{k % 7}>",
                    "pid": 0,
                    "tid": 7,
                    "ts": t + 5,
                    "dur": kernel_us,
                    "args": {"device": 0, "stream": 7},
                }
            )
            t += kernel_us + gap_us
    with gzip.open(path, "wt") as f:
        json.dump({"schemaVersion": 1, "baseTimeNanoseconds": base_ns, "traceEvents": events}, f)


def test_synthetic_gpu_evidence_launch_bound_steps(healthy, tmp_path):
    dest = _copy_run(healthy, tmp_path)
    profiled = healthy.steps[healthy.steps["step"].isin([3, 4])]
    base = int(profiled["start_ns"].min()) - 10**9
    step_us = float(profiled["duration_s"].min()) * 1e6
    per_step = 400
    # many 6 µs kernels spread over the whole step: the GPU is busy a small share of it
    _kineto_trace(
        dest / "trace" / "0.json.gz", base, profiled, 6.0, max(1.0, step_us * 0.9 / per_step - 6.0), per_step
    )
    finding = _one(analyze(traindx.load_run(dest)), "gpu.launch_bound")
    assert finding.evidence["kernels_per_step"] == per_step
    assert finding.evidence["gpu_busy_share"] < 0.5
    assert any("CUDA graph" in p.summary for p in finding.prescriptions)
    # the same kernel count, but long kernels that fill the step: not launch-bound
    _kineto_trace(dest / "trace" / "0.json.gz", base, profiled, step_us * 0.9 / per_step, 0.1, per_step)
    assert not [f for f in analyze(traindx.load_run(dest)) if f.id == "gpu.launch_bound"]


def test_synthetic_gpu_evidence_syncs_cost_the_gpu_idle_after_them(healthy, tmp_path):
    """kineto shape on a GPU: the job's forward (a python_function) calls .item() per layer; each
    cudaStreamSynchronize holds the CPU 1.5 gaps and is followed by one gap (5 % of the step)
    without a kernel; the last one of a step by more, but its cost is bounded by the time it held
    the CPU back."""
    dest = _copy_run(healthy, tmp_path)
    profiled = healthy.steps[healthy.steps["step"].isin([3, 4])]
    base = int(profiled["start_ns"].min()) - 10**9
    gap = float(profiled["duration_s"].min()) * 1e6 * 0.05  # µs
    block = 1.5 * gap
    events = []
    for row in profiled.itertuples():
        t = (int(row.start_ns) - base) / 1000 + 50  # µs
        events.append(
            {
                "ph": "X",
                "cat": "python_function",
                "name": "model.py(40): forward",
                "pid": 1,
                "tid": 1,
                "ts": t,
                "dur": 4 * (block + gap + 20),
                "args": {"Python id": 1},
            }
        )
        for layer in range(4):
            events.append(
                {
                    "ph": "X",
                    "cat": "kernel",
                    "name": "gemm",
                    "pid": 0,
                    "tid": 7,
                    "ts": t,
                    "dur": block / 2,
                    "args": {"device": 0, "stream": 7},
                }
            )
            events.append(
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": "cudaStreamSynchronize",
                    "pid": 1,
                    "tid": 1,
                    "ts": t + 10,
                    "dur": block,
                    "args": {},
                }
            )
            t += 10 + block + gap + 10
    with gzip.open(dest / "trace" / "0.json.gz", "wt") as f:
        json.dump({"schemaVersion": 1, "baseTimeNanoseconds": base, "traceEvents": events}, f)
    finding = _one(analyze(traindx.load_run(dest)), "sync.host_device")
    top = finding.evidence["call_sites"][0]
    assert (top["function"], top["file"], top["per_step"]) == ("forward", "model.py", 4)
    assert finding.seconds_lost_per_step == pytest.approx((3 * (gap + 10) + block) / 1e6, rel=0.02)
    assert "forward (model.py:40)" in finding.prescriptions[0].summary


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

    from traindx.analyzers.stability import find_period, line_periods

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
    from traindx.analyzers import fixplan

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


def test_a_prescription_priced_at_no_gain_promises_nothing():
    """The savings model can price a fix below zero (more DataLoader workers on cores the step
    already fills): the prescription keeps its change but promises no gain, and says why."""
    from traindx.analyzers.chains import without_losing_prescriptions
    from traindx.analyzers.findings import Finding, Prescription

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


LOADED_LIGHTNING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "cpu-lightning-loaded")


def test_a_data_wait_that_comes_and_goes_on_a_loaded_machine_is_no_starvation():
    """Recorded Lightning runs on a loaded 2-core machine (tests/data/cpu-lightning-loaded): the
    healthy job's data wait (12 % of the steps, mostly waiting for a core) is no finding; the
    starving job's (a wait in every step) stays one, at its size."""
    from traindx.analyzers import dataloader, threads

    healthy = traindx.load_run(os.path.join(LOADED_LIGHTNING, "healthy"))
    measured = dataloader._from_ledger(healthy, "0")
    assert measured["share"] > dataloader.MIN_SHARE  # what the mean alone said
    assert threads.machine_loaded(threads.thread_facts(healthy, "0"))
    assert "dataloader.starvation" not in {f.id for f in dataloader.analyze(healthy)}
    starving = traindx.load_run(os.path.join(LOADED_LIGHTNING, "starving"))
    f = _one(dataloader.analyze(starving), "dataloader.starvation")
    assert f.share_of_step > 0.8 and f.severity == "high"
    assert f.evidence["machine_loaded"]["judged_share"] > 0.8
    assert f.evidence["hottest_frames_inside"][0]["function"].endswith("__getitem__")


def test_host_time_spent_waiting_for_a_core_is_not_charged_to_its_line():
    """A recorded healthy Lightning run on a loaded 2-core machine, with the training thread's
    run-queue delay per sample and per step (tests/data/cpu-lightning-loaded/healthy-runq): the
    thread ran ~8 ms of each ~60 ms step; the host intervals' wall time is mostly the thread
    waiting for a core at the line its time slice ended in (two samples), which the wall-clock
    split charged to the framework's call at 12 % and 7 % of the step."""
    from traindx.analyzers import host_work
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
    from traindx.analyzers import gc_pauses, step_causes
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

    from traindx.analyzers import host_work

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
        for p in host_work._prescriptions("file", "loop.py:5", src, str(job), 5, 0.5, False, str(tmp_path))
        if p.change
    ]
    (wait,) = [
        p
        for p in host_work._prescriptions("sleep", "loop.py:5", src, str(job), 5, 0.5, False, str(tmp_path))
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
    from traindx.analyzers import gpu_idle
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
