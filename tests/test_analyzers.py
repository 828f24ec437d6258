"""The analyzers on the healthy example, which must stay silent (nothing above 'info'), and the
GPU-only analyzers (allocator retries, launch-bound steps, clock throttling), which cannot see a
GPU here: they are checked for silence on real CPU runs, and their logic on copies of a real run
folder into which GPU evidence was WRITTEN BY THE TEST in the recorded formats (nvml.csv columns
of the NVML sampler, the shim's `alloc` events, a kineto-shaped trace). Those tests say so in
their names (`synthetic_gpu_evidence`). The usual suspects, each on a real job that has the
problem: test_analyzers_pathologies.py; host work and threads: test_analyzers_host.py.
"""

import gzip
import json
import os
import re
import shutil

import pandas as pd
import pytest
from analyzer_helpers import LOADED_LIGHTNING, _h200, _one, _record
from helpers import PY, diagnose, example, only_run_dir

import traindx
from traindx.analyzers import analyze
from traindx.profiler.nvml import COLUMNS as NVML_COLUMNS
from traindx.report.outputs import read_findings

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


def _mine(findings):
    return [f for f in findings if f.analyzer in MY_ANALYZERS]


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


# the default window stands down on a CPU job (no CUDA): tests/test_diagnose.py
# (test_default_torch_profile_window_stands_down_on_a_cpu_job, on its run of the example with
# diagnose's default options)


@pytest.mark.slow  # the module's healthy run: one diagnose run with py-spy and a profiler window
def test_healthy_example_is_silent(healthy):
    assert len(healthy.steps) == 14
    assert ("0", "gil") in healthy.pyspy or "pyspy" in healthy.missing
    assert len(healthy.torch_trace), "the default torch.profiler window recorded nothing"
    assert _above_info(analyze(healthy)) == []


@pytest.mark.slow  # the module's healthy run: one diagnose run with py-spy and a profiler window
def test_healthy_example_has_no_jit_finding(healthy):
    # what diagnose wrote (findings.json): the jit analyzer says nothing, not even info
    # (moved here from tests/test_jit.py, which recorded a healthy run of its own for it)
    findings = read_findings(healthy.path)
    assert findings and [(f.id, f.severity) for f in findings if f.analyzer == "jit"] == []


@pytest.mark.slow  # the module's healthy run: one diagnose run with py-spy and a profiler window
def test_default_torch_profile_window_is_stored_for_perfetto_and_left_out_of_the_statistics(healthy):
    path = os.path.join(healthy.path, "trace", "0.json.gz")
    with gzip.open(path, "rt") as f:
        doc = json.load(f)  # Perfetto and chrome://tracing read this Chrome-trace JSON as is
    assert doc["traceEvents"] and doc["baseTimeNanoseconds"] > 0
    windows = healthy.events[healthy.events["type"] == "torch_profile"]
    assert list(windows["first_step"]) == [3] and list(windows["last_step"]) == [4]
    # within its budgets (moved here from tests/test_shim_safety.py): a bounded trace, written
    window = windows.iloc[0]
    assert pd.isna(window.get("stood_down")) and window["ended_by"] == "window end"
    assert 0 < window["bytes"] <= window["max_bytes"] == 20_000_000
    assert window["cost_s"] <= window["budget_s"]
    assert (healthy.torch_trace["cat"] == "cpu_op").any()
    from traindx.analyzers.core.evidence import steady_steps

    assert not steady_steps(healthy)["step"].isin([3, 4]).any()
    # the trace lies on the run's clock: its ops fall inside the profiled steps
    ops = healthy.torch_trace[healthy.torch_trace["cat"] == "cpu_op"]
    steps = healthy.steps.set_index("step")
    assert ops["start_ns"].min() >= steps.loc[3, "start_ns"] - 50_000_000
    assert ops["end_ns"].max() <= steps.loc[4, "end_ns"] + 50_000_000


@pytest.mark.slow  # the module's healthy run: one diagnose run with py-spy and a profiler window
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


@pytest.mark.slow  # four recorded H200 runs with their CUDA traces analysed
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
    from traindx.analyzers.gpu.clocks import steady_span

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


@pytest.mark.slow  # the module's healthy run: one diagnose run with py-spy and a profiler window
def test_synthetic_gpu_evidence_allocator_retries_prescribe_expandable_segments(healthy, tmp_path):
    dest = _copy_run(healthy, tmp_path)
    retries = 0
    with open(dest / "events" / "0.jsonl", "a") as f:
        for row in healthy.steps.itertuples():
            retries += 2 if row.step % 3 == 0 else 0
            # the keys the shim writes from torch.cuda.memory_stats() (stepwork.emit_alloc)
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


@pytest.mark.slow  # the module's healthy run: one diagnose run with py-spy and a profiler window
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


@pytest.mark.slow  # the module's healthy run: one diagnose run with py-spy and a profiler window
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


def test_a_data_wait_that_comes_and_goes_on_a_loaded_machine_is_no_starvation():
    """Recorded Lightning runs on a loaded 2-core machine (tests/data/cpu-lightning-loaded): the
    healthy job's data wait (12 % of the steps, mostly waiting for a core) is no finding; the
    starving job's (a wait in every step) stays one, at its size."""
    from traindx.analyzers.data import dataloader
    from traindx.analyzers.host import threads

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
