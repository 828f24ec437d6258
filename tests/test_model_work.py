"""Work inside the model's own step judged: gradients nobody uses, an optimizer that steps every
micro-batch where the loss is scaled for accumulation, and the job's hooks booked as host work.

One real tiny job with all three (tests/jobs/model_work.py) and its healthy twin, each recorded
once under `diagnose` and checked for several things; the source edits on small files."""

import json
import os
import textwrap

import pytest

from tests.helpers import PY, ROOT, diagnose, only_run_dir
from traindx.analyzers.codefix import edit as codefix_edit
from traindx.analyzers.codefix import params as codefix_params
from traindx.analyzers.core.findings import Finding
from traindx.derive import ledger
from traindx.derive.run import load_run
from traindx.fixing.plan.planner import plan_fixes
from traindx.recipes.ab import compare_runs

JOB = os.path.join(ROOT, "tests", "jobs", "model_work.py")


def _record(tmp_path_factory, name, *args, env=None):
    out = tmp_path_factory.mktemp(name)
    proc = diagnose(["--quiet", "--no-pyspy", "--out", str(out), "--", PY, JOB, *args], cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = only_run_dir(str(out))
    with open(os.path.join(run_dir, "findings.json")) as f:
        return run_dir, json.load(f)


@pytest.fixture(scope="module")
def sick(tmp_path_factory):
    return _record(tmp_path_factory, "sick")


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return _record(tmp_path_factory, "healthy", "--healthy")


def _by_id(findings, fid):
    return [f for f in findings if f["id"] == fid]


@pytest.mark.slow
def test_unused_gradients_named_at_the_line_that_builds_them(sick):
    _, findings = sick
    (f,) = _by_id(findings, "param_use.unused_grads")
    assert f["severity"] in ("medium", "high")
    (module,) = f["evidence"]["modules"]
    assert module["module"] == "encoder" and module["reason"] == "lr0"
    assert module["built"]["file"] == JOB and module["built"]["line"] == 23  # self.encoder = ...
    code, runtime = f["prescriptions"][0], f["prescriptions"][1]
    assert code["automatic"] and code["change"]["code"]["op"] == "insert_after"
    assert code["change"]["code"]["after"] == "self.encoder.requires_grad_(False)"
    assert runtime["change"] == {"runtime": {"patch": "freeze_unused_params"}}
    assert f["seconds_lost_per_step"] > 0


@pytest.mark.slow
def test_step_every_micro_batch_named_with_its_lines(sick):
    _, findings = sick
    (f,) = _by_id(findings, "param_use.step_per_microbatch")
    ev = f["evidence"]
    assert ev["loss_scale"] == 4 and ev["divisor"] == "grad_accum_steps"
    assert ev["sites"]["optimizer"]["line"] == 57 and ev["sites"]["clip"]["line"] == 56
    assert "model_work.py:57" in f["title"] and "model_work.py:56" in f["title"]
    edit = f["prescriptions"][0]["change"]["code"]
    assert edit["after"].lstrip().startswith("if (i + 1) % grad_accum_steps == 0:")
    assert f["prescriptions"][0]["automatic"]  # --fix applies it; the A/B judges per micro-batch
    plan = plan_fixes([PY, JOB], [Finding.from_dict(f)], sick[0], environ={}, cwd=ROOT)
    assert [e for e in plan.source_edits if "grad_accum_steps == 0" in json.dumps(e)], plan.to_dict()


@pytest.mark.slow
def test_accumulation_fixed_is_judged_per_micro_batch(sick, healthy):
    # the healthy twin steps every 4th micro-batch: its step holds 4 backward passes, the sick
    # job's 1; a comparison of step times would call it 4x slower
    result = compare_runs(load_run(sick[0]), load_run(healthy[0]))
    unit = result["unit"]
    assert unit["name"] == "micro-batch"
    assert unit["backward_per_step"] == {"baseline": 1.0, "candidate": 4.0}
    base, cand = result["window_values_s"]["baseline"], result["window_values_s"]["candidate"]
    assert len(cand) >= 5 and len(base) >= 5
    parity = result["loss_parity"]
    assert parity["decided_by"] == "updates" and parity["passed"], parity
    assert (
        "numerics differ" not in result["verdict"]
        and "(per micro-batch; loss parity: updates)" in result["verdict"]
    )


@pytest.mark.slow
def test_hook_is_host_work_not_the_models_compute(sick):
    run_dir, findings = sick
    (f,) = _by_id(findings, "hooks.in_step")
    assert f["evidence"]["function"] == "record" and f["evidence"]["line"] == 36
    assert f["evidence"]["kind"] == "forward hook"
    assert f["prescriptions"][0]["change"]["runtime"]["patch"].endswith("model_work.py:36")
    # the ledger books the hook's calls as host, never as fwd/bwd; host_work leaves its lines
    led = ledger.steady_rows(load_run(run_dir))
    assert float(led["host_s"].mean()) >= f["seconds_lost_per_step"] * 0.9
    assert not [x for x in findings if x["id"] == "host_work.code" and "record" in x["title"]]


@pytest.mark.slow
def test_healthy_twin_is_quiet(healthy):
    run_dir, findings = healthy
    loud = [
        f["id"]
        for f in findings
        if f["severity"] not in ("info", "low") and not f["id"].startswith("verdict.")
    ]
    assert not [i for i in loud if i.startswith(("param_use.", "hooks."))], loud
    run = load_run(run_dir)
    events = run.of_type("param_use")
    assert len(events) and int(events["unused_numel"].iloc[-1]) == 0
    # the job's cheap tensor hook is known (and costs no finding)
    assert "tensor hook" in set(run.of_type("hook_site")["kind"])


def test_freeze_edit_and_accumulate_edit_apply(tmp_path):
    src = textwrap.dedent(
        """\
        import torch
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.body = torch.nn.Linear(
                    4, 4)
        accum = 2
        for step, batch in enumerate(range(8)):
            loss = batch / accum
            loss.backward()
            # keep it stable
            torch.nn.utils.clip_grad_norm_([], 1.0)
            opt.step()
            opt.zero_grad()
            log(step)
        """
    )
    path = tmp_path / "train.py"
    path.write_text(src)
    freeze = codefix_params.freeze_edit(str(path), 5)
    assert freeze and freeze["last_line"] == 6 and freeze["after"] == "self.body.requires_grad_(False)"
    # a module an installed package builds inside what the job's line builds: reached from it
    inner = codefix_params.freeze_edit(str(path), 5, "encoder.layer.0")
    assert inner and inner["after"] == "self.body.encoder.layer[0].requires_grad_(False)"
    assert codefix_params.accumulation_divisor(str(path), 10, 2.0) == "accum"
    acc = codefix_params.accumulate_edit(str(path), 13, "accum")
    text = codefix_edit.apply(acc, src)
    assert "    if (step + 1) % accum == 0:\n        torch.nn.utils.clip_grad_norm_" in text
    assert "        opt.zero_grad()\n    log(step)" in text


def test_accumulate_edit_zeroes_at_the_first_micro_batch_and_leaves_backward_out(tmp_path):
    src = textwrap.dedent(
        """\
        import sys
        for i, batch in enumerate(range(8)):
            opt.zero_grad()
            if "--x" in sys.argv:
                loss = model(batch)
            else:
                loss = model(batch) * 2
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(params, 1.0)
                opt.step()
            accum = 4
        """
    )
    path = tmp_path / "train.py"
    path.write_text(src)
    zero, step = codefix_params.accumulate_edits(str(path), 10, "accum", 4)
    text = codefix_edit.apply(zero, codefix_edit.apply(step, src))  # bottom up, as --fix applies them
    # the zero_grad at the top of each micro-batch would drop what was accumulated; `accum` is
    # bound only later in the loop: the number itself
    assert "    if i % 4 == 0:  # zero at the first of N micro-batches\n        opt.zero_grad()" in text
    # the step is inside the branch that holds the backward: only it goes under the condition
    assert (
        "        accelerator.backward(loss)\n        if (i + 1) % accum == 0:\n"
        "            accelerator.clip_grad_norm_(params, 1.0)\n            opt.step()\n"
    ) in text
    # a line that reaches the step only through a framework (no optimizer call there): no edit
    assert codefix_params.accumulate_edits(str(path), 5, "accum", 4) == []


def test_a_library_calling_the_jobs_code_back_is_named():
    import copy
    import sys

    from traindx.profiler.shim._traindx_shim import hostsample

    class Handler:
        def __deepcopy__(self, memo):  # the standard library's copy calls the job's code back
            return [hostsample._via(sys._getframe()), helper()]

    def helper():
        return hostsample._via(sys._getframe())

    via, via_helper = copy.deepcopy(Handler())
    assert via == via_helper == "copy.deepcopy"


def test_a_callback_runs_on_every_nth_call_after_the_edit(tmp_path):
    src = textwrap.dedent(
        """\
        class Metric:
            def on_batch_end(self, trainer, batch):
                \"\"\"Every batch.\"\"\"
                self.seen.append(batch)
                return sum(self.seen)


        def handler(engine):
            return [x for x in engine]
        """
    )
    path = tmp_path / "cb.py"
    path.write_text(src)
    method = codefix_params.every_nth_call_edit(str(path), 5, 10)
    assert method["callback"] == "on_batch_end" and method["line"] == 4
    text = codefix_edit.apply(method, src)
    assert '        self._calls = getattr(self, "_calls", 0) + 1' in text
    assert "        if self._calls % 10:\n            return None\n        self.seen.append(batch)" in text
    function = codefix_params.every_nth_call_edit(str(path), 9, 4)
    assert "handler._calls % 4" in codefix_edit.apply(function, src)


def test_the_accumulation_setting_is_read_from_the_objects_calling_backward():
    import sys

    from traindx.analyzers.model import param_use
    from traindx.profiler.shim._traindx_shim import paramuse

    class State:  # a framework keeps the number elsewhere and shows it as a property
        num_steps = 4

    class Runner:  # no name of ours: any object the job holds whose setting says accumulation
        def __init__(self):
            self.state = State()

        @property
        def gradient_accumulation_steps(self):
            return self.state.num_steps

        def accumulate(self, model):
            return model

    runner = Runner()  # held by this frame: the scan reads it
    saved = dict(paramuse._state["settings"])
    paramuse._state["settings"].clear()
    try:
        paramuse._scan_settings(sys._getframe())
        assert runner.gradient_accumulation_steps == 4
        found = paramuse._state["settings"]["Runner.gradient_accumulation_steps"]
    finally:
        paramuse._state["settings"].clear()
        paramuse._state["settings"].update(saved)
    assert found["name"] == "gradient_accumulation_steps" and found["value"] == 4
    assert found["expr"] == "runner.gradient_accumulation_steps" and found["mechanisms"] == ["accumulate"]
    # the framework's own mechanism is prescribed where the job holds the object ...
    own = param_use._framework_prescription(found, 4, edit=True)
    assert own is not None and "runner.accumulate(...)" in own.summary
    # ... its argument where the framework steps (no edit of the job's loop), never its files
    arg = param_use._framework_prescription({**found, "expr": None, "mechanisms": []}, 4, edit=False)
    assert arg is not None and "Runner(gradient_accumulation_steps=4)" in arg.summary
    assert arg.change is None or "site-packages" not in str(arg.change)


def test_loss_scale_read_through_a_frameworks_own_division_and_its_clipping_counted():
    """Accelerate's backward divides the job's `loss / 4` by its own accumulation steps (1) and
    clips with torch.nn.utils.clip_grads_with_norm_: the scale is the chain's product, the
    clipping one count per call (clip_grad_norm_ calling the others inside counts once)."""
    import torch

    from traindx.profiler.shim._traindx_shim import paramuse

    w = torch.ones(3, requires_grad=True)
    loss = (w * 2.0).sum()
    assert paramuse._loss_scale(loss / 4 / 1) == 4.0
    assert paramuse._loss_scale(loss * 0.25) == 4.0
    assert paramuse._loss_scale(loss) is None
    calls = []
    clip = paramuse._wrap_clip(lambda *a: calls.append(a) or inner())
    inner = paramuse._wrap_clip(lambda: None)
    state = dict(paramuse._state)
    try:
        paramuse._state.update(accum_done=False, counts={}, sites={})
        clip(1)
        assert paramuse._state["counts"][paramuse._steps["step"]]["clip"] == 1
    finally:
        paramuse._state.clear()
        paramuse._state.update(state)


def test_freeze_edit_reaches_a_module_built_inside_a_module_dict(tmp_path):
    """A block list built as one entry of `nn.ModuleDict(dict(...))` (nanoGPT's model) is frozen
    by its own path, never the whole dict (its embeddings are updated)."""
    src = textwrap.dedent(
        """\
        class GPT:
            def __init__(self, n):
                self.transformer = nn.ModuleDict(dict(
                    wte = nn.Embedding(65, 8),
                    h = nn.ModuleList([Block() for _ in range(n)]),
                ))
                self.head = nn.Sequential(
                    nn.Linear(8, 8),
                )
        """
    )
    path = tmp_path / "m.py"
    path.write_text(src)
    edit = codefix_params.freeze_edit(str(path), 5)
    assert edit["after"].strip() == "self.transformer.h.requires_grad_(False)"
    assert (
        codefix_params.freeze_edit(str(path), 3)["after"].strip() == "self.transformer.requires_grad_(False)"
    )
    assert codefix_params.freeze_edit(str(path), 8) is None  # one layer of a Sequential: not the whole
