"""The verdict, a finding of the judge layer rendered the same in the terminal and the page, and
the report's parts that need no run: prescriptions as copyable commands and diffs, a comparison
with whatever keys it has, a job that fails before any step."""

import os
import re
import statistics
import subprocess

import pytest
from report_helpers import CHROMIUM, PYTHON, ROOT, _chromium_check

from traindx.analyzers.core.findings import Prescription
from traindx.derive.run import load_run
from traindx.judgement import judge_run
from traindx.report.data import build_report_data, comparison_view, prescription_text
from traindx.report.outputs import read_findings


def test_prescriptions_become_copyable_commands_and_diffs():
    env = Prescription(
        kind="env", summary="s", change={"env": {"FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1"}}
    )
    assert prescription_text(env) == ("export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1", "command")
    code = Prescription(
        kind="code",
        summary="s",
        change={"code": {"file": "a.py", "line": 3, "before": "x = t.max()", "after": "x = int(t.max())"}},
    )
    text, kind = prescription_text(code)
    assert kind == "diff" and "-x = t.max()" in text.splitlines() and "+x = int(t.max())" in text.splitlines()
    pre = Prescription(kind="precompile", summary="s", change={"precompile": {"from_run": "runs/x y"}})
    assert prescription_text(pre)[0] == "kernel-cache warm --from-run 'runs/x y'"
    given = Prescription(kind="arg", summary="s", command="swift sft --attn_impl flash_attn")
    assert prescription_text(given) == ("swift sft --attn_impl flash_attn", "command")


def test_comparison_renders_whatever_keys_are_present():
    view = comparison_view(
        {
            "verdict": "1.9× faster, loss parity holds",
            "arms": {
                "baseline": {"median_step_s": 0.52, "tokens_per_s": 1969.0},
                "candidate": {"median_step_s": 0.27, "cv": 0.03},
            },
            "speedup": 1.93,
            "speedup_ci": [1.81, 2.05],
            "loss_parity": {"pearson": 0.998, "passed": True},
        }
    )
    assert view["arms"] == ["baseline", "candidate"]
    rows = {r["label"]: r["values"] for r in view["rows"]}
    assert rows == {"median step s": ["0.52", "0.27"], "tokens per s": ["1969", ""], "cv": ["", "0.03"]}
    facts = {f["label"]: f for f in view["facts"]}
    assert facts["speedup ci"]["value"] == "[1.81, 2.05]"
    assert ["passed", "yes"] in facts["loss parity"]["pairs"]
    assert comparison_view(None) is None


