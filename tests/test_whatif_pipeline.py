"""Our own pipeline runs read as pipelines: a 2-stage GPipe job under torchrun (gloo, blocking
send/recv) whose first stage carries 3x the layers of the second, and its balanced twin, each
under `diagnose`. The stages are found from the send/recv peers, the what-if names stage
imbalance (not one worker), `diagnose -- cmd` wrote that finding itself, and the twin stays quiet;
a run of one rank gets no what-if. The balanced twin is a run of the same job recorded on the
2-core CPU machine (tests/data/cpu-whatif-twins.README), judged here: its verdict is the
judge's, not the load's, and the job itself runs once (the 6,2 split) instead of twice."""

import json
import os
import subprocess

import pytest
from helpers import PY, diagnose, only_run_dir, recorded_runs_here

import traindx
from traindx.analyzers.ranks import whatif_run
from traindx.derive.optable import OpType
from traindx.derive.optable_runs import from_run

# a 2-rank torchrun job under diagnose: ~10 s CPU
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "bench", "jobs", "whatif_pipeline.py")
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")
DATA = os.path.join(ROOT, "tests", "data")


def _launch(tmp, name, split):
    out = tmp / name
    return out, diagnose(
        [
            "--out",
            str(out),
            "--quiet",
            "--no-pyspy",
            "--",
            TORCHRUN,
            "--nproc-per-node",
            "2",
            JOB,
            "--split",
            split,
            "--steps",
            "8",
            "--micro-batches",
            "4",
            "--layer-ms",
            "3",
        ],
        cwd=tmp,
        timeout=300,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipe")
    found = {}
    for name, split in (("slow", "6,2"),):
        out, proc = _launch(tmp, name, split)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        found[name] = only_run_dir(out)
    return found


def _auto(path):
    with open(os.path.join(path, "findings.json")) as fh:
        return [f for f in json.load(fh) if f["id"].startswith("whatif.")]


def test_stages_come_from_the_send_recv_peers(runs):
    table = from_run(traindx.load_run(runs["slow"]))
    assert sorted(table["pp"].unique()) == [0, 1] and set(table["dp"]) == {0}
    ops = {(int(p), str(o)) for p, o in zip(table["pp"], table["optype"], strict=True)}
    assert {(0, OpType.FWD_SEND), (0, OpType.BWD_RECV), (1, OpType.FWD_RECV), (1, OpType.BWD_SEND)} <= ops
    assert (0, OpType.FWD_RECV) not in ops and (1, OpType.FWD_SEND) not in ops
    fwd = table[table["optype"] == OpType.FWD].groupby("pp")["seq"].nunique()
    assert list(fwd) == [4, 4]  # every micro-batch's forward on each stage


def test_the_what_if_names_the_heavy_stage_not_one_worker(runs):
    proc = subprocess.run(
        [PY, "-m", "traindx", "analyze", runs["slow"], "--what-if", "--json"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    top = json.loads(proc.stdout)[0]
    assert top["id"] == "whatif.stage" and top["severity"] in ("medium", "high")
    ev = top["evidence"]
    assert ev["layout"]["pp"] == 2 and ev["names"] == "the first stage (0)"
    assert ev["balance_stages_speedup"] > 1.1
    assert "Move layers off the first stage" in top["prescriptions"][0]["summary"]


def test_diagnose_runs_the_what_if_itself_on_several_ranks(runs):
    auto = _auto(runs["slow"])
    assert [f["id"] for f in auto] == ["whatif.stage"]
    assert auto[0]["analyzer"] == "whatif_run" and auto[0]["severity"] in ("medium", "high")


def test_the_balanced_twin_stays_at_most_low(tmp_path):
    # the same job with --split 4,4, recorded (tests/data/cpu-whatif-twins), judged now
    twin = (
        recorded_runs_here("cpu-whatif-twins", tmp_path, "/work/wt-testsa")
        / "cpu-whatif-twins"
        / "whatif_pipeline-even"
    )
    found = [f for f in traindx.analyze(traindx.load_run(twin)) if f.id.startswith("whatif.")]
    assert all(f.severity in ("info", "low") for f in found), [(f.id, f.severity) for f in found]


def test_one_rank_gets_no_what_if():
    run = traindx.load_run(os.path.join(DATA, "cpu-gc-hook", "run"))
    assert whatif_run.analyze(run) == []
