"""Issue 21, the fix classes the planner builds from the line a finding names (ast, never a file
name): per-step host reads kept on the device, pageable copies made asynchronous from pinned
memory, torch.compile's dynamic= at the call that made the recompiling graph. Each one a
candidate arm applied on a scratch copy and measured, with loss parity."""

import ast
import json
import os
import subprocess

import numpy as np
import pytest
from helpers import PY, ROOT, diagnose

import traindx
from traindx.analyzers import fix_source
from traindx.analyzers.findings import Finding, Prescription
from traindx.analyzers.fixplan import candidate_plans
from traindx.derive.ledger import steady_rows

JOBS = os.path.join(ROOT, "tests", "jobs")
HOST_READS = os.path.join(JOBS, "fix_host_reads.py")
COMPILE_SHAPES = os.path.join(JOBS, "fix_compile_shapes.py")


def _line_of(path, text):
    with open(path, encoding="utf-8") as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def _edited(plan):
    """{file: the patched text} of a plan's source edits (what the scratch copy holds)."""
    out = {}
    for path in {e["file"] for e in plan.source_edits}:
        out[path] = fix_source.patched_text(path, [e for e in plan.source_edits if e["file"] == path])
        ast.parse(out[path])
    return out


def _forward_outside_compile(run, led):
    """Per ledger row: seconds of its forward spans outside compile events."""
    sp = run.spans
    fwd = sp[sp["cat"] == "forward"]
    comp = run.compiles
    out = []
    for row in led.itertuples():
        total = 0
        for f in fwd[(fwd["start_ns"] >= row.start_ns) & (fwd["end_ns"] <= row.end_ns)].itertuples():
            covered, reach = 0, f.start_ns  # the union of the compile events inside it
            for s, e in sorted(zip(comp["start_ns"], comp["end_ns"])) if len(comp) else ():
                s, e = max(s, reach), min(e, f.end_ns)
                if e > s:
                    covered, reach = covered + e - s, e
            total += f.end_ns - f.start_ns - covered
        out.append(total / 1e9)
    return out


def _host_starved(path, line, lost):
    """The GPU view's finding as it read the H200 `total += loss.item()` job: the GPU idle for
    host work in the loop, prescriptions in prose only (nothing concrete of its own)."""
    return Finding(
        id="gpu_idle.host_starved",
        title="The GPU waits for host work",
        severity="high",
        analyzer="gpu_idle",
        seconds_lost_per_step=lost,
        share_of_step=0.4,
        evidence={"rank": "0", "function": "<module>", "file": path, "line": line},
        prescriptions=(
            Prescription(
                kind="code", summary="move the work off the training thread", expected_gain_s_per_step=lost
            ),
        ),
    )


def _pageable(path, line, lost, loader_pin=None):
    """gpu_idle.pageable_copy as it reads a trace: the copy's line, and (when the batch comes
    from a DataLoader) the loader's pin_memory=True edit; the non_blocking prescription is prose
    (its edit is the planner's to build from the named line)."""
    prescriptions = []
    if loader_pin:
        prescriptions.append(
            Prescription(
                kind="code",
                summary="DataLoader(..., pin_memory=True)",
                change={"code": loader_pin},
                expected_gain_s_per_step=lost,
            )
        )
    prescriptions.append(
        Prescription(kind="code", summary="copy asynchronously", expected_gain_s_per_step=lost)
    )
    return Finding(
        id="gpu_idle.pageable_copy",
        title="Host-to-device copies from pageable memory",
        severity="high",
        analyzer="gpu_idle",
        seconds_lost_per_step=lost,
        share_of_step=0.3,
        evidence={
            "rank": "0",
            "pageable_h2d_s_per_step": lost * 1.2,
            "file": path,
            "line": line,
            "source": open(path).read().splitlines()[line - 1],
        },
        prescriptions=tuple(prescriptions),
    )


