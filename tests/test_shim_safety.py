"""Never harm the job: the shim's compile hooks read no tensor data (a read of a CUDA tensor's
value is a device sync), a hook that fails never raises into the job, and the job's own errors
pass through unchanged.

No CUDA here: `torch.cuda.set_sync_debug_mode` raises "Torch not compiled with CUDA enabled" on a
CPU build. The CPU equivalent used below is a TorchDispatchMode that sees every aten operator
run while it is active: reading a tensor's value (repr, item, comparisons) runs operators such as
`aten._local_scalar_dense` (the one that syncs on CUDA), reading its shape/dtype/device runs none.
"""

import dataclasses
import os
import sys
import textwrap

import pandas as pd
import pytest
import torch
from helpers import PY, ROOT, diagnose
from torch.utils._python_dispatch import TorchDispatchMode

import traindx

sys.path.insert(0, os.path.join(ROOT, "profiler", "shim"))
from _traindx_shim import compiles  # noqa: E402

from traindx.analyzers.jit.jit import diff_keys  # noqa: E402


class OperatorLog(TorchDispatchMode):
    """Every aten operator dispatched while active."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@dataclasses.dataclass
class PackedParams:  # a framework's container that holds a tensor (PackedSeqParams' shape)
    cu_seqlens: torch.Tensor
    max_seqlen: torch.Tensor


class PrintsItsTensor:
    """An object whose own __repr__ reads tensor data: the shim must not call it."""

    def __init__(self, t):
        self.t = t

    def __repr__(self):
        return f"PrintsItsTensor({self.t.item()})"


def _fa4_like_key(max_seqlen):
    # the shape of FA4 4.0.0b17's backward compile key when max_seqlen is a 0-dim tensor
    return (
        torch.bfloat16,
        128,
        128,
        4,
        True,
        None,
        max_seqlen // 128 == 1,
        max_seqlen // 64 == 1,
        (1, 2),
        PackedParams(torch.tensor([0, 100, 300]), max_seqlen),
        PrintsItsTensor(max_seqlen),
        PackedParams,
        "sm_90",
    )


@pytest.mark.slow  # 6-7 s
def test_describing_a_compile_key_reads_no_tensor_data():
    key = _fa4_like_key(torch.tensor(200))
    q, seqlens = torch.zeros(2, 3), [torch.ones(1)]
    with OperatorLog() as log:
        text = compiles.safe_repr(key, 4000)
        _fields = {f"key[{i}]": compiles.safe_repr(v) for i, v in enumerate(key)}
        types = {f"key[{i}]": compiles._type_label(v) for i, v in enumerate(key)}
        args = {
            n: compiles.describe_value(v)
            for n, v in {
                "q": q,
                "max_seqlen_q": key[6],
                "params": key[9],
                "odd": key[10],
                "seqlens": seqlens,
            }.items()
        }
    assert log.ops == [], log.ops
    # the test can fail: what the shim did before (repr) reads the values
    with OperatorLog() as before:
        repr(key)
    assert "aten._local_scalar_dense.default" in before.ops
    # what the text keeps: metadata, the other fields' values, no tensor value
    assert "Tensor(shape=[], dtype=torch.bool, device=cpu)" in text
    assert "torch.bfloat16" in text and "'sm_90'" in text and "(1, 2)" in text
    assert "PackedParams(cu_seqlens=Tensor(shape=[3], dtype=torch.int64, device=cpu)" in text
    assert "test_shim_safety.PrintsItsTensor>" in text and "200" not in text
    assert types["key[6]"] == "Tensor" and types["key[1]"] == "int"
    assert args["q"] == {
        "tensor": True,
        "type": "Tensor",
        "shape": [2, 3],
        "dtype": "torch.float32",
        "device": "cpu",
    }
    assert args["odd"] == {"type": "PrintsItsTensor", "repr": "<test_shim_safety.PrintsItsTensor>"}


def test_key_described_without_values_still_tells_the_jit_analyzer_what_changed():
    """Two compiles, same key text: the tensor fields are named (identity); a changed int field
    is named by value."""
    a, b = _fa4_like_key(torch.tensor(100)), _fa4_like_key(torch.tensor(250))
    fa = {f"k{i}": compiles.safe_repr(v) for i, v in enumerate(a)}
    fb = {f"k{i}": compiles.safe_repr(v) for i, v in enumerate(b)}
    types = {f"k{i}": compiles._type_label(v) for i, v in enumerate(b)}
    changed, identity = diff_keys(fa, fb, types, types)
    assert changed == [] and {"k6", "k7"} <= set(identity)
    c = (a[0], 64) + a[2:]
    fc = {f"k{i}": compiles.safe_repr(v) for i, v in enumerate(c)}
    changed, _ = diff_keys(fa, fc, types, types)
    assert changed == ["k1"]


JOB = textwrap.dedent("""
    import timeit

    import torch
    import triton
    import triton.language as tl
    from triton.runtime.errors import AutotunerError

    class TuningCache(dict):
        # a job's own cache type: Triton only needs `in`, [] and []=; it has no len()
        def __len__(self):
            raise TypeError("TuningCache has no length")

    def bench(kernel_call, quantiles):
        best = min(timeit.repeat(kernel_call, number=1, repeat=2))
        return [best] * 3

    def make(prune=None):
        @triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})],
                         key=["n"], do_bench=bench,
                         prune_configs_by={"early_config_prune": prune} if prune else None)
        @triton.jit
        def copy_kernel(x, out, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(out + offs, tl.load(x + offs, mask=offs < n), mask=offs < n)
        return copy_kernel

    kernel = make()
    kernel.cache = TuningCache()
    x = torch.arange(50.0)
    out = torch.empty(50)
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.1)
    for step in range(3):
        kernel[lambda meta: (triton.cdiv(50, meta["BLOCK"]),)](x, out, 50)
        assert torch.equal(out, x)
        (w * 2.0).sum().backward()
        opt.step()
        opt.zero_grad()
    # the job's own error reaches the job unchanged
    broken = make(prune=lambda configs, named_args, **kw: [])
    try:
        broken[(1,)](x, out, 50)
    except AutotunerError as exc:
        print("job caught AutotunerError:", exc)
    print("w after 3 steps:", float(w))
    # wrapped library functions keep their signature (Lightning rebuilds DataLoaders from it)
    import inspect
    from torch.utils.data import DataLoader
    print("DataLoader signature:", list(inspect.signature(DataLoader.__init__).parameters)[:3])
    print("DataLoader hooked:", hasattr(DataLoader.__init__, "__wrapped__"))
