"""What the ledger test modules share: a diagnose run of a test job, the ledger's sums checked exactly."""

import os

import numpy as np
from helpers import PY, diagnose

import traindx
from traindx.derive import ledger as L

JOBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs")
CATEGORY_COLUMNS = [f"{c}_s" for c in L.CATEGORIES] + ["unexplained_s"]


def _run(tmp_path, job, *args, pyspy=False, env=None):
    out = tmp_path / "runs"
    out.mkdir(exist_ok=True)
    flags = ["--out", str(out), "--quiet"] + ([] if pyspy else ["--no-pyspy"])
    before = set(os.listdir(out))
    proc = diagnose([*flags, "--", PY, os.path.join(JOBS, job), *args], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    new = [d for d in os.listdir(out) if d not in before]
    assert len(new) == 1, new
    return traindx.load_run(os.path.join(out, new[0])), proc


def _assert_sums_exactly(led):
    assert len(led)
    parts = led[CATEGORY_COLUMNS].to_numpy().sum(axis=1)
    np.testing.assert_allclose(parts, led["wall_s"].to_numpy(), rtol=0, atol=1e-6)
    assert (led[CATEGORY_COLUMNS].to_numpy() >= 0).all()
    ns = (led["end_ns"] - led["start_ns"]).to_numpy() / 1e9
    np.testing.assert_allclose(ns, led["wall_s"].to_numpy(), rtol=0, atol=1e-9)
