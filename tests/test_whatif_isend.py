"""Non-blocking point-to-point ops (isend/irecv, batch_isend_irecv) reach the shim: a job built on
torch.distributed.pipelining (PipelineStage + Schedule1F1B, 2 stages under torchrun, gloo) whose
first stage carries 3x the layers of the second, and its balanced twin, each under `diagnose`.
The stages come from the isend/irecv peers, the what-if names the first stage, the twin stays at
most low (a run of it recorded on the 2-core CPU machine, tests/data/cpu-whatif-twins.README,
judged here); and Work.wait is wrapped only once a job calls isend/irecv."""

import json
import os
import textwrap

import pytest
from helpers import PY, diagnose, only_run_dir, recorded_runs_here

import traindx
from traindx.derive.optable import OpType
from traindx.derive.optable_runs import from_run, nonblocking_sends

# a 2-rank torchrun job under diagnose, and a one-process job
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "bench", "jobs", "whatif_pipelining.py")
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")


def _args(out, split):
    job = [JOB, "--split", split, "--steps", "8", "--micro-batches", "4", "--layer-ms", "3"]
    return ["--out", str(out), "--quiet", "--no-pyspy", "--", TORCHRUN, "--nproc-per-node", "2", *job]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("isend")
    proc = diagnose(_args(tmp / "slow", "6,2"), cwd=tmp, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # the balanced twin (--split 4,4): recorded, judged by the test
    twins = recorded_runs_here("cpu-whatif-twins", tmp, "/work/wt-testsa") / "cpu-whatif-twins"
    return {"slow": only_run_dir(tmp / "slow"), "even": str(twins / "whatif_pipelining-even")}


def _whatif(run_dir):
    with open(os.path.join(run_dir, "findings.json")) as fh:
        return [f for f in json.load(fh) if f["id"].startswith("whatif.")]


def test_isend_irecv_read_as_pipeline_ops(runs):
    run = traindx.load_run(runs["slow"])
    assert nonblocking_sends(run)
    table = from_run(run)
    assert sorted(table["pp"].unique()) == [0, 1] and set(table["dp"]) == {0}
    ops = {(int(p), str(o)) for p, o in zip(table["pp"], table["optype"], strict=True)}
    assert {(0, OpType.FWD_SEND), (0, OpType.BWD_RECV), (1, OpType.FWD_RECV), (1, OpType.BWD_SEND)} <= ops
    assert {(0, OpType.FWD_SEND_WAIT), (1, OpType.FWD_RECV_POST)} <= ops
    fwd = table[table["optype"] == OpType.FWD].groupby("pp")["seq"].nunique()
    assert list(fwd) == [4, 4]  # every micro-batch's forward on each stage


def test_the_heavy_stage_is_named_and_the_twin_stays_quiet(runs):
    found = _whatif(runs["slow"])
    assert [f["id"] for f in found] == ["whatif.stage"] and found[0]["severity"] in ("medium", "high")
    ev = found[0]["evidence"]
    assert ev["layout"]["pp"] == 2 and ev["names"] == "the first stage (0)"
    assert ev["layout"]["oneway_sends"] and ev["balance_stages_speedup"] > 1.1
    twin = [f for f in traindx.analyze(traindx.load_run(runs["even"])) if f.id.startswith("whatif.")]
    assert all(f.severity in ("info", "low") for f in twin), [(f.id, f.severity) for f in twin]


def test_work_wait_is_wrapped_only_once_a_job_calls_isend(tmp_path):
    # two processes (gloo cannot send to itself): the first starts the second
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(f"""
        import subprocess, sys
        import torch, torch.distributed as dist
        rank = int(sys.argv[1]) if len(sys.argv) > 1 else 0
        other = None if rank else subprocess.Popen([sys.executable, __file__, "1"])
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=rank, world_size=2)
        before = hasattr(dist.Work.wait, "__wrapped__")
        dist.all_reduce(torch.ones(4), async_op=True).wait()
        still = hasattr(dist.Work.wait, "__wrapped__")
        out, into = torch.ones(256), torch.empty(256)
        ops = [dist.P2POp(dist.isend, out, 1 - rank), dist.P2POp(dist.irecv, into, 1 - rank)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        # one write per process (an unbuffered print writes each word apart: two ranks interleave)
        line = " ".join(str(x) for x in (before, still, hasattr(dist.Work.wait, "__wrapped__"), bool(into.sum() == 256)))
        sys.stdout.write("wrapped " + line + "\\n")
        dist.destroy_process_group()
        sys.exit(other.wait() if other else 0)
    """)
    )
    proc = diagnose(["--out", "runs", "--quiet", "--no-pyspy", "--", PY, str(script)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("wrapped False False True True") == 2
    spans = traindx.load_run(only_run_dir(tmp_path / "runs")).of_type("span")
    p2p = spans[spans["nonblocking"].astype(object) == True]  # noqa: E712
    assert sorted(p2p["op"]) == ["recv", "recv", "send", "send"]
    assert set(p2p["peer"]) == {0, 1} and set(p2p["bytes"]) == {1024}