def test_planner_builds_host_read_copy_and_compile_edits_from_the_named_lines(tmp_path):
    """Three findings whose prescriptions carry no edit: the planner reads the named lines (ast)
    and makes one candidate each, the edits applied together where they only pay together."""
    job = tmp_path / "loop.py"
    job.write_text(
        "import torch\n"
        "dev = 'cuda'\n"
        "table = torch.randn(256, 8)\n"
        "enc = torch.compile(torch.nn.Linear(8, 8))\n"
        "net = torch.compile(torch.nn.Linear(8, 1),\n"
        "                    dynamic=False)\n"
        "total, seen = 0.0, []\n"
        "for step in range(8):\n"
        "    x = table[step * 32:(step + 1) * 32].to(dev)\n"
        "    loss = net(enc(x)).pow(2).mean()\n"
        "    total += loss.item()\n"
        "    seen.append(float(loss))\n"
        "    if step % 4 == 0:\n"
        "        print(f'step {step} loss {loss.item():.3f}')\n"
    )
    # `net` and `enc` are both called at the call site: the recompiling one is the static one
    recompile = Finding(
        id="jit.dynamo_recompile",
        title="recompiles",
        severity="high",
        analyzer="jit",
        seconds_lost_per_step=0.5,
        evidence={
            "size_changes": ["32 → 48"],
            "reasons": {"tensor 'x' size mismatch at index 0": 3},
            "functions": {"forward": 3},
            "caller_kind": "call_site",
            "caller": {"file": str(job), "line": 10, "source": "    loss = net(enc(x)).pow(2).mean()"},
        },
        prescriptions=(Prescription(kind="code", summary="mark the dimension dynamic"),),
    )
    findings = [_host_starved(str(job), 9, 0.03), _pageable(str(job), 9, 0.02), recompile]
    cands, _ = candidate_plans([PY, str(job)], findings, str(tmp_path / "b"), cwd=str(tmp_path))
    by = {}
    for c in cands:
        by.setdefault(c.finding, []).append(c)
    # the compile call: dynamic=True first (the larger predicted saving), then dynamic=None
    compile_plans = [c for c in by["jit.dynamo_recompile"] if c.plan.source_edits]
    assert [c.summary.split(" at ")[0] for c in compile_plans[:2]] == [
        "torch.compile(..., dynamic=True)",
        "torch.compile(..., dynamic=None)",
    ]
    text = _edited(compile_plans[0].plan)[str(job)]
    assert "net = torch.compile(torch.nn.Linear(8, 1),\n                    dynamic=True)" in text
    assert "enc = torch.compile(torch.nn.Linear(8, 8))\n" in text  # the other compile untouched
    # the host reads kept on the device, in one arm; the print keeps its read
    reads = by["gpu_idle.host_starved"][0].plan
    text = _edited(reads)[str(job)]
    assert "    total += loss.detach()\n    seen.append(loss.detach())\n" in text
    assert "print(f'step {step} loss {loss.item():.3f}')" in text
    # the copy: the host table pinned once where it is made, with a non_blocking copy; else a
    # pinned copy at the line
    copies = [c.plan for c in by["gpu_idle.pageable_copy"]]
    text = _edited(copies[0])[str(job)]
    assert "table = torch.randn(256, 8).pin_memory()\n" in text
    assert "    x = table[step * 32:(step + 1) * 32].to(dev, non_blocking=True)\n" in text
    text = _edited(copies[1])[str(job)]
    assert "    x = table[step * 32:(step + 1) * 32].pin_memory().to(dev, non_blocking=True)\n" in text
    # a launch-bound step in a job that compiles: mode="reduce-overhead" at the one call whose
    # name is called in the loop (the finding names the loop's line)
    launch = Finding(
        id="gpu.launch_bound",
        title="launch-bound",
        severity="high",
        analyzer="gpu",
        seconds_lost_per_step=0.01,
        evidence={"caller": {"file": str(job), "line": 10, "source": "    loss = net(x).pow(2).mean()"}},
    )
    graphs, _ = candidate_plans([PY, str(job)], [launch], str(tmp_path / "b"), cwd=str(tmp_path))
    text = _edited(graphs[0].plan)[str(job)]
    assert (
        "net = torch.compile(torch.nn.Linear(8, 1),\n"
        "                    dynamic=False, mode='reduce-overhead')"
    ) in text
    # best predicted saving first, whatever the mechanism
    gains = [c.predicted_saving_s_per_step for c in cands]
    assert gains == sorted(gains, reverse=True)
    # the report marks them as the loop measures them: the planner's own candidates are listed
    # under their finding (first applied, the next ones tried in turn), never called "by hand"
    from types import SimpleNamespace

    from traindx.report.findings_view import finding_view, fix_marks

    run = SimpleNamespace(
        manifest={"command": [PY, str(job)], "cwd": str(tmp_path)}, path=str(tmp_path / "b")
    )
    marks = fix_marks(run, findings)
    planned = {f.id: [c["fix"] for c in marks.get((f.id, "planned"), [])] for f in findings}
    assert planned["jit.dynamo_recompile"][:2] == ["applied", "next"]  # dynamic=True, then None
    assert "next" in planned["gpu_idle.host_starved"] or "alternative" in planned["gpu_idle.host_starved"]
    view = finding_view(findings[0], [], marks)
    built = [p for p in view["prescriptions"] if p["planned"]]
    assert built and built[0]["summary"] == by["gpu_idle.host_starved"][0].summary
    assert (
        sum(m == "applied" for k, m in marks.items() if k[1] != "planned")
        + sum(c["fix"] == "applied" for k, v in marks.items() if k[1] == "planned" for c in v)
        == 1
    )


