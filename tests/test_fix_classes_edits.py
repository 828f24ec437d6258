"""The planner's edits for each fix class, on the job's own code: host reads kept on the device,
guards made device asserts, mark_dynamic before the compiled model's calls, copies made
asynchronous, a host dataset pinned where it is made, a checkpoint written in the background, a
per-parameter optimizer made multi-tensor, unread host work moved to a thread, a Trainer's
checkpoint made rarer; an occasional cost judged by the mean."""

import ast
import os
import subprocess

import pytest
from fix_class_helpers import _edited, _line_of, _pageable
from helpers import PY, ROOT, diagnose

import traindx
from traindx.analyzers.core.findings import Finding, Prescription
from traindx.fixing.plan import source as fix_source
from traindx.fixing.plan.planner import candidate_plans


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
    from traindx.fixing.run.loop import _keep, _periodic

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

    from traindx.fixing.plan import optim_edits as codefix_optim

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
    script): the calls after its assignments run on a thread, in order, the assignments stay (a
    patch never unbinds a name); a line that only assigns keeps its place (the DataLoader advice
    is the fix there)."""
    from traindx.analyzers.host.work import async_edit

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
    edit = async_edit(lines[3].strip(), str(script), 4, str(tmp_path), daemon=True)
    # the assignment stays (a patch never unbinds a name), the calls after it go to the thread
    assert edit["after"] == (
        "        blob = open(__file__, 'rb').read(); __import__('threading').Thread(target=lambda: "
        "time.sleep(0.15), daemon=True).start()"
    )
    patched = lines[:3] + [edit["after"]] + lines[4:]
    ast.parse("\n".join(patched))
    assert async_edit(lines[4].strip(), str(script), 5, str(tmp_path)) is None  # `batch` is read
    assert (
        "target=lambda: log.flush()"
        in async_edit(lines[6].strip(), str(script), 7, str(tmp_path), daemon=False)["after"]
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
