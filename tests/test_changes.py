"""A prescription's change is a tagged union (traindx.analyzers.core.findings.Change): each kind reads
from and writes back the JSON form findings.json holds, byte for byte; an old findings.json loads;
fix planning refuses a change of no known kind."""

import copy
import glob
import json
import os
import pickle

import pytest

from traindx.analyzers.core.findings import (
    ArgChange,
    CacheWarm,
    EnvChange,
    Finding,
    NoChange,
    PackageVersion,
    Prescription,
    RuntimePatch,
    SourceEdit,
    UnknownChange,
    change_from_json,
)
from traindx.fixing.plan.planner import mechanism, plan_fixes

DATA = os.path.join(os.path.dirname(__file__), "data")

# the JSON forms analyzers write today (traindx.analyzers.*), key orders as they write them
JSON_FORMS = [
    ({}, NoChange),
    ({"env": {"OMP_NUM_THREADS": "4"}}, EnvChange),
    ({"env": {"NVTE_FLASH_ATTN_V4": None}}, EnvChange),
    (
        {"arg": {"framework": "megatron", "set": {"--manual-gc": True, "--manual-gc-interval": "100"}}},
        ArgChange,
    ),
    ({"arg": {"set": {"--workers": "2"}, "framework": "argparse", "remove": ["--x"]}}, ArgChange),
    (
        {
            "code": {
                "file": "/job/train.py",
                "line": 12,
                "before": "max_seqlen=m",
                "after": "max_seqlen=int(m)",
                "before_line": "    f(max_seqlen=m)\n",
                "role": "origin",
            }
        },
        SourceEdit,
    ),
    (
        {
            "code": {"file": "a.py", "line": 3, "before": "x", "after": "y", "op": "replace"},
            "codes": [
                {"file": "a.py", "line": 3, "before": "x", "after": "y", "op": "replace"},
                {"file": "a.py", "line": 9, "before": "z", "after": "w"},
            ],
        },
        SourceEdit,
    ),
    ({"codes": [{"file": "a.py", "line": 9, "before": "z", "after": "w"}]}, SourceEdit),
    ({"upgrade": {"package": "flash-attn-4", "min_version": "4.0.0b26"}}, PackageVersion),
    ({"upgrade": {"min_version": "3.6.0", "package": "triton"}}, PackageVersion),
    ({"precompile": {"from_run": "runs/x"}}, CacheWarm),
    (
        {
            "precompile": {"from_run": "runs/x", "triton_cache_dir": "/data/triton"},
            "env": {"TRITON_CACHE_DIR": "/data/triton"},
        },
        CacheWarm,
    ),
    ({"env": {"A": "1"}, "precompile": {"from_run": "runs/x"}}, CacheWarm),
    ({"runtime": {"patch": "fa4_int_max_seqlen"}}, RuntimePatch),
]


@pytest.mark.parametrize(
    ("data", "kind"), JSON_FORMS, ids=[f"{k.__name__}-{i}" for i, (_, k) in enumerate(JSON_FORMS)]
)
def test_each_kind_round_trips_through_its_json_form(data, kind):
    change = change_from_json(data)
    assert type(change) is kind
    assert change == data and json.dumps(change) == json.dumps(data)  # the same keys, in their order
    p = Prescription(kind="code", summary="s", change=data, automatic=True)
    assert isinstance(p.change, kind)
    text = json.dumps(p.to_dict())
    again = Prescription.from_dict(json.loads(text))
    assert again == p and json.dumps(again.to_dict()) == text
    assert pickle.loads(pickle.dumps(p)) == p and copy.deepcopy(p) == p


def test_typed_changes_write_the_json_analyzers_wrote():
    assert EnvChange(env={"A": "1"}) == {"env": {"A": "1"}}
    assert ArgChange(framework="argparse", flags={"--w": "2"}) == {
        "arg": {"framework": "argparse", "set": {"--w": "2"}}
    }
    assert ArgChange(framework="hf", flags={}, remove=("--x",)).to_json() == {
        "arg": {"framework": "hf", "set": {}, "remove": ["--x"]}
    }
    one, two = {"file": "a.py", "line": 1}, {"file": "a.py", "line": 2}
    assert json.dumps(SourceEdit(code=one, codes=(one, two))) == json.dumps(
        {"code": one, "codes": [one, two]}
    )
    assert SourceEdit(code=None, codes=(two,)) == {"codes": [two]}
    assert PackageVersion(package="triton", min_version="3.6.0") == {
        "upgrade": {"package": "triton", "min_version": "3.6.0"}
    }
    warm = CacheWarm(from_run="runs/x", env={"E": "1"}, options={"triton_cache_dir": "/c"})
    assert json.dumps(warm) == json.dumps(
        {"precompile": {"from_run": "runs/x", "triton_cache_dir": "/c"}, "env": {"E": "1"}}
    )
    assert RuntimePatch(patch="p") == {"runtime": {"patch": "p"}}
    assert NoChange() == {} and not NoChange()
    assert [c.kind for c in (EnvChange(env={}), warm, NoChange())] == ["env", "precompile", "none"]