@pytest.mark.slow
def test_a_launch_bound_job_that_compiles_nothing_gets_its_model_compiled_where_it_is_made(tmp_path):
    """gpu.launch_bound in a job with no torch.compile: the model it trains (`.parameters()`),
    called by its loop directly or through an alias, compiled in place in CUDA-graph mode after
    the last line that makes it before that loop; the patched script runs and trains (CPU:
    inductor)."""
    job = tmp_path / "train.py"
    job.write_text(
        "import argparse\n"
        "import torch\n"
        "from torch import nn\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('--steps', type=int, default=3)\n"
        "a = p.parse_args()\n"
        "torch.manual_seed(0)\n"
        "model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(),\n"
        "                      nn.Linear(16, 1))\n"
        "model = model.to('cpu')\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "step_fn = model\n"
        "for step in range(a.steps):\n"
        "    x = torch.randn(32, 8)\n"
        "    loss = (step_fn(x) - x.sum(1, keepdim=True)).pow(2).mean()\n"
        "    opt.zero_grad()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    print(f'step {step} loss {loss.item():.4f}', flush=True)\n"
    )
    launch = Finding(
        id="gpu.launch_bound",
        title="launch-bound",
        severity="high",
        analyzer="gpu",
        seconds_lost_per_step=0.004,
        evidence={"caller": {"file": str(job), "line": 15}},
    )
    cands, _ = candidate_plans([PY, str(job)], [launch], str(tmp_path / "b"), cwd=str(tmp_path))
    assert len(cands) == 1 and cands[0].mechanism == "source", [c.summary for c in cands]
    assert "where the model is made (model at train.py:9" in cands[0].summary
    assert cands[0].predicted_saving_s_per_step == 0.004
    text = _edited(cands[0].plan)[str(job)]
    assert (
        "                      nn.Linear(16, 1))\nmodel.compile(mode='reduce-overhead')\n"
        "model = model.to('cpu')\n"
    ) in text
    patched = tmp_path / "patched.py"
    patched.write_text(text)
    proc = subprocess.run(
        [PY, str(patched), "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line.split()[1] for line in proc.stdout.splitlines()] == ["0", "1", "2"]
    # a job that compiles already: its own call gets the mode (the other test); no torch import,
    # or a model made in the loop: nothing
    from traindx.analyzers import codefix_compile

    assert codefix_compile.compile_model_edits(str(patched)) == []  # it compiles now
    bare = tmp_path / "bare.py"
    bare.write_text(job.read_text().replace("import torch\n", "import torch as T\n"))
    assert codefix_compile.compile_model_edits(str(bare)) == [] and codefix_compile.compile_model_edits(
        str(job)
    )
    # shaped like pytorch/examples' scripts: the model made in each branch of an if/else inside
    # main(), called by a train() helper's loop defined above it, reloaded after training
    helper = tmp_path / "helper.py"
    helper.write_text(
        "import torch\n"
        "def train(model, opt, steps):\n"
        "    for _ in range(steps):\n"
        "        model(torch.ones(4, 2)).sum().backward()\n"
        "        opt.step()\n"
        "def main(big):\n"
        "    if big:\n"
        "        model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Linear(8, 1))\n"
        "    else:\n"
        "        model = torch.nn.Linear(2, 1)\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    for epoch in range(2):\n"
        "        train(model, opt, 3)\n"
        "    model = torch.load('best.pt')\n"
    )
    (edit,) = codefix_compile.compile_model_edits(str(helper))
    assert (edit["line"], edit["last_line"]) == (7, 10)  # after the whole if/else
    assert (
        "    else:\n        model = torch.nn.Linear(2, 1)\n    model.compile(mode='reduce-overhead')\n"
        "    opt = " in fix_source.patched_text(str(helper), [edit])
    )
    inside = tmp_path / "inside.py"
    inside.write_text(
        "import torch\nfor s in range(2):\n    m = torch.nn.Linear(2, 1)\n"
        "    o = torch.optim.SGD(m.parameters(), lr=0.1)\n    m(torch.ones(2)).sum()\n"
    )
    assert codefix_compile.compile_model_edits(str(inside)) == []


@pytest.mark.slow  # 25 s: --fix runs of a real job
def test_fix_applies_the_host_read_and_pinned_copy_edits_and_parity_holds(tmp_path, monkeypatch):
    """A CPU has no device queue, so no analyzer can price a host read or a pageable copy here:
    the baseline's findings get the two GPU findings the way the H200 recorded them (the GPU
    view's host_starved at the loop, pageable_copy at the copy line with the loader's real
    construction site from the shim's data_site events). The loop plans them, applies each on a
    scratch copy, runs it: the edited job still runs, the patch is right, parity passes."""
    from traindx.analyzers import dataloader, frameworks
    from traindx.cli import outputs
    from traindx.cli.fixloop import FixOptions, fix
    from traindx.profiler.launcher import Options

    real = outputs.analyze_and_write
    copy_line = _line_of(HOST_READS, "x = x.to(dev)")

    def analyze_and_write(record, *args, **kwargs):
        findings, report = real(record, *args, **kwargs)
        if os.path.basename(record.path) != "baseline":
            return findings, report
        site = dataloader._starving_site(frameworks.data_sites(record, "0"), "DataLoader")
        pin = dataloader._site_change(site, "DataLoader", {"pin_memory": "True"})
        assert pin and "DataLoader(data, batch_size=16, shuffle=False, pin_memory=True)" in pin["after"]
        return [
            _host_starved(HOST_READS, copy_line, 0.03),
            _pageable(HOST_READS, copy_line, 0.02, loader_pin=pin),
        ] + list(findings), report

    monkeypatch.setattr(outputs, "analyze_and_write", analyze_and_write)
    # both arms measured: on a CPU nothing waits on a host read, so a first arm "as predicted"
    # is the machine's load (seen once on a fresh-clone CI run), which would end the search
    from traindx.analyzers import ab_verdict

    monkeypatch.setattr(ab_verdict, "as_predicted", lambda arm: False)
    before = open(HOST_READS).read()
    result = fix(
        [PY, HOST_READS],
        FixOptions(
            record=Options(steps=24, pyspy=False, extra_env={"OMP_NUM_THREADS": "1"}),
            run_dir=str(tmp_path / "fix"),
            cwd=str(tmp_path),
            tries=2,
            repeat_inconclusive=False,
        ),
    )  # the patches are checked here, not the measurement
    assert result.status == "done" and result.exit_code == 0
    reads, copy = result.arms[:2]
    assert reads["finding"] == "gpu_idle.host_starved" and copy["finding"] == "gpu_idle.pageable_copy"
    for arm in (reads, copy):
        assert arm["mechanism"] == "source" and arm["exit_code"] == 0, arm
        assert arm["loss_parity"] is True, arm  # the same losses, edited or not
    patch = open(reads["patch"]).read()
    assert "-    total += loss.item()\n+    total += loss.detach()\n" in patch
    patch = open(copy["patch"]).read()
    assert "+loader = DataLoader(data, batch_size=16, shuffle=False, pin_memory=True)" in patch
    assert "+    x = x.to(dev, non_blocking=True)" in patch
    fix_json = json.loads((tmp_path / "fix" / "fix.json").read_text())
    assert len(fix_json["arms"]) == 2
    # nothing waits on a CPU: an arm is kept only when it is not slower than the baseline
    kept = fix_json["kept"]
    assert kept is None or (kept["judged_speedup"] >= 1.0 and kept["loss_parity"] is True)
    assert open(HOST_READS).read() == before  # the user's file as it was


@pytest.mark.slow
def test_fix_compiles_with_dynamic_shapes_and_the_recompiles_stop(tmp_path):
    """A model compiled with dynamic=False, a new sequence length every step: dynamo recompiles
    each step (jit.dynamo_recompile, size mismatch). --fix edits that torch.compile call
    (dynamic=True) on a scratch copy: no compile in the candidate's window, >= 1.5x faster,
    parity. aot_eager keeps the suite's time (the recompile is dynamo's either way; inductor
    with the system C compiler: docs/fix.md)."""
    fix_dir = tmp_path / "fix"
    proc = diagnose(
        [
            "--fix",
            "--no-pyspy",
            "--quiet",
            "--steps",
            "6",
            "--fix-tries",
            "2",
            "--run-dir",
            str(fix_dir),
            "--",
            PY,
            COMPILE_SHAPES,
            "--backend",
            "aot_eager",
        ],
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1"},
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fix = json.loads((fix_dir / "fix.json").read_text())
    kept = fix["kept"]
    assert kept and kept["finding"] == "jit.dynamo_recompile" and kept["mechanism"] == "source"
    assert kept["significant"] and kept["judged_speedup"] >= 1.5 and kept["loss_parity"] is True
    patch = (fix_dir / "fix.patch").read_text()
    line = _line_of(COMPILE_SHAPES, "compiled = torch.compile(")
    assert "+compiled = torch.compile(model, backend=args.backend, dynamic=True)" in patch
    assert f"@@ -{line - 3}," in patch
    comparison = json.loads((fix_dir / "candidate" / "comparison.json").read_text())
    assert comparison["baseline"]["compiles_in_window"] >= 3
    assert comparison["candidate"]["compiles_in_window"] == 0
    candidate = traindx.load_run(fix_dir / "candidate")
    assert len(candidate.steps)
    # the predicted saving is more than the compile line: each recompiling step's forward is a
    # fresh graph's first call (the failed guard, lazy code generation, first-call checks) that
    # the fix removes too, down to a steady call (the candidate's forward)
    baseline = traindx.load_run(fix_dir / "baseline")
    steady = steady_rows(baseline)
    compile_line = float(steady["compile_s"].mean())
    first_calls = float(np.mean(_forward_outside_compile(baseline, steady)))
    steady_forward = float(np.median(_forward_outside_compile(candidate, steady_rows(candidate))))
    beyond = kept["predicted_saving_s_per_step"] - compile_line
    assert first_calls > steady_forward
    assert beyond >= 0.5 * (first_calls - steady_forward), (beyond, first_calls, steady_forward)
    assert kept["predicted_step_time_s"] < float(steady["wall_s"].mean()) - compile_line


def test_host_read_edits_keep_results_on_the_device_and_leave_host_values_alone(tmp_path):
    """Shapes of public training loops: a sum of a loss call, an AverageMeter, a list; a length
    drawn with torch.randint(...).item() is a host value made on purpose, a print keeps its read."""
    from traindx.analyzers import codefix

    job = tmp_path / "loop.py"
    job.write_text(
        "import torch\n"
        "def train(model, loader, meter, crit):\n"
        "    total, correct, lengths = 0.0, 0, []\n"
        "    for data, target in loader:\n"
        "        out = model(data)\n"
        "        total += len(data) * crit(out, target).item()  # sum up batch loss\n"
        "        correct += out.argmax(1).eq(target).sum().item()\n"
        "        meter.update(crit(out, target).item(), data.size(0))\n"
        "        lengths.append(torch.randint(4, 9, (1,)).item())\n"
        "        offset += torch.randint(4, 9, (1,)).item()\n"
        "        print('loss', crit(out, target).item())\n"
        "    return total\n"
    )
    edits = codefix.device_accumulations(str(job), 2)  # a profiler names the def line
    assert [(e["line"], e["after"]) for e in edits] == [
        (6, "total += len(data) * crit(out, target).detach()  # sum up batch loss"),
        (7, "correct += out.argmax(1).eq(target).sum().detach()"),
        (8, "meter.update(crit(out, target).detach(), data.size(0))"),
    ]
    # a finding that measured one line (host_work) edits that line only, not its neighbours
    assert codefix.device_accumulations(str(job), 5, widen=False) == []
    assert [e["line"] for e in codefix.device_accumulations(str(job), 7, widen=False)] == [7]
    text = fix_source.patched_text(str(job), [fix_source.resolve_edit(e) for e in edits])
    ast.parse(text)
    assert "lengths.append(torch.randint(4, 9, (1,)).item())" in text
    assert "print('loss', crit(out, target).item())" in text


@pytest.mark.slow  # 32-37 s: --fix runs of a real job
def test_a_guard_read_to_the_host_becomes_an_assert_on_the_device(tmp_path):
    """`if not <tensor>.item(): raise` and `if not torch.isfinite(loss).all(): raise` wait for
    every queued kernel to decide a check: the edit keeps the check on the device
    (torch._assert_async, no sync), a host-side flag in front of it stays an `if`. The GPU
    view's item_sync job (a finiteness check after every layer), patched, trains to the same
    losses on a CPU, and a non-finite activation still stops it."""
    import subprocess

    from traindx.analyzers import codefix

    job = tmp_path / "loop.py"
    job.write_text(
        "import torch\n"
        "def train(model, batches, check):\n"
        "    for x in batches:\n"
        "        loss = model(x).mean()\n"
        "        if not torch.isfinite(loss).all():\n"
        "            raise FloatingPointError('loss is not finite')\n"
        "        if check and (loss > 100).any().item():\n"
        "            raise ValueError('diverged')\n"
        "        if loss.item() > 5:\n"
        "            print('large')\n"
        "        if torch.allclose(loss, loss):\n"
        "            raise RuntimeError('never: allclose is a Python bool')\n"
    )
    edits = codefix.device_checks(str(job), 2)  # a profiler names the def line
    assert [(e["line"], e["after"]) for e in edits] == [
        (5, "torch._assert_async(torch.isfinite(loss).all(), 'loss is not finite')"),
        (7, "if check:\n            torch._assert_async(torch.logical_not((loss > 100).any()), 'diverged')"),
    ]
    text = fix_source.patched_text(str(job), [fix_source.resolve_edit(e) for e in edits])
    ast.parse(text)
    assert "if loss.item() > 5:" in text  # not a guard that raises: left alone

    script = tmp_path / "gpu_cases.py"
    original = open(os.path.join(ROOT, "bench", "jobs", "gpu_cases.py")).read()
    script.write_text(original)
    line = _line_of(str(script), "if self.check_every_layer and not torch.isfinite(x)")
    edits = codefix.device_checks(str(script), line)
    assert len(edits) == 1 and edits[0]["last_line"] == line + 1
    patched = tmp_path / "patched.py"
    patched.write_text(fix_source.patched_text(str(script), [fix_source.resolve_edit(edits[0])]))
    args = ["--case", "item_sync", "--device", "cpu", "--small", "--steps", "3"]
    runs = [
        subprocess.run([PY, str(p)] + args, capture_output=True, text=True, timeout=120)
        for p in (script, patched)
    ]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-800:] for r in runs]
    losses = [[l.split()[3] for l in r.stdout.splitlines() if l.startswith("step ")] for r in runs]
    assert losses[0] == losses[1] and len(losses[0]) == 3
    # the check still stops a non-finite forward
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import math, sys, torch\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from patched import MLP\n"
        "m = MLP(4, 8, 2, check_every_layer=True)\n"
        "with torch.no_grad():\n"
        "    m.layers[0].weight.fill_(math.inf)\n"
        "m(torch.ones(2, 4))\n"
    )
    failed = subprocess.run([PY, str(probe)], capture_output=True, text=True, timeout=120)
    assert failed.returncode != 0 and "non-finite activations" in failed.stderr, failed.stderr[-800:]