""")


@pytest.mark.slow
def test_hooks_never_raise_into_the_job_and_pass_its_errors_through(tmp_path):
    pytest.importorskip("triton")
    script = tmp_path / "job.py"
    script.write_text(JOB)
    run_dir = tmp_path / "run"
    bare = __import__("subprocess").run(
        [PY, str(script)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bare.returncode == 0, bare.stderr[-2000:]
    proc = diagnose(
        ["--quiet", "--no-pyspy", "--no-nvml", "--run-dir", str(run_dir), "--", PY, str(script)],
        cwd=tmp_path,
        env={"TRITON_INTERPRET": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = open(run_dir / "log.txt", encoding="utf-8").read()
    assert "job caught AutotunerError: Autotuner error: No valid autotuner configs" in log
    assert "w after 3 steps: 0.4" in log  # the job computed what it computes bare
    assert "w after 3 steps: 0.4" in bare.stdout
    assert "DataLoader signature: ['self', 'dataset', 'batch_size']" in log
    assert "DataLoader hooked: True" in log  # the check above ran against the shim's wrapper
    run = traindx.load_run(str(run_dir))
    steps = run.events[run.events["type"] == "step_end"]
    assert len(steps) == 3
    # the hook that could not read the cache said so instead of breaking the job
    errors = run.events[run.events["type"] == "shim_error"]
    assert any("TuningCache has no length" in e for e in errors["error"]), errors.to_dict("records")


# -- diagnose's own failure never hides the job's result ---------------------------------------
BREAKS_REPORT = textwrap.dedent("""
    import os, sys
    import torch

    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    for step in range(2):
        (w * w).sum().backward()
        opt.step()
        opt.zero_grad()
    # the job writes where traindx will write its report: the analysis cannot finish
    os.makedirs(os.path.join(os.environ["TRAINDX_RUN_DIR"], "report.html", "x"))
    sys.exit(int(sys.argv[1]))
