"""One root, its symptoms: torch.compile(mode="max-autotune") on a batch size that changes every
3 steps. Every new size fails dynamo's size guard and recompiles the graph; on a GPU, inductor
then compiles (and benchmarks) that graph's Triton kernels anew. The headline is the changing
shape with its fix (a dynamic dimension, padded or bucketed sizes), never a cache directory, and
the kernels compiled again sit under it (traindx.analyzers.core.chains)."""

import json
import os
import shutil

import traindx
from traindx.analyzers.core.findings import reading_order

RUN = os.path.join(os.path.dirname(__file__), "data", "cpu-compile-shape-every-3")
KERNELS = 8  # Triton kernels of the graph (the eight "recompiles after warm-up")


def _roots(findings):
    return [f for f in reading_order(findings) if f.cause is None and not f.id.startswith("verdict.")]


def _envs(f):
    return [json.dumps(p.change.get("env") or {}) for p in f.prescriptions]


def test_the_shape_recompile_is_the_headline_with_its_sizes_and_fix():
    findings = traindx.analyze(traindx.load_run(RUN))
    top = _roots(findings)[0]
    assert top.id == "jit.dynamo_recompile", [(f.id, f.severity) for f in _roots(findings)]
    assert "8 → 12" in top.title and "12 → 16" in top.title
    fix = top.prescriptions[0].summary
    assert "dynamic" in fix and "pad or bucket" in fix
    assert not any("CACHE_DIR" in e for e in _envs(top))


def _with_triton_compiles(tmp_path):
    """The recorded CPU run plus the Triton compiles a GPU's inductor makes inside each graph
    compile (a kernel per fused op and an autotune of each matmul template, keyed by the batch
    size's element counts), on the job's main thread, as the shim writes them."""
    dest = tmp_path / "run"
    shutil.copytree(RUN, dest)
    path = dest / "events" / "p3509.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    graphs = [e for e in events if e.get("type") == "compile" and e.get("graph") == "forward"]
    batch_of = {0: 8, 3: 12, 6: 16}
    added = []
    for g in graphs:
        n = batch_of[g["step"]]
        t = g["start"] + 1_000_000
        for k in range(KERNELS):
            fields = {"xnumel": str(n * 64 * (k + 1)), "XBLOCK": "128"}
            kind = "triton_autotune" if k < 2 else "triton"
            name = f"triton_tem_fused_addmm_{k}" if k < 2 else f"triton_poi_fused_gelu_{k}"
            added.append(
                {
                    "type": "compile",
                    "kind": kind,
                    "kernel": name,
                    "start": t,
                    "t": t + 200_000_000,
                    "duration_s": 0.2,
                    "step": g["step"],
                    "in_step": True,
                    "thread": "MainThread",
                    "thread_id": g["thread_id"],
                    "is_main_thread": True,
                    "key": repr(fields),
                    "key_fields": fields,
                    "caller": g["caller"],
                }
            )
            t += 210_000_000
    events = sorted(events + added, key=lambda e: e.get("t", 0))
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return traindx.load_run(dest)


def test_kernels_compiled_again_in_the_recompiling_steps_sit_under_the_shape(tmp_path):
    findings = traindx.analyze(_with_triton_compiles(tmp_path))
    kernels = [f for f in findings if f.id in ("jit.steady_recompile", "jit.autotune")]
    assert len(kernels) == KERNELS, [(f.id, f.title) for f in findings]
    top = _roots(findings)[0]
    assert top.id == "jit.dynamo_recompile", [(f.id, f.severity, f.cause) for f in findings]
    assert all(f.cause == top.id and not f.prescriptions for f in kernels), [(f.id, f.cause) for f in kernels]
    assert set(top.symptoms) >= {f.id for f in kernels}
    # no cache directory for a recompile in the steady steps (a cache only serves the next
    # run's first step: the cold start's finding says so, not the headline)
    for f in [top, *kernels]:
        assert not any("CACHE_DIR" in e for e in _envs(f)), (f.id, _envs(f))
    # the graph's fix removes its kernels' tuning too: priced with the autotune line
    assert "autotune" in top.removes["categories"]


def test_a_kernel_compiled_again_outside_the_recompiling_steps_stays_its_own(tmp_path):
    _with_triton_compiles(tmp_path)
    step, path = 7, tmp_path / "run"  # step 7: no graph recompiled there
    file = os.path.join(str(path), "events", "p3509.jsonl")
    events = [json.loads(line) for line in open(file) if line.strip()]
    begin = next(e["t"] for e in events if e.get("type") == "step_begin" and e["step"] == step)
    fields = {"xnumel": "999", "XBLOCK": "64"}
    extra = {
        "type": "compile",
        "kind": "triton",
        "kernel": "triton_poi_fused_gelu_5",
        "start": begin + 1000,
        "t": begin + 50_000_000,
        "duration_s": 0.05,
        "step": step,
        "in_step": True,
        "thread": "MainThread",
        "is_main_thread": True,
        "key": repr(fields),
        "key_fields": fields,
    }
    with open(file, "a") as f:
        f.write(json.dumps(extra) + "\n")
    findings = traindx.analyze(traindx.load_run(str(path)))
    (own,) = [f for f in findings if f.evidence.get("kernel") == "triton_poi_fused_gelu_5"]
    assert own.cause is None, own.cause