def test_an_occasional_cost_is_judged_by_the_mean_and_a_slower_arm_is_never_kept():
    """A full GC in 3 of 23 steps: the median step is one without it, so the arm is judged by
    the mean; an arm slower than the baseline is not kept, whatever else ran."""
    from traindx.cli.fixloop import _keep, _periodic

    window = {"window_values_s": {"baseline": [0.05] * 20 + [0.9] * 3, "candidate": [0.06] * 23}}
    gc_steps = Finding(
        id="gc.gen2_in_step", title="gc", severity="high", analyzer="gc", steps_affected=(10, 17, 24)
    )
    every_step = Finding(
        id="gc.collect", title="gc", severity="high", analyzer="gc", steps_affected=tuple(range(23))
    )
    assert _periodic(gc_steps, window) and not _periodic(every_step, window)
    arm = {"exit_code": 0, "loss_parity": True, "significant": False, "dir": "a"}
    slower, even = dict(arm, judged_speedup=0.01, dir="slow"), dict(arm, judged_speedup=1.02)
    assert _keep([slower]) is None and _keep([slower, even])["dir"] == "a"
    # two wins within noise of each other (the job's flag 2.41x, the same value patched into its
    # source 2.47x): the flag is kept; a clearly larger win is kept whatever its mechanism
    win = dict(arm, significant=True)
    flag = dict(win, mechanism="config", judged_speedup=2.41, dir="flag")
    patch = dict(win, mechanism="source", judged_speedup=2.47, dir="patch")
    assert _keep([patch, flag])["dir"] == "flag"
    assert _keep([dict(patch, judged_speedup=4.0), flag])["dir"] == "patch"


