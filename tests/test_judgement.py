"""The judged document (analyzers/judgement.py) and its renderers: a Judgement built in code over a
recorded run (tests/data/cold-first-step, no job launched) is what the terminal summary, the HTML
report and findings.json show; none of them judges again."""

import io
import json
import os
import shutil

import pytest
from rich.console import Console

from traindx.analyzers.core.findings import Finding, Prescription
from traindx.derive.run import load_run
from traindx.derive.steptables import run_t0, step_table
from traindx.judgement import FixPlan, Judgement, PlannedFix, StepCauses, judge_run
from traindx.report.data import build_report_data
from traindx.report.html import render_html
from traindx.report.outputs import read_findings, write_findings
from traindx.report.terminal import print_summary

COLD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "cold-first-step")

GC = Finding(
    id="gc.gen2_in_steps",
    title="Full collections inside steps cost 150 ms per step",
    severity="high",
    analyzer="gc",
    seconds_lost_per_step=0.15,
    share_of_step=0.88,
    ranks=("0",),
    prescriptions=(
        Prescription(
            kind="code",
            summary="call gc.freeze() once the model is built",
            change={
                "code": {
                    "file": "train.py",
                    "line": 12,
                    "before": "model = build()",
                    "after": "model = build()\ngc.freeze()",
                    "op": "replace",
                }
            },
            expected_gain_s_per_step=0.12,
            automatic=True,
        ),
        Prescription(kind="code", summary="raise generation 2's threshold", expected_gain_s_per_step=0.05),
    ),
)
SYMPTOM = Finding(
    id="stability.spread",
    title="Step times spread widely",
    severity="medium",
    analyzer="stability",
    seconds_lost_per_step=0.02,
    ranks=("0",),
    cause=GC.id,
)
NOTE = Finding(id="evidence.note", title="a note worth knowing", severity="info", analyzer="steps")
VERDICT = Finding(
    id="verdict.cause",
    title="call gc.freeze() once the model is built",
    severity="info",
    analyzer="verdict",
    summary=f"The change to make first: call gc.freeze() once the model is built (why: {GC.title}).",
    evidence={
        "top": GC.id,
        "top_title": GC.title,
        "top_severity": "high",
        "seconds_per_step": 0.15,
        "prescription": 0,
        "gain_s": 0.12,
        "step_s": 0.17,
        "step_statistic": "median",
        "after_step_s": 0.05,
        "speedup": 3.4,
        "saving_limit": None,
    },
)
PLAN = FixPlan(
    ("applied", "by_hand"), (PlannedFix("freeze the collector with the job's --gc-freeze", "arg", "next"),)
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    dest = tmp_path_factory.mktemp("judged") / "run"
    shutil.copytree(COLD, dest)
    return load_run(dest)


@pytest.fixture(scope="module")
def judgement(run):
    """The document as a judge could have written it: step 1 (the record's one-off slow step)
    is given the cause "stopped", which no judge of this record would give it."""
    table, source = step_table(run, run_t0(run))
    median = float(table["duration_s"].median())
    slow = (table["step"] == 1).to_numpy()
    table = table.assign(
        compile_s=0.0, gc_s=0.15, slow=slow, cause=["stopped" if s else "normal" for s in slow]
    )
    return Judgement(
        findings=(GC, SYMPTOM, NOTE, VERDICT),
        reading=(GC, SYMPTOM, NOTE),
        verdict=VERDICT,
        plans={GC.id: PLAN, SYMPTOM.id: FixPlan(())},  # the symptom: nothing for --fix to do
        steps=StepCauses(table, source, median, 1.5 * median),
    )


def test_the_terminal_prints_the_judgement(run, judgement):
    out = io.StringIO()
    print_summary(run, judgement, "report.html", console=Console(file=out, width=100))
    text = out.getvalue()
    assert "Verdict: call gc.freeze() once the model is built" in text
    assert "expected saving 120 ms per step" in text and "3.4× faster" in text
    assert "  +gc.freeze()" in text  # the verdict's prescription as a diff
    assert f"why: {GC.title} · diagnose --fix applies this" in text
    # the step's cause is the document's, named by its legend
    assert "slowest step 1: 1.67 s (the job was stopped (SIGSTOP))" in text
    # the reading order: the cause, its symptom under it (its seconds the cause's), the note after
    assert (
        text.index(GC.title) < text.index("↳ symptom: Step times spread widely") < text.index("note: a note")
    )
    assert "(20 ms)" in text
    # the plan's marks: the first prescription is the verdict's, the others are in the report
    assert "1. the verdict above [--fix applies this]" in text and "+ 1 alternative in the report" in text
    assert text.rstrip().endswith(f"run: {run.path}")


def test_the_html_report_renders_the_judgement(run, judgement):
    data = build_report_data(run, judgement)
    assert [f["id"] for f in data["findings"]] == [GC.id, SYMPTOM.id, NOTE.id]
    marks = [(p["summary"], p["fix"], p["planned"]) for p in data["findings"][0]["prescriptions"]]
    assert marks == [
        ("call gc.freeze() once the model is built", "applied", False),
        ("raise generation 2's threshold", "by_hand", False),
        ("freeze the collector with the job's --gc-freeze", "next", True),
    ]
    assert all(p["fix"] is None for f in data["findings"][1:] for p in f["prescriptions"])
    v = data["verdict"]
    assert v["kind"] == "change" and v["fix"] == "applied" and v["speedup"] == 3.4
    assert v["finding_anchor"] == data["findings"][0]["anchor"] and v["text"].endswith("+gc.freeze()")
    steps = data["timeline"]["ranks"]["0"]
    assert [s["cause"] for s in steps if s["cause"] != "normal"] == ["stopped"]
    assert data["stats"]["worst_step"]["cause"] == "stopped" and data["stats"]["slow_steps"] == 1
    html = render_html(data)
    assert "call gc.freeze() once the model is built" in html
    assert html.count('data-fix="applied"') == 1 and html.count('data-fix="by_hand"') == 1


def test_findings_json_holds_the_judgement_and_reads_back(run, judgement):
    path = write_findings(run, judgement)
    with open(path, encoding="utf-8") as f:
        entries = json.load(f)
    assert [e["id"] for e in entries] == [f.id for f in judgement.findings]
    by_id = {e["id"]: e for e in entries}
    # each entry is the finding's own JSON form, with its --fix plan where one was made
    assert {k: v for k, v in by_id[GC.id].items() if k != "fix"} == json.loads(json.dumps(GC.to_dict()))
    assert by_id[GC.id]["fix"] == {
        "prescriptions": ["applied", "by_hand"],
        "planned": [
            {"summary": "freeze the collector with the job's --gc-freeze", "mechanism": "arg", "fix": "next"}
        ],
    }
    assert "fix" not in by_id[SYMPTOM.id] and "fix" not in by_id[NOTE.id]
    # the verdict's entry carries the step causes' summary
    steps = by_id[VERDICT.id]["steps"]
    assert steps["source"] == judgement.steps.source and steps["causes"] == {"normal": 11, "stopped": 1}
    assert steps["median_s"] == pytest.approx(judgement.steps.median_s)
    # the readers of findings.json read it as before
    assert read_findings(run.path) == list(judgement.findings)


def test_stored_findings_are_completed_not_judged_again(run):
    """`diagnose report` re-judges stored findings through the one entry point: a list without a
    verdict gets the verdict analyzer's; the findings stay as they were; every step gets a cause."""
    judged = judge_run(run, [NOTE, GC, SYMPTOM])
    assert judged.findings[:3] == (NOTE, GC, SYMPTOM) and len(judged.findings) == 4
    assert judged.verdict is judged.findings[3] and judged.verdict.id == "verdict.cause"
    assert judged.verdict.evidence["top"] == GC.id
    assert judged.reading == (GC, SYMPTOM, NOTE)
    assert len(judged.steps.table) == 12 and set(judged.steps.table["cause"]) <= set(judged.causes)
