"""Evaluation is not the training step: a tiny GPT-2 (a config built in code, no download) that
calls `model.generate(...)` - or runs forwards under torch.no_grad() - after every 3rd optimizer
step, and its twin without. The evaluation's forwards are the ledger's eval/inference line, not
the training step's fwd/bwd; it is named at the job's line that calls it, with its period and
its price each time; the slow steps it makes sit under it; the twin has none of it."""

import os

import pytest
from analyzer_helpers import _line_of, _record
from helpers import PY

from traindx.analyzers.core.findings import reading_order
from traindx.derive import ledger as L

pytestmark = pytest.mark.slow  # each test one real job under diagnose (a tiny GPT-2, 15 steps)

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs", "eval_every_few.py")
LINES = {"generate": "model.generate(prompt", "no_grad": "loss = model(held_out"}


def _job(tmp_path_factory, mode):
    return _record(
        tmp_path_factory, mode, ["--no-pyspy"], [PY, JOB, "--steps", "15", "--every", "3", "--eval", mode]
    )


@pytest.mark.parametrize("mode", ["generate", "no_grad"])
def test_an_evaluation_every_3rd_step_is_named_at_its_call_with_period_and_price(tmp_path_factory, mode):
    import traindx

    run = _job(tmp_path_factory, mode)
    findings = traindx.analyze(run)
    (ev,) = [f for f in findings if f.id == "evaluation.in_loop"]
    assert ev.evidence["line"] == _line_of(JOB, LINES[mode]) and ev.evidence["file"].endswith(
        "eval_every_few.py"
    )
    assert ev.evidence["period"] == 3
    steps = set(ev.steps_affected)
    assert len(steps) >= 4 and {s % 3 for s in steps} == {0}  # after steps 2, 5, 8, 11: in the next one
    led = run.ledger.set_index("step")
    # the evaluation's forwards are its own line, in its steps only
    assert (led.loc[sorted(steps), "eval_s"] > 0).all()
    assert (led.drop(index=sorted(steps))["eval_s"] == 0).all()
    # and not the training step's: fwd/bwd of an evaluating step is a training step's
    others = led.drop(index=sorted(steps) + [0])
    assert led.loc[sorted(steps), "forward_backward_s"].median() < 2 * others["forward_backward_s"].median()
    # the price each time: at least the eval line of those steps
    assert ev.evidence["mean_s_each"] >= 0.9 * float(led.loc[sorted(steps), "eval_s"].mean())
    # one root: the evaluation; the slow steps are its price, and nothing names the optimizer step
    roots = [f for f in reading_order(findings) if f.cause is None and f.severity != "info"]
    assert roots and roots[0].id == "evaluation.in_loop", [(f.id, f.severity, f.cause) for f in findings]
    assert ev.severity == "low"
    slow = [f for f in findings if f.id == "steps.periodic_slow"]
    assert all(f.cause == ev.id for f in slow)
    step_line = _line_of(JOB, "opt.step()")
    assert not any(f.evidence.get("line") == step_line for f in findings), [
        (f.id, f.evidence.get("line")) for f in findings
    ]


def test_the_twin_without_evaluation_has_no_evaluation_line(tmp_path_factory):
    import traindx

    run = _job(tmp_path_factory, "none")
    findings = traindx.analyze(run)
    assert not [f for f in findings if f.id == "evaluation.in_loop"]
    assert float(run.ledger["eval_s"].sum()) == 0.0
    assert float(L.steady_rows(run)["forward_backward_s"].mean()) > 0