def test_mark_dynamic_goes_before_the_calls_of_the_compiled_model(tmp_path):
    """The analyzer named the compiled function's definition (no call site): the guard's tensor
    is its parameter `x`, passed by position where the loop calls the compiled model; marked
    dynamic on the line before, one arm after the dynamic= ones."""
    job = tmp_path / "train.py"
    job.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x.cumsum(1)\n"
        "model = torch.compile(M(), dynamic=False)\n"
        "for step in range(4):\n"
        "    batch = torch.randn(2, 8 + step)\n"
        "    out = model(batch)\n"
    )
    finding = Finding(
        id="jit.dynamo_recompile",
        title="recompiles",
        severity="high",
        analyzer="jit",
        seconds_lost_per_step=0.4,
        evidence={
            "reasons": {"tensor 'x' size mismatch at index 1": 3},
            "size_changes": ["8 → 9"],
            "functions": {"forward": 3},
            "caller_kind": "caller",
            "caller": {"file": str(job), "line": 3, "function": "forward"},
        },
    )
    cands, _ = candidate_plans([PY, str(job)], [finding], str(tmp_path / "b"), cwd=str(tmp_path))
    assert [c.summary.split(" ")[0] for c in cands] == [
        "torch.compile(...,",
        "torch.compile(...,",
        "torch._dynamo.mark_dynamic(x,",
    ]
    text = _edited(cands[2].plan)[str(job)]
    assert "    torch._dynamo.mark_dynamic(batch, 1)\n    out = model(batch)\n" in text
    assert "model = torch.compile(M(), dynamic=False)\n" in text  # that arm leaves the call


