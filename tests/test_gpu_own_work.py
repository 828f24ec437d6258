"""traindx's own step-end work inside a torch.profiler window is not the job's host work: on the
H200 the shim's event writer and GPU timer were listed among the calls the GPU waited for, and
pulled the finding to the loop's body instead of the line that builds the batch (recorded run
folder: tests/data/h200-grow-memory.README)."""

import pytest
from helpers import recorded_runs

import traindx


@pytest.fixture(scope="module")
def findings(tmp_path_factory):
    folder = recorded_runs("h200-grow-memory", tmp_path_factory.mktemp("grow"))
    return traindx.analyze(traindx.load_run(str(folder / "grow_memory-bad")))


def test_the_shims_frames_are_not_the_jobs_host_work(findings):
    starved = next(f for f in findings if f.id == "gpu_idle.host_starved")
    calls = [c["call"] for c in starved.evidence["calls"]]
    assert calls and not [c for c in calls if "_traindx_shim" in c], calls
    # the batch is built on the host by the job's own function, at its line
    assert starved.evidence["function"] == "batch_for" and calls[0] == "randn"
    assert starved.evidence["file"].endswith("gpu_math_cases.py")


def test_the_growing_list_is_the_headline(findings):
    """64 MB a step of device memory runs out in ~2,200 steps: the run will stop, which comes
    before any step time it could save."""
    growth = next(f for f in findings if f.id == "memory.growth")
    assert growth.severity == "critical" and "`kept`" in growth.title
    assert growth.evidence["steps_left"] < 10_000
    assert next(f for f in findings if f.id == "verdict.cause").evidence["top"] == "memory.growth"
    assert findings.index(growth) < findings.index(
        next(f for f in findings if f.id == "gpu_idle.host_starved")
    )
