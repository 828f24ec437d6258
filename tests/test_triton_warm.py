"""`kernel-cache warm --from-run` for Triton kernels (kernel_cache/cli/triton_warm.py).

A real Triton kernel autotuned by Triton's own Autotuner, run on the CPU by Triton's interpreter
(TRITON_INTERPRET=1; configs timed with a CPU clock), inside a small training loop under
`diagnose`: the run records real autotune events. On this CPU-only machine the warm-up must say
in one line that it needs a GPU; its plan and FLA's config files are built without one.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from traindx.kernel_cache.cli import triton_warm

JOB = textwrap.dedent("""
    import sys, time
    import torch, triton, triton.language as tl

    def cpu_timer(fn, quantiles=None, **kwargs):  # the interpreter has no device timer
        t = time.perf_counter(); fn(); return (time.perf_counter() - t) * 1000

    @triton.autotune(configs=[triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 64})],
                     key=["n"], do_bench=cpu_timer)
    @triton.jit
    def scale_add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(out_ptr + offs, 2 * tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)

    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.1)
    for step, n in enumerate([96, 160, 96, 96]):   # a packed length: new at step 1, seen again later
        x, y = torch.randn(n), torch.randn(n)
        out = torch.empty(n)
        scale_add[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, out, n)
        assert torch.allclose(out, 2 * x + y)
        loss = ((out.mean() * w) ** 2)
        loss.backward(); opt.step(); opt.zero_grad()
        print(f"step {step} n {n} loss {float(loss):.4f}", flush=True)