def test_a_copy_whose_non_blocking_can_be_false_is_made_asynchronous(tmp_path):
    """`non_blocking=<a variable>` (or False) is still a blocking copy from pageable memory when
    the variable is False: it gets the same edits; `non_blocking=True` is left alone."""
    from traindx.analyzers import codefix

    job = tmp_path / "train.py"
    job.write_text(
        "import torch\n"
        "data = None\n"
        "data = [torch.randn(4, 4) for _ in range(3)]\n"
        "for step in range(6):\n"
        "    x = data[step % 3].to('cuda', non_blocking=async_copy)\n"
        "    y = data[step % 3].to('cuda', non_blocking=True)\n"
    )
    once, (edit,) = codefix.async_copy_edits(str(job), 5)
    assert [e["after"] for e in once] == [
        "data = [torch.randn(4, 4).pin_memory() for _ in range(3)]",
        "    x = data[step % 3].to('cuda', non_blocking=True)",
    ]
    assert edit["after"] == "    x = data[step % 3].pin_memory().to('cuda', non_blocking=True)"
    assert codefix.async_copy_edits(str(job), 6) == []


def test_a_host_dataset_built_after_a_placeholder_is_pinned_once_where_it_is_made(tmp_path):
    """The H200 pageable case's shape (bench/jobs/gpu_cases.py): the dataset name is first None,
    then a list comprehension of tensors, then (under a flag) re-pinned. It is still made once:
    the planner pins each element where it is made (measured on the H200 by the job's pinned
    twin: 0.88 of the predicted saving) before falling back to a pinned copy every step."""
    job = tmp_path / "loop.py"
    job.write_text(
        "import sys\n"
        "import torch\n"
        "dev = 'cuda'\n"
        "data = None\n"
        "data = [torch.randn(64, 8) for _ in range(3)]  # kept in host memory\n"
        "if '--pinned' in sys.argv:\n"
        "    data = [t.pin_memory() for t in data]\n"
        "for step in range(6):\n"
        "    x = data[step % len(data)].to(dev, non_blocking='--pinned' in sys.argv)\n"
        "    print(x.sum())\n"
    )
    cands, _ = candidate_plans(
        [PY, str(job)], [_pageable(str(job), 9, 0.05)], str(tmp_path / "b"), cwd=str(tmp_path)
    )
    texts = [_edited(c.plan)[str(job)] for c in cands]
    assert "data = [torch.randn(64, 8).pin_memory() for _ in range(3)]  # kept in host memory\n" in texts[0]
    assert "    x = data[step % len(data)].to(dev, non_blocking=True)\n" in texts[0]
    assert "data = None\n" in texts[0] and "    data = [t.pin_memory() for t in data]\n" in texts[0]
    assert "    x = data[step % len(data)].pin_memory().to(dev, non_blocking=True)\n" in texts[1]