def test_a_job_that_fails_before_any_step_gets_an_honest_report(tmp_path):
    proc = subprocess.run(
        [
            PYTHON,
            "-m",
            "traindx",
            "--quiet",
            "--no-pyspy",
            "--run-dir",
            str(tmp_path / "r"),
            "--",
            PYTHON,
            "-c",
            "print('<i>loading</i>'); raise SystemExit(3)",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3
    assert "No training steps were recorded" in proc.stderr
    run = load_run(tmp_path / "r")
    data = build_report_data(run, judge_run(run, []))
    assert data["verdict"]["kind"] == "nosteps" and data["run"]["exit_code"] == 3
    html = (tmp_path / "r" / "report.html").read_text()
    assert "exited with code 3" in html and "&lt;i&gt;loading&lt;/i&gt;" in html


# -- the verdict: a finding of the judge layer, rendered the same in the terminal and the page ----
def _diagnose_to_log(run_dir, *job):
    """diagnose as a user runs it with its output going to a log file (a pipe, not a terminal)
    at 80 columns; returns the run and the summary it printed."""
    cmd = [PYTHON, "-m", "traindx", "--run-dir", str(run_dir), "--", *job]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "80", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_run(run_dir), proc.stderr[proc.stderr.index("─ traindx ─") :]


def _verdict_of(run):
    verdicts = [f for f in read_findings(run.path) if f.id.startswith("verdict.")]
    assert len(verdicts) == 1, [f.id for f in verdicts]
    return verdicts[0]


def _page_headline(path, screenshot):
    seen = {}

    def checks(page):
        seen["headline"] = page.inner_text("#verdict-headline").strip()
        seen["verdict"] = page.inner_text("#verdict")

    _chromium_check(path, screenshot, checks=checks)
    return seen


@pytest.mark.slow
def test_a_healthy_run_says_it_is_healthy(tmp_path):
    run, summary = _diagnose_to_log(tmp_path / "healthy", PYTHON, "examples/train_tiny.py", "--steps", "10")
    findings = read_findings(run.path)
    assert [f.id for f in findings if f.severity != "info"] == []
    v = _verdict_of(run)
    durations = run.steps["duration_s"].tolist()
    assert v.id == "verdict.healthy" and v.evidence["steps"] == 10
    assert v.evidence["median_step_s"] == pytest.approx(statistics.median(durations[1:]))
    assert "healthy" in v.title.lower() and "10 steps" in v.title
    # the terminal and the page print the finding's title; neither says there were no steps
    assert v.title in summary and "No training steps" not in summary
    seen = _page_headline(os.path.join(run.path, "report.html"), "report-healthy.png")
    assert seen["headline"] == v.title and "No training steps" not in seen["verdict"]
    assert "10 steps" in seen["verdict"]


@pytest.mark.slow
def test_a_slow_run_names_its_top_root_finding(tmp_path):
    run, summary = _diagnose_to_log(
        tmp_path / "slow", PYTHON, "examples/pathologies.py", "--pathology", "dataloader", "--steps", "12"
    )
    findings = read_findings(run.path)
    v = _verdict_of(run)
    top = next(f for f in findings if f.id == v.evidence["top"])
    assert v.id == "verdict.cause" and top.id == "dataloader.starvation" and top.cause is None
    # the headline is the top root's first prescription, its seconds and title travel with it
    assert v.title == top.prescriptions[0].summary
    assert v.evidence["top_title"] == top.title
    assert v.evidence["seconds_per_step"] == top.seconds_lost_per_step
    assert "Verdict:" in summary and "No training steps" not in summary
    flat = " ".join(summary.split())
    assert f"Verdict: {v.title}" in flat and f"why: {top.title}" in flat
    seen = _page_headline(os.path.join(run.path, "report.html"), "report-slow.png")
    assert seen["headline"] == v.title and top.title in seen["verdict"]
    assert "No training steps" not in seen["verdict"]
    # a saving well under the time the cause costs says why, beside both numbers (workers that
    # share the step's cores; the load decides how far under)
    # (tests/test_savings_split.py checks when the pricing writes it)
    limit = v.evidence.get("saving_limit")
    assert limit is None or (
        v.evidence["gain_s"] < top.seconds_lost_per_step and limit == top.evidence["saving_limit"]
    ), v.evidence
    if limit:
        assert "worker processes" in limit
        assert "this cause costs" in flat and " ".join(limit.split()) in flat
        assert " ".join(limit.split()) in " ".join(seen["verdict"].split())
    _assert_readable_at_80_columns(summary, top)


def _code_spans(text):
    """The calls of a sentence, outermost: 'DataLoader(a=1, b=2)' (a name, then its brackets)."""
    spans, pos = [], 0
    while True:
        m = re.compile(r"[\w.]+\(").search(text, pos)
        if not m:
            return spans
        depth, i = 0, m.end() - 1
        for i in range(m.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 0:
                break
        spans.append(text[m.start() : i + 1])
        pos = i + 1


def _assert_readable_at_80_columns(summary, top):
    """What a person reads in a log file of an 80-column job: code whole, prescriptions under
    the table, every number with its label."""
    lines = summary.splitlines()
    p = top.prescriptions[0]
    # code in the verdict is never wrapped mid-expression: each bracketed call sits on one line
    calls = [c for c in _code_spans(p.summary) if len(c) < 76]
    assert calls, p.summary
    for call in calls:
        assert any(call in line for line in lines), (call, summary)
    # the diff of the prescription: every line whole
    code = (p.change or {}).get("code") or {}
    for line in str(code.get("after", "")).splitlines():
        assert any(f"+{line}" in out for out in lines), (line, summary)
    # the table has no prescription column cut with an ellipsis; the prescriptions come under it
    table_end = max(i for i, line in enumerate(lines) if line.startswith("└"))
    assert not any("…" in line for line in lines[: table_end + 1]), summary
    assert "first prescription" not in summary
    assert any(line.startswith("1. ") for line in lines[table_end + 1 :]), summary
    # one labelled statistic per quantity: the step time's median, the ledger's mean
    stats = " ".join(lines[1:3])
    assert re.search(r"step time median [\d.]+ m?s", stats), stats
    assert any(re.match(r"mean step [\d.]+ s = ", line) for line in lines), summary
    assert not any(re.match(r"step [\d.]+ s = ", line) for line in lines), summary
    # a number never leaves its label: wraps fall between ' · ' parts
    for line in lines:
        assert not re.match(r"^\s*[\d.]+ m?s\b", line), (line, summary)


def test_a_run_without_steps_gets_the_no_steps_verdict(tmp_path):
    proc = subprocess.run(
        [
            PYTHON,
            "-m",
            "traindx",
            "--no-pyspy",
            "--run-dir",
            str(tmp_path / "r"),
            "--",
            PYTHON,
            "-c",
            "import sys; print('loading'); sys.exit(4)",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert proc.returncode == 4
    run = load_run(tmp_path / "r")
    v = _verdict_of(run)
    assert v.id == "verdict.no_steps" and v.evidence["steps"] == 0 and v.evidence["exit_code"] == 4
    assert v.title in proc.stderr and "Healthy" not in proc.stderr
    if CHROMIUM:  # a page without steps draws no step chart: read the headline from the HTML
        html = open(os.path.join(run.path, "report.html"), encoding="utf-8").read()
        assert f'id="verdict-headline">{v.title}<' in html and "exited with code 4" in html