def test_a_change_is_read_only():
    change = change_from_json({"env": {"A": "1"}})
    with pytest.raises(TypeError, match="read-only"):
        change["env"] = {}
    with pytest.raises(TypeError, match="read-only"):
        change.update(arg={})


def test_an_old_findings_json_loads_and_writes_back_byte_identical():
    files = sorted(glob.glob(os.path.join(DATA, "*", "*", "findings.json")))
    assert files
    for path in files:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        findings = [Finding.from_dict(d) for d in json.loads(text)]
        # as traindx.report.outputs.write_findings writes it
        assert json.dumps([f.to_dict() for f in findings], indent=2, default=str) == text, path
    old = {
        "id": "threads.oversubscribed",
        "title": "t",
        "severity": "medium",
        "analyzer": "threads",
        "prescriptions": [
            {"kind": "env", "summary": "s", "change": {"env": {"OMP_NUM_THREADS": "4"}}},
            {"kind": "code", "summary": "by hand"},  # no change at all: older runs wrote none
        ],
    }  # no symptoms, cause, removes: an older run's
    finding = Finding.from_dict(old)
    assert isinstance(finding.prescriptions[0].change, EnvChange)
    assert isinstance(finding.prescriptions[1].change, NoChange)
    assert finding.to_dict()["prescriptions"][0]["change"] == {"env": {"OMP_NUM_THREADS": "4"}}


def test_an_unknown_change_is_refused():
    with pytest.raises(UnknownChange, match=r"unknown prescription change with keys \['teleport'\]"):
        Prescription(kind="env", summary="s", change={"teleport": {"to": "mars"}})
    with pytest.raises(UnknownChange):
        Prescription(kind="env", summary="s", change={"env": {"A": "1"}, "arg": {"framework": "hf"}})
    # a change that bypassed Prescription's conversion: the planner names it, rather than guess
    p = Prescription(kind="env", summary="beam me up", change={"env": {"A": "1"}}, automatic=True)
    object.__setattr__(p, "change", {"teleport": {"to": "mars"}})
    finding = Finding(id="x.y", title="t", severity="high", analyzer="x", prescriptions=(p,))
    with pytest.raises(UnknownChange, match="none of the change kinds"):
        mechanism(p)
    with pytest.raises(UnknownChange, match="beam me up"):
        plan_fixes(["python", "train.py"], [finding], "runs/base", environ={})


def test_the_planner_dispatches_on_the_change_type():
    def planned(change, kind="env"):
        p = Prescription(kind=kind, summary="s", change=change, automatic=True)
        finding = Finding(id="x.y", title="t", severity="high", analyzer="x", prescriptions=(p,))
        return mechanism(p), plan_fixes(
            ["python", "train.py", "--lr", "1"], [finding], "runs/base", environ={}
        )

    how, plan = planned(EnvChange(env={"OMP_NUM_THREADS": "2"}))
    assert how == "config" and plan.env == {"OMP_NUM_THREADS": "2"}
    how, plan = planned(ArgChange(framework="argparse", flags={"--lr": "2"}), kind="arg")
    assert how == "config" and plan.command == ["python", "train.py", "--lr", "2"]
    how, plan = planned(RuntimePatch(patch="fa4_int_max_seqlen"), kind="runtime")
    assert how == "runtime" and plan.runtime_patches == ["fa4_int_max_seqlen"]
    how, plan = planned(PackageVersion(package="triton", min_version="3.6.0"), kind="upgrade")
    assert how == "overlay" and plan.overlays == ["triton>=3.6.0"]
    how, plan = planned(CacheWarm(from_run="runs/warm", env={"X_CACHE": "1"}), kind="precompile")
    assert how == "precompile" and plan.precompile == ["runs/warm"] and plan.env["X_CACHE"] == "1"
    how, plan = planned(NoChange())
    assert how == "config" and not plan.changes_anything
