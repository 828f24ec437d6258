"""Complete compile records: every torch.compile compile of a long run (more than the 64 torch's
metrics deque keeps), with its recompile reason and the frame compiled; and Triton autotuning
counted exactly (benchmark seconds apart from JIT seconds, the key's argument names, the disk
cache) on a real Autotuner run by Triton's interpreter."""

import textwrap

import pytest
from helpers import PY, diagnose

import traindx

SHAPES = 80  # > 64: torch keeps the metrics of the last 64 compiles only

DYNAMO_JOB = textwrap.dedent(f"""
    import torch
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 1000
    torch._dynamo.config.cache_size_limit = 1000
    torch._dynamo.config.automatic_dynamic_shapes = False

    def scale(x):
        return (x * 2 + 1).sum()

    compiled = torch.compile(scale, backend="eager", dynamic=False)
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.0)
    for step in range(4):
        # each step compiles {SHAPES // 4} new sizes: the frame recompiles within and across steps
        for n in range(1 + step * {SHAPES // 4}, 1 + (step + 1) * {SHAPES // 4}):
            compiled(torch.ones(n))
        (w * 1.0).sum().backward()
        opt.step()
        opt.zero_grad()
""")


def _record(tmp_path, source, env=None, name="job.py"):
    script = tmp_path / name
    script.write_text(source)
    run_dir = tmp_path / "run"
    proc = diagnose(
        ["--quiet", "--no-pyspy", "--no-nvml", "--run-dir", str(run_dir), "--", PY, str(script)],
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return traindx.load_run(str(run_dir)), script


@pytest.mark.slow
def test_more_than_64_dynamo_compiles_all_recorded_with_reason_and_frame(tmp_path):
    run, script = _record(tmp_path, DYNAMO_JOB)
    dynamo = run.compiles[run.compiles["kind"] == "dynamo"]
    assert len(dynamo) == SHAPES, dynamo[["kernel", "compile_id", "step"]].tail()
    assert dynamo["compile_id"].is_unique
    # every compile after the first says why the guard failed, and names the frame compiled
    reasons = [r for r in dynamo["recompile_reason"] if isinstance(r, str) and r]
    assert len(reasons) == SHAPES - 1
    assert all("size mismatch" in r for r in reasons), reasons[:3]
    frames = {(c["file"], c["line"], c["function"]) for c in dynamo["caller"]}
    line = next(
        n for n, text in enumerate(script.read_text().splitlines(), 1) if text.startswith("def scale")
    )
    assert frames == {(str(script), line, "scale")}
    # recorded in the step they happened in, on the compiling thread
    assert sorted(set(dynamo["step"])) == [0, 1, 2, 3]
    assert dynamo["is_main_thread"].all()
    errors = run.events[run.events["type"] == "shim_error"]
    assert not len(errors), errors.to_dict("records")


AUTOTUNE_JOB = textwrap.dedent("""
    import timeit

    import torch
    import triton
    import triton.language as tl

    def bench(kernel_call, quantiles):
        # Triton's interpreter has no device benchmarker; time the config on the CPU
        best = min(timeit.repeat(kernel_call, number=1, repeat=3))
        return [best, best, best]

    @triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32}),
                              triton.Config({"BLOCK": 64})],
                     key=["n_tokens"], do_bench=bench)
    @triton.jit
    def add_kernel(x, y, out, n_tokens, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_tokens
        tl.store(out + offs, tl.load(x + offs, mask=mask) + tl.load(y + offs, mask=mask), mask=mask)

    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.0)
    # a packed length that changes on steps 0, 2 and 3: the kernel tunes again for each new one
    for n in (100, 100, 200, 300, 300):
        x, y = torch.randn(n), torch.randn(n)
        out = torch.empty(n)
        add_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, out, n)
        assert torch.allclose(out, x + y)
        (w * 1.0).sum().backward()
        opt.step()
        opt.zero_grad()
""")


@pytest.mark.slow
def test_triton_autotune_counted_per_kernel_and_key_with_bench_time(tmp_path):
    pytest.importorskip("triton")
    run, script = _record(tmp_path, AUTOTUNE_JOB, env={"TRITON_INTERPRET": "1"})
    tunes = run.compiles[run.compiles["kind"] == "triton_autotune"]
    assert list(tunes["kernel"]) == ["add_kernel"] * 3, tunes.to_dict("records")
    assert list(tunes["step"]) == [0, 2, 3]
    assert all(names == ["n_tokens"] for names in tunes["key_names"])
    assert [f["n_tokens"] for f in tunes["key_fields"]] == ["100", "200", "300"]
    assert all(
        d == {"x": "torch.float32", "y": "torch.float32", "out": "torch.float32"} for d in tunes["key_dtypes"]
    )
    assert (tunes["configs_benchmarked"] == 3).all() and (tunes["configs"] == 3).all()
    # benchmark time and JIT time apart; neither exceeds what the job waited
    assert (tunes["bench_s"] > 0).all() and (tunes["jit_s"] >= 0).all()
    assert ((tunes["bench_s"] + tunes["jit_s"]) <= tunes["wall_s"] + 1e-6).all()
    assert (tunes["duration_s"] == tunes["bench_s"]).all()
    # the interpreter turns Triton's autotune disk cache off
    assert not tunes["disk_cache_hit"].any()
    assert all(c["file"] == str(script) for c in tunes["caller"])
    errors = run.events[run.events["type"] == "shim_error"]
    assert not len(errors), errors.to_dict("records")
