"""What the analyzer test modules share: a diagnose run recorded once, a finding by id, the recorded runs."""

import os

from helpers import diagnose, only_run_dir

import traindx


def _record(tmp_path_factory, name, diagnose_args, job):
    out = tmp_path_factory.mktemp(name)
    proc = diagnose(["--out", "runs", "--quiet", *diagnose_args, "--", *job], cwd=out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return traindx.load_run(only_run_dir(out / "runs"))


def _one(findings, finding_id):
    hits = [f for f in findings if f.id == finding_id]
    assert len(hits) == 1, [(f.id, f.severity, f.summary) for f in findings]
    return hits[0]


H200_PATHOLOGIES = os.path.join(os.path.dirname(__file__), "data", "h200-gpu-pathologies")


def _h200(name):
    return traindx.load_run(os.path.join(H200_PATHOLOGIES, name))


def _line_of(path, text):
    with open(path) as f:
        return next(n for n, line in enumerate(f, 1) if text in line)


LOADED_LIGHTNING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "cpu-lightning-loaded")
