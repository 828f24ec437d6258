"""An optimizer told foreach=False over thousands of tensors on the H200, named where the
torch.profiler window could not be traced (recorded run folders: tests/data/h200-foreach-off.README)."""

import pytest
from helpers import recorded_runs

import traindx
from traindx.analyzers.core.findings import is_problem
from traindx.derive.steady import median_step_s


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = recorded_runs("h200-foreach-off", tmp_path_factory.mktemp("foreach"))
    return {arm: traindx.load_run(str(folder / f"foreach_off-{arm}")) for arm in ("bad", "fixed")}


def test_a_looped_optimizer_is_the_headline_with_its_multi_tensor_fix(runs):
    bad, fixed = runs["bad"], runs["fixed"]
    found = traindx.analyze(bad)
    loop = next(f for f in found if f.id == "gpu.launch_bound")
    assert loop.evidence["profiled"] is False and loop.evidence["tensors"] > 2000
    assert "AdamW" in loop.title and "fused=True" in loop.prescriptions[0].summary
    verdict = next(f for f in found if f.id.startswith("verdict."))
    assert verdict.evidence.get("top") == "gpu.launch_bound"
    # the twin (fused=True) is what the fix predicts: its median steady step is within a quarter
    # of the bad run's less the predicted saving (the steady steps as traindx chooses them: no
    # warm-up, none it perturbed, the same rule the saving was priced on)
    predicted = median_step_s(bad) - loop.seconds_lost_per_step
    assert abs(median_step_s(fixed) - predicted) <= 0.25 * predicted
    assert not [f for f in traindx.analyze(fixed) if is_problem(f) and f.severity != "low"]