""")


@pytest.mark.parametrize("job_exit,expected", [(0, 3), (7, 7)])
@pytest.mark.slow
def test_failed_analysis_exits_non_zero_in_one_line_and_keeps_the_run(tmp_path, job_exit, expected):
    script = tmp_path / "job.py"
    script.write_text(BREAKS_REPORT)
    run_dir = tmp_path / "run"
    proc = diagnose(
        [
            "--quiet",
            "--no-pyspy",
            "--no-nvml",
            "--run-dir",
            str(run_dir),
            "--",
            PY,
            str(script),
            str(job_exit),
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == expected, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("diagnose:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "analysis" in lines[0] and str(run_dir) in lines[0]
    # the raw evidence is all there to re-analyse once the cause is gone
    run = traindx.load_run(str(run_dir))
    assert len(run.events[run.events["type"] == "step_end"]) == 2
    assert run.manifest["exit_code"] == job_exit


# -- the torch.profiler window is bounded in time and bytes ----------------------------------------
MANY_SMALL_OPS = textwrap.dedent("""
    import sys
    import torch

    # a host-bound step: thousands of tiny ops (the CPU image of many small kernels)
    ops = int(sys.argv[1])
    w = torch.nn.Parameter(torch.ones(8))
    opt = torch.optim.SGD([w], lr=0.0)
    for step in range(10):
        y = w
        for _ in range(ops):
            y = y * 1.0001 + 0.0001
        y.sum().backward()
        opt.step()
        opt.zero_grad()
""")


def _window_run(tmp_path, env, window="3-8", ops=3000, job=MANY_SMALL_OPS):
    """The run and its first window (a window that stood down for its cost is retried once,
    without Python stacks: _windows has both)."""
    run, windows = _windows(tmp_path, env, window, ops, job)
    return run, windows.iloc[0]


def _windows(tmp_path, env, window, ops, job):
    script = tmp_path / "job.py"
    script.write_text(job)
    run_dir = tmp_path / "run"
    proc = diagnose(
        [
            "--quiet",
            "--no-pyspy",
            "--no-nvml",
            "--torch-profile",
            window,
            "--run-dir",
            str(run_dir),
            "--",
            PY,
            str(script),
            str(ops),
        ],
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = traindx.load_run(str(run_dir))
    windows = run.events[run.events["type"] == "torch_profile"]
    assert len(windows) in (1, 2), run.events["type"].value_counts()
    if len(windows) == 2:  # the retry: once, without stacks, after the step that follows
        first, retry = windows.iloc[0], windows.iloc[1]
        assert isinstance(first["stood_down"], str) and not retry["stacks"]
        assert int(retry["first_step"]) == int(first["last_step"]) + 2
    return run, windows


def _traces(run):
    folder = os.path.join(run.path, "trace")
    return set(os.listdir(folder)) if os.path.isdir(folder) else set()


def _retry_traces(run):
    windows = run.events[run.events["type"] == "torch_profile"].iloc[1:]
    return (
        {os.path.basename(p) for p in windows["path"] if isinstance(p, str)} if "path" in windows else set()
    )


# a step of many Python calls and few ops: Python stacks are nearly all of its trace
PYTHON_HEAVY = textwrap.dedent("""
    import sys
    import torch

    def scale(v, k):
        return v * k

    calls = int(sys.argv[1])
    w = torch.nn.Parameter(torch.ones(8))
    opt = torch.optim.SGD([w], lr=0.0)
    for step in range(10):
        total = 0.0
        for i in range(calls):
            total += scale(1.0, i)
        (w * 1.0001).sum().backward()
        opt.step()
        opt.zero_grad()