@pytest.mark.slow  # 7 s: two runs of a real job
def test_a_checkpoint_written_inline_gets_a_background_write_that_keeps_every_checkpoint(tmp_path):
    """The periodic checkpoint finding names the job's `torch.save(...)` line: the planner's arm
    serializes the state at the call and writes the file on a thread. The patched job still
    leaves every checkpoint, whole and equal to the state of its step, and the arm is priced by
    what the writes can overlap (no more than the rest of the step)."""
    import subprocess

    import torch

    job = tmp_path / "train.py"
    job.write_text(
        "import os\n"
        "import sys\n"
        "import torch\n"
        "out = sys.argv[1]\n"
        "w = torch.zeros(64, 64)\n"
        "for step in range(6):\n"
        "    w += 1\n"
        "    if step % 2 == 1:\n"
        "        torch.save({'w': w, 'step': step, 'opt': [w * 2]},\n"
        "                   os.path.join(out, f'ckpt-{step}.pt'))\n"
        "        torch.save({'last': step}, os.path.join(out, 'latest.pt'))\n"
    )
    finding = Finding(
        id="steps.periodic_slow",
        title="every 2nd step is slow",
        severity="high",
        analyzer="stability",
        seconds_lost_per_step=0.3,
        evidence={
            "period": 2,
            "median_other_s": 0.1,
            "io_in_slow_steps": [
                {"call": "torch.save", "caller": {"file": str(job), "line": 9}},
                {"call": "torch.save", "caller": {"file": str(job), "line": 11}},
            ],
        },
        prescriptions=(Prescription(kind="code", summary="save asynchronously"),),
    )
    cands, _ = candidate_plans([PY, str(job), "out"], [finding], str(tmp_path / "b"), cwd=str(tmp_path))
    arm = next(c for c in cands if "background thread" in c.summary)
    assert arm.predicted_saving_s_per_step == pytest.approx(0.1)  # min(write, rest of step)
    text = _edited(arm.plan)[str(job)]
    assert "        _save_in_background({'w': w, 'step': step, 'opt': [w * 2]},\n" in text
    assert "        _save_in_background({'last': step}, os.path.join(out, 'latest.pt'))\n" in text
    patched = tmp_path / "patched.py"
    patched.write_text(text)
    out = tmp_path / "ckpts"
    out.mkdir()
    proc = subprocess.run([PY, str(patched), str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for step in (1, 3, 5):
        saved = torch.load(out / f"ckpt-{step}.pt")
        assert saved["step"] == step and torch.equal(saved["w"], torch.full((64, 64), step + 1.0))
        assert torch.equal(saved["opt"][0], torch.full((64, 64), 2 * (step + 1.0)))
    assert torch.load(out / "latest.pt") == {"last": 5}


def _per_parameter_optimizer_finding(job, cls, lost=0.010, share=0.6):
    """gpu.launch_bound as the analyzer writes it when torch.optim's step range was `share` of
    the profiled step (evidence["optimizer"], its prescription priced by that share)."""
    saving = round(lost * share, 6)
    return Finding(
        id="gpu.launch_bound",
        title="launch-bound",
        severity="high",
        analyzer="launch_bound",
        seconds_lost_per_step=lost,
        evidence={
            "caller": {"file": str(job), "line": 3},
            "cuda_graph_saving_s": round(lost - saving, 6),
            "optimizer": {
                "class": cls,
                "launches_per_step": 3000,
                "share_of_step": share,
                "share_of_launches": 0.7,
                "saving_s": saving,
            },
        },
        prescriptions=(
            Prescription(kind="code", summary="a multi-tensor optimizer", expected_gain_s_per_step=saving),
        ),
    )


@pytest.mark.slow  # 26-29 s: --fix runs of a real job
def test_a_per_parameter_optimizer_is_made_multi_tensor_at_the_call_that_makes_it(tmp_path):
    """gpu.launch_bound whose profiled steps were mostly torch.optim's step, one parameter at a
    time: the job's own call that makes the optimizer gets the installed torch's multi-tensor
    keyword (fused=True where the class has a fused kernel, else foreach=True; a conflicting
    foreach=/fused= set to None), one arm, a second that also compiles the model, both ranked by
    the analyzer's shares; the patched job trains. Shaped like pytorch/examples' mnist
    (`optim.Adadelta(model.parameters(), lr=args.lr)`) and imagenet (SGD over three lines)."""
    job = tmp_path / "main.py"
    job.write_text(
        "import argparse\n"
        "import torch\n"
        "import torch.optim as optim\n"
        "from torch import nn\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('--lr', type=float, default=1.0)\n"
        "args = p.parse_args()\n"
        "torch.manual_seed(0)\n"
        "model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])\n"
        "optimizer = optim.Adadelta(model.parameters(), lr=args.lr, foreach=False)\n"
        "for step in range(3):\n"
        "    loss = model(torch.randn(8, 4)).pow(2).mean()\n"
        "    optimizer.zero_grad()\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
        "    print(f'step {step} loss {loss.item():.4f}', flush=True)\n"
    )
    finding = _per_parameter_optimizer_finding(job, "Adadelta")
    cands, _ = candidate_plans([PY, str(job)], [finding], str(tmp_path / "b"), cwd=str(tmp_path))
    assert [round(c.predicted_saving_s_per_step, 6) for c in cands] == [0.010, 0.006, 0.004], [
        (c.summary, c.predicted_saving_s_per_step) for c in cands
    ]
    both, multi, graph = cands
    assert multi.summary.startswith("Adadelta(..., foreach=True) at main.py:10")
    (edit,) = multi.plan.source_edits
    assert edit["after"] == "optim.Adadelta(model.parameters(), lr=args.lr, foreach=True)"
    made = _edited(both.plan)[str(job)]
    assert "model.compile(mode='reduce-overhead')\n" in made and "lr=args.lr, foreach=True)" in made
    patched = tmp_path / "patched.py"
    patched.write_text(_edited(multi.plan)[str(job)])
    proc = subprocess.run(
        [PY, str(patched)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    baseline = subprocess.run(
        [PY, str(job)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdout == baseline.stdout  # the same updates, in fewer kernels

    from traindx.analyzers import codefix_optim

    # a fused kernel where the class has one; a multi-line call; foreach=True made None
    sgd = tmp_path / "sgd.py"
    sgd.write_text(
        "import torch\nm = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(m.parameters(), 0.1,\n"
        "                      momentum=0.9, foreach=True)\n"
    )
    (edit,) = codefix_optim.multi_tensor_edits(str(sgd), "SGD")
    assert (edit["line"], edit["last_line"]) == (3, 4)
    assert edit["after"].endswith("momentum=0.9, foreach=None, fused=True)")
    # imported by name from torch.optim, yes; a class of the file's own, **kwargs, another
    # library's AdamW, or a call already fused: no
    assert codefix_optim.multi_tensor_edits(str(sgd), "AdamW") == []
    named = tmp_path / "named.py"
    named.write_text(
        "from torch.optim import AdamW\nimport torch\nimport bitsandbytes as bnb\n"
        "m = torch.nn.Linear(2, 1)\no = AdamW(m.parameters())\n"
        "p = bnb.optim.AdamW(m.parameters())\nq = AdamW(m.parameters(), **kw)\n"
        "r = torch.optim.AdamW(m.parameters(), fused=True)\n"
    )
    assert [e["line"] for e in codefix_optim.multi_tensor_edits(str(named), "AdamW")] == [5]
    own = tmp_path / "own.py"
    own.write_text(
        "import torch\nclass SGD(torch.optim.Optimizer):\n    pass\no = SGD([torch.zeros(1)], {})\n"
    )
    assert codefix_optim.multi_tensor_edits(str(own), "SGD") == []
    # LBFGS steps as a whole: no multi-tensor keyword, no edit
    assert codefix_optim.multi_tensor_keyword("LBFGS") is None


def test_host_work_whose_results_nothing_reads_goes_to_a_background_thread(tmp_path):
    """A line of host work in the loop (a read and a wait joined by `;`, as in a slowed public
    script) whose assigned name nothing reads: its work runs on a thread, in order; a line whose
    result the step reads keeps its place (the DataLoader advice is the fix there)."""
    from traindx.analyzers.host_work import _async_edit

    script = tmp_path / "train.py"
    script.write_text(
        "import time\n"
        "def train(log):\n"
        "    for step in range(3):\n"
        "        blob = open(__file__, 'rb').read(); time.sleep(0.15)\n"
        "        batch = open(__file__, 'rb').read()\n"
        "        log.write(str(len(batch)))\n"
        "        log.flush()\n"
    )
    lines = script.read_text().splitlines()
    edit = _async_edit(lines[3].strip(), str(script), 4, str(tmp_path), daemon=True)
    assert edit["after"] == (
        "        __import__('threading').Thread(target=lambda: "
        "(open(__file__, 'rb').read(), time.sleep(0.15)), daemon=True).start()"
    )
    patched = lines[:3] + [edit["after"]] + lines[4:]
    ast.parse("\n".join(patched))
    assert _async_edit(lines[4].strip(), str(script), 5, str(tmp_path)) is None  # `batch` is read
    assert (
        "target=lambda: log.flush()"
        in _async_edit(lines[6].strip(), str(script), 7, str(tmp_path), daemon=False)["after"]
    )


@pytest.mark.slow
def test_a_trainer_checkpoint_every_few_steps_is_made_rarer_at_the_jobs_trainingarguments(tmp_path):
    """A real Hugging Face Trainer saving every 2 steps (its own synchronous save, inside
    transformers): the finding's fix is the job's own `TrainingArguments(...)` line with
    save_steps ten times the measured period, never a file under site-packages, and since that
    keyword reads the job's flag the first candidate is the flag (`--save-steps 20`)."""
    job = os.path.join(ROOT, "tests", "jobs", "fix_hf_workers.py")
    command = [
        PY,
        job,
        "--read-s",
        "0",
        "--max-steps",
        "40",
        "--save-strategy",
        "steps",
        "--save-steps",
        "2",
        "--hidden",
        "512",
        "--output-dir",
        str(tmp_path / "out"),
    ]
    proc = diagnose(
        ["--no-pyspy", "--quiet", "--steps", "14", "--run-dir", str(tmp_path / "run"), "--", *command],
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    findings = traindx.analyze(traindx.load_run(str(tmp_path / "run")))
    edits = [
        (f, p)
        for f in findings
        for p in f.prescriptions
        if "TrainingArguments(save_steps=" in p.summary and p.automatic
    ]
    assert edits, [(f.id, [p.summary for p in f.prescriptions]) for f in findings]
    finding, edit = edits[0]
    code = edit.change["code"]
    assert code["file"] == job and "site-packages" not in code["file"]
    assert "save_steps=20" in code["after"] and "save_steps=a.save_steps" in code["before"]
    cands, _ = candidate_plans(command, [finding], str(tmp_path / "b"), cwd=str(tmp_path))
    assert cands[0].mechanism == "config" and "--save-steps 20" in " ".join(cands[0].plan.command)