""")


@pytest.fixture(scope="module")
def triton_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-run")
    job = root / "job.py"
    job.write_text(JOB)
    run_dir = root / "runs" / "tuned"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "traindx",
            "--quiet",
            "--no-pyspy",
            "--run-dir",
            str(run_dir),
            "--",
            sys.executable,
            str(job),
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return run_dir


def _kernel_cache(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "traindx.kernel_cache.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow  # one diagnose run of a Triton-interpreter job (~35 s on 2 busy cores)
def test_the_run_recorded_real_autotuning(triton_run):
    from traindx.derive.run import load_run

    events = triton_warm.triton_events(load_run(triton_run))
    tunes = [e for e in events if e["kind"] == "triton_autotune"]
    assert [e["kernel"] for e in tunes] == ["scale_add", "scale_add"]  # n=96, then n=160
    assert [e.get("step") for e in tunes] == [0, 1]
    assert [(e.get("key_fields") or {}).get("n") for e in tunes] == ["96", "160"]


@pytest.mark.slow  # one diagnose run of a Triton-interpreter job (~35 s on 2 busy cores)
def test_dry_run_plans_a_warm_up_to_the_last_step_that_tuned(triton_run):
    proc = _kernel_cache(
        "warm",
        "--from-run",
        str(triton_run),
        "--dry-run",
        "--triton-cache-dir",
        str(triton_run.parent / "tc"),
    )
    assert proc.returncode == 0, proc.stderr
    assert "--steps 2" in proc.stdout  # tuned at steps 0 and 1
    assert "TRITON_CACHE_DIR=" + str(triton_run.parent / "tc") in proc.stdout
    assert "autotuned scale_add: 2 key(s)" in proc.stdout
    assert "job.py" in proc.stdout  # the run's own command is replayed


@pytest.mark.slow  # one diagnose run of a Triton-interpreter job (~35 s on 2 busy cores)
def test_cpu_only_machine_says_what_it_cannot_do_in_one_line(triton_run):
    proc = _kernel_cache(
        "warm", "--from-run", str(triton_run), "--triton-cache-dir", str(triton_run.parent / "tc")
    )
    assert proc.returncode == triton_warm.NO_GPU_EXIT
    assert "Traceback" not in proc.stderr
    skipped = [line for line in proc.stderr.splitlines() if "skipped Triton" in line]
    assert len(skipped) == 1 and "need a GPU" in skipped[0] and "TRITON_INTERPRET" in skipped[0]
    assert not (triton_run.parent / "tc").exists()  # nothing half-written


@pytest.mark.slow  # a second diagnose run: the warm-up itself
def test_the_warm_up_replays_the_job_and_checks_its_own_record(triton_run):
    """Forced onto the CPU, the warm-up runs the recorded command under diagnose for the steps
    that tuned, and reads its own record: under Triton's interpreter the tuning happens again
    (same kernel, same keys) but Triton keeps nothing, which the verdict must say."""
    from traindx.derive.run import load_run

    cache = triton_run.parent / "tc-forced"
    proc = _kernel_cache(
        "warm",
        "--from-run",
        str(triton_run),
        "--triton-cache-dir",
        str(cache),
        env={"TRAINDX_TRITON_WARM_ON_CPU": "1", "TRITON_INTERPRET": "1"},
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    warmups = sorted((cache / ".warmup").iterdir())
    assert len(warmups) == 1
    warm = load_run(warmups[0])
    assert len(warm.steps) == 2  # --steps 2: where the run tuned
    tunes = [e for e in triton_warm.triton_events(warm) if e["kind"] == "triton_autotune"]
    assert [(e.get("key_fields") or {}).get("n") for e in tunes] == ["96", "160"]
    line = next(x for x in proc.stdout.splitlines() if "scale_add" in x)
    if any(e.get("cache_results") is not None for e in tunes):  # the shim says what Triton kept
        assert proc.returncode == 1 and "FAIL" in line and "nothing kept" in line
    else:
        assert proc.returncode == 0 and "unverified" in line
    assert f"export TRITON_CACHE_DIR={cache}" in proc.stdout


def test_persistence_env_names_only_switches_the_installed_versions_read():
    assert triton_warm.persistence_env({"triton": "3.6.0", "fla-core": "0.6.0"}, "/c") == {
        "TRITON_CACHE_DIR": "/c",
        "TRITON_CACHE_AUTOTUNING": "1",
        "FLA_CACHE_RESULTS": "1",
    }
    assert triton_warm.persistence_env({"triton": "3.1.0"}, "/c") == {"TRITON_CACHE_DIR": "/c"}


def _fla_cache_module(mode):
    """FLA 0.6.0's own config loader (fla/ops/utils/cache.py), loaded alone: it imports only torch
    and triton, and reads FLA_CACHE_MODE when loaded."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed (pip install '.[dev]')")
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", "utils", "cache.py")
    os.environ["FLA_CACHE_MODE"] = mode
    try:
        module_spec = importlib.util.spec_from_file_location(f"fla_cache_{mode}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    finally:
        os.environ.pop("FLA_CACHE_MODE", None)
    return module


def test_fla_config_files_load_with_flas_own_loader(tmp_path, monkeypatch):
    """The chosen configs become <kernel>.json that FLA 0.6.0 reads back: exactly in strict mode,
    and for another packed length in fuzzy mode (what stops re-tuning on a changing length)."""
    event = {
        "kind": "triton_autotune",
        "kernel": "chunk_fwd_kernel_o",
        "module": "fla.ops.common.chunk_o",
        "key_names": ["H", "K", "V", "BT", "NT"],
        "key_fields": {"H": "16", "K": "128", "V": "128", "BT": "64", "NT": "131"},
        "key_dtypes": {"q": "torch.bfloat16", "k": "torch.bfloat16", "g": "torch.float32"},
        "best_config": "{'BK': 64, 'BV': 64, 'num_warps': 4, 'num_ctas': 1, 'num_stages': 3}",
    }
    written = triton_warm.write_fla_configs([event], tmp_path, "3.6.0")
    assert [p.name for p in written] == ["chunk_fwd_kernel_o.json"]
    content = json.loads(written[0].read_text())
    entry = next(iter(content["autotune_entries"].values()))
    assert entry["config"] == {"kwargs": {"BK": 64, "BV": 64}, "num_warps": 4, "num_stages": 3, "num_ctas": 1}
    monkeypatch.setenv("FLA_CONFIG_DIR", str(tmp_path))
    arg_names = ["q", "k", "g", "H", "K", "V", "BT", "NT"]

    def key(cache, nt):
        import torch

        tensors = (
            torch.empty(1, dtype=torch.bfloat16),
            torch.empty(1, dtype=torch.bfloat16),
            torch.empty(1, dtype=torch.float32),
        )
        return cache.AutotuneKey.build(arg_names, event["key_names"], tensors + (16, 128, 128, 64, nt), {})

    strict = _fla_cache_module("strict")
    assert strict.load_cached_config("chunk_fwd_kernel_o", key(strict, 131))["kwargs"] == {"BK": 64, "BV": 64}
    assert strict.load_cached_config("chunk_fwd_kernel_o", key(strict, 140)) is None
    fuzzy = _fla_cache_module("fuzzy")
    assert fuzzy.load_cached_config("chunk_fwd_kernel_o", key(fuzzy, 140))["num_warps"] == 4


def test_fla_config_files_skip_keys_that_cannot_be_rebuilt():
    event = {
        "kind": "triton_autotune",
        "kernel": "k",
        "key_names": ["x"],
        "key_fields": {"x": "Tensor(shape=[], dtype=torch.int32, device=cuda:0)"},
        "best_config": "{'B': 1, 'num_warps': 2}",
    }
    assert triton_warm.fla_config_files([event]) == {}