""")


@pytest.mark.slow
def test_window_that_stood_down_for_its_stacks_is_retried_once_without_them(tmp_path):
    """With Python stacks a step of 30,000 Python calls traces far past a 50 kB limit: the
    window stands down, and one step more without stacks is within it, so the run still has
    the kernel-level (here: op-level) evidence."""
    run, windows = _windows(tmp_path, {"TRAINDX_TORCH_PROFILE_MAX_MB": "0.05"}, "3-3", 30000, PYTHON_HEAVY)
    assert len(windows) == 2
    first, retry = windows.iloc[0], windows.iloc[1]
    assert "MB" in first["stood_down"] and bool(first["stacks"])
    assert (int(retry["first_step"]), int(retry["last_step"])) == (5, 5)
    assert pd.isna(retry.get("stood_down")) and retry["bytes"] <= 50_000
    assert _traces(run) == {os.path.basename(retry["path"])}
    ops = run.torch_trace
    assert (ops["cat"] == "cpu_op").any() and not (ops["cat"] == "python_function").any()
    starts = run.events[run.events["type"] == "torch_profile_start"]
    assert [bool(x) for x in starts["stacks"]] == [True, False]
    # both windows and the step after each stay out of the step statistics; only the one that
    # wrote a trace is a profiled step of the trace's (the GPU-busy floor of a prediction once
    # took the stood-down step, with no events, for a step the GPU was busy throughout)
    from traindx.analyzers.core.evidence import steady_steps
    from traindx.derive.steady import trace_steps

    assert not set(steady_steps(run)["step"]) & {3, 4, 5, 6}
    assert set(trace_steps(run, "0")["step"]) == {5}


@pytest.mark.slow
def test_window_over_its_time_budget_ends_early_and_writes_nothing(tmp_path):
    run, window = _window_run(tmp_path, {"TRAINDX_TORCH_PROFILE_BUDGET_S": "0.05"})
    # asked for steps 3-8; ended early, at a boundary where the budget was gone: 3-4 on a quiet
    # machine, 6 once on a fresh clone at a load that doubled the suite's time. Which boundary
    # is the load's to move; that it ended before the window's end, by its budget, is not
    assert int(window["first_step"]) == 3 and int(window["last_step"]) < 8
    assert window["ended_by"].startswith("budget") and "stood_down" in window
    assert "over its budget" in window["stood_down"]
    assert pd.isna(window.get("path")) and _traces(run) <= _retry_traces(run)
    # its cost is on record: start + excess of the profiled step + stop, no export
    assert window["cost_s"] >= window["start_s"] + window["stop_s"]
    assert window["export_s"] < 0.5
    # the profiled step stays out of the step statistics, and so does the one after it (the
    # window's stop drained the device: traindx.derive.steady.perturbed_steps); later steps are measured
    # (nor do the retry's step without stacks and the one after it)
    from traindx.analyzers.core.evidence import steady_steps

    steady, last = set(steady_steps(run)["step"]), int(window["last_step"])
    windows = run.events[run.events["type"] == "torch_profile"]
    retried = {int(w["first_step"]) for _, w in windows.iloc[1:].iterrows()}
    assert retried <= {last + 2}
    left_out = set(range(3, last + 2)) | {s for r in retried for s in (r, r + 1)}
    assert not steady & left_out and set(range(last + 2, 10)) - left_out <= steady
    after = run.events[run.events["type"] == "torch_profile_after"]
    assert list(after["step"]) == sorted([last + 1, *[r + 1 for r in retried if r + 1 < 10]])


@pytest.mark.slow
def test_window_over_its_byte_limit_stands_down(tmp_path):
    run, window = _window_run(tmp_path, {"TRAINDX_TORCH_PROFILE_MAX_MB": "0.2"}, window="3-4")
    assert int(window["last_step"]) == 4 and window["ended_by"] == "window end"
    assert "MB" in window["stood_down"] and window["raw_bytes"] > 200_000
    assert pd.isna(window.get("path")) and _traces(run) <= _retry_traces(run)


# a window within its budget writes a bounded trace: tests/test_analyzers.py
# (test_default_torch_profile_window_is_stored_for_perfetto_and_left_out_of_the_statistics, on
# that module's recorded healthy run with its 3-4 window)
