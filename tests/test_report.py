"""The HTML report, the terminal summary and the Perfetto export of a real tiny run: its data
matches the record, markup from the job is escaped everywhere, secrets stay out, the size stays
small, and the page renders in a real browser. The H200 run's report: test_report_h200.py; the
verdict: test_report_verdict.py."""

import gzip
import json
import os
import re
import shutil
import subprocess

import pytest
from report_helpers import PYTHON, ROOT, _chromium_check, diagnose

from traindx.analyzers.core.findings import Finding, Prescription
from traindx.derive.run import load_run
from traindx.judgement import judge_run
from traindx.report.data import build_report_data, build_summary
from traindx.report.html import write_report
from traindx.report.outputs import read_findings
from traindx.report.pyspy_view import FLAME_MIN_SHARE

ESCAPING_JOB = os.path.join(ROOT, "tests", "data", "report_escaping_job.py")
MARKUP = (
    "<script>window.__pwned=1</script>",
    "<img src=x onerror=window.__pwned=2>",
    "<b onmouseover=window.__pwned=3>worker</b>",
    "<script>document.title='pwned'</script>",
)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run, _ = diagnose(
        tmp_path_factory.mktemp("runs") / "tiny",
        PYTHON,
        "examples/train_tiny.py",
        "--steps",
        "6",
        options=("--dump-interval", "0.5", "--torch-profile", "3-4"),
    )
    return run


@pytest.fixture(scope="module")
def escaping_run(tmp_path_factory):
    # no torch.profiler window: this job is about strings, and the window's export is slow
    run, _ = diagnose(
        tmp_path_factory.mktemp("runs") / "markup",
        PYTHON,
        ESCAPING_JOB,
        "5",
        options=("--dump-interval", "0.5"),
        env={"TRAINDX_TORCH_PROFILE": "off"},
    )
    return run


def _jit_findings(run):
    """Findings shaped like the JIT analyzer's, built on this run's real steps (no JIT analyzer
    runs on a CPU job without FA4), so the ranking and the verdict have something to rank."""
    steps = [int(s) for s in run.steps["step"]]
    return [
        Finding(
            id="gc.gen2_in_steps",
            title="Generation-2 GC pauses inside steps",
            severity="low",
            analyzer="gc",
            seconds_lost_per_step=0.01,
            steps_affected=tuple(steps[:2]),
            prescriptions=(
                Prescription(
                    kind="code",
                    summary="call gc.freeze() after building the model",
                    change={
                        "code": {
                            "file": "train.py",
                            "line": 12,
                            "before": "model = build()",
                            "after": "model = build()\ngc.freeze()",
                        }
                    },
                ),
            ),
        ),
        Finding(
            id="jit.fa4_steady_recompile",
            title="FA4 recompiles its backward kernel every step",
            severity="high",
            analyzer="jit",
            seconds_lost_per_step=0.05,
            share_of_step=0.2,
            steps_affected=tuple(steps[1:]),
            summary="max_seqlen reaches the compile key as a tensor",
            evidence={
                "key_field": "single_q_block",
                "compiles": [{"step": s, "duration_s": 0.05} for s in steps],
            },
            prescriptions=(
                Prescription(
                    kind="upgrade",
                    summary="upgrade flash-attn-4 to 4.0.0b26 or newer",
                    change={"upgrade": {"package": "flash-attn-4", "min_version": "4.0.0b26"}},
                    expected_gain_s_per_step=0.05,
                ),
            ),
        ),
        Finding(id="evidence.note", title="a note", severity="info", analyzer="steps"),
    ]


# -- report data ---------------------------------------------------------------------------------
@pytest.mark.slow  # a real diagnose run (the module's tiny or markup run)
def test_a_cpu_job_records_no_gpu_time(tiny_run):
    """The shim's CPU path (issue 20 item 4, with test_gpu_view.py): a CPU job runs unchanged
    under the GPU-time bookkeeping, which records nothing and fails nothing, and no gpu_idle
    finding is made of it. (Was a diagnose run of train_tiny.py of its own in test_gpu_view.py.)"""
    assert len(tiny_run.steps) == 6
    assert not len(tiny_run.of_type("gpu_time")) and not len(tiny_run.of_type("shim_error"))
    # the findings diagnose wrote for it (findings.json)
    assert not [f for f in read_findings(tiny_run.path) if f.analyzer == "gpu_idle"]


@pytest.mark.slow  # a real diagnose run (the module's tiny or markup run)
def test_report_data_of_a_real_run_matches_its_record(tiny_run):
    findings = read_findings(tiny_run.path)
    data = build_report_data(tiny_run, judge_run(tiny_run, findings))
    steps = data["timeline"]["ranks"]["0"]
    recorded = tiny_run.rank_steps("0")
    assert [s["step"] for s in steps] == list(recorded["step"]) == list(range(6))
    assert [round(s["duration_s"], 9) for s in steps] == [round(d, 9) for d in recorded["duration_s"]]
    # steps lie inside the run, in order, each with a cause
    assert all(0 <= s["start_s"] < s["end_s"] <= data["timeline"]["end_s"] for s in steps)
    assert all(a["end_s"] <= b["start_s"] for a, b in zip(steps, steps[1:]))
    assert {s["cause"] for s in steps} <= set(data["causes"])
    slow = [s for s in steps if s["duration_s"] > data["stats"]["slow_threshold_s"]]
    assert [s["slow"] for s in steps] == [s in slow for s in steps]
    assert data["stats"]["steps"] == 6 and data["stats"]["ranks"] == 1
    assert data["stats"]["steady_median_s"] == pytest.approx(sorted(recorded["duration_s"][1:])[2])
    assert "examples/train_tiny.py" in data["run"]["command"]
    assert data["run"]["packages"]["torch"].startswith("2.")
    # this machine has no GPU: said so, with NVML's reason
    assert data["gpu"]["available"] is False and "NVML" in data["gpu"]["reason"]
    assert any(m["what"] == "nvml" for m in data["missing"])
    # py-spy: the main thread held the GIL, and the tree's weights add up
    gil = data["gil"][0]
    # (how much of the time it held it depends on how loaded the machine is: a share, not a threshold)
    top = gil["threads"][0]
    assert top["thread"].startswith("MainThread") and 0 < top["gil_share"] <= 1
    assert all(t["gil_s"] <= top["gil_s"] for t in gil["threads"])
    tree = gil["tree"]
    # threads under FLAME_MIN_SHARE of the samples are dropped, their weight kept in the root
    # (the shim's host sampler, once it sheds its rate, holds the GIL for a sample or two)
    shown = sum(c["value"] for c in tree["children"])
    dropped = len(gil["threads"]) - len(tree["children"])
    assert shown <= tree["value"] + 1e-9
    assert tree["value"] - shown <= dropped * FLAME_MIN_SHARE * tree["value"] + 1e-9
    assert data["lanes"]["threads"] and data["lanes"]["snapshots"] >= 3
    assert any("iteration" in line["text"] for line in data["log_tail"])
    json.dumps(data)  # plain data, ready for any renderer


@pytest.mark.slow  # a real diagnose run (the module's tiny or markup run)
def test_findings_ranked_by_seconds_lost_and_verdict_is_the_top_change(tiny_run):
    findings = _jit_findings(tiny_run)
    data = build_report_data(tiny_run, judge_run(tiny_run, findings))
    assert [f["id"] for f in data["findings"]] == [
        "jit.fa4_steady_recompile",
        "gc.gen2_in_steps",
        "evidence.note",
    ]
    v = data["verdict"]
    assert v["kind"] == "change" and v["headline"] == "upgrade flash-attn-4 to 4.0.0b26 or newer"
    assert v["gain_s"] == 0.05 and v["text"] == "pip install -U 'flash-attn-4>=4.0.0b26'"
    # savings are per mean step (ledger lines): the speed-up is against the mean steady step
    from traindx.derive.ledger import steady_rows

    mean = float(steady_rows(tiny_run).groupby("rank")["wall_s"].mean().max())
    if mean > 0.05:
        assert v["step_statistic"] == "mean" and v["median_step_s"] == pytest.approx(mean)
        assert v["speedup"] == pytest.approx(mean / (mean - 0.05))
    else:
        # a saving larger than the mean step (this machine ran the tiny job fast): against the
        # median step of the step table when it fits there (on a loaded machine its steady window
        # can hold slower steps than the ledger's), else no speed-up quoted
        assert v["step_statistic"] == "median"
        step = v["median_step_s"]
        assert v["speedup"] == (pytest.approx(step / (step - 0.05)) if step and step > 0.05 else None)
    # the terminal summary is built from the same data
    assert build_summary(tiny_run, judge_run(tiny_run, findings))["verdict"] == v


# -- escaping -------------------------------------------------------------------------------------
def _tags(html):
    from html.parser import HTMLParser

    class Collector(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tags = []

        def handle_starttag(self, tag, attrs):
            self.tags.append((tag, attrs))

    parser = Collector()
    parser.feed(html)
    return parser.tags


@pytest.mark.slow  # a real diagnose run (the module's tiny or markup run)
def test_markup_from_the_job_is_escaped_everywhere(escaping_run):
    run = escaping_run
    # the markup really is in the evidence: py-spy saw the frame and file, the log has the line
    frames = {f.name for ts in run.pyspy[("0", "gil")].values() for st in ts.stacks for f in st}
    assert MARKUP[0] in frames
    assert any(MARKUP[3] in t for t in run.log["text"])
    hot = next(f for f in frames if "<script>" in f)
    findings = [
        Finding(
            id="gil.helper_thread",
            title=f"{MARKUP[2]} holds the GIL in {hot}",
            severity="high",
            analyzer="gil",
            seconds_lost_per_step=0.2,
            summary=hot,
            evidence={"frame": hot, "stack": [{"name": hot, "file": MARKUP[1], "line": 1}]},
            prescriptions=(Prescription(kind="code", summary=f"stop {hot}", command=f"echo '{hot}'"),),
        )
    ]
    path = write_report(
        run,
        judge_run(run, findings),
        comparison={"verdict": MARKUP[0], "arms": {MARKUP[2]: {MARKUP[1]: MARKUP[3]}}},
    )
    html = open(path, encoding="utf-8").read()
    # exactly one script element: the report's own
    assert len(re.findall(r"<script\b", html, flags=re.I)) == 1
    for text in MARKUP:
        assert text not in html
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in html
    assert "&lt;img src=x onerror=window.__pwned=2&gt;" in html
    # parsed as a browser would: no element or event-handler attribute came from the job
    tags = _tags(html)
    assert [t for t, _ in tags if t == "script"] == ["script"] and not [t for t, _ in tags if t == "img"]
    assert not [(t, a) for t, attrs in tags for a, _ in attrs if a.startswith("on")]
    assert not [t for t, attrs in tags if t == "b" and attrs]
    _chromium_check(path, "report-escaping.png", expect_text=[MARKUP[0], MARKUP[3]])


@pytest.mark.slow  # a real diagnose run (the module's tiny or markup run)
def test_secrets_in_the_environment_stay_out(tiny_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run.path, run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["env"].update(
        {
            "HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz123456",
            "NCCL_DEBUG": "INFO",
            "AWS_SECRET_ACCESS_KEY": "abc",
            "TORCH_SECRET_TOKEN": "zz-do-not-show",
        }
    )
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    run = load_run(run_dir)
    html = open(write_report(run, judge_run(run, [])), encoding="utf-8").read()
    assert "NCCL_DEBUG" in html
    for secret in (
        "hf_abcdefghijklmnopqrstuvwxyz123456",
        "zz-do-not-show",
        "AWS_SECRET_ACCESS_KEY",
        "HF_TOKEN",
    ):
        assert secret not in html


# -- Perfetto, size, command ----------------------------------------------------------------------
@pytest.mark.slow  # a real diagnose run (the module's tiny or markup run)
def test_perfetto_export_holds_the_merged_timeline(tiny_run, tmp_path):
    out = tmp_path / "trace.json.gz"
    proc = subprocess.run(
        [
            PYTHON,
            "-m",
            "traindx",
            "report",
            tiny_run.path,
            "--quiet",
            "--perfetto",
            str(out),
            "-o",
            str(tmp_path / "r.html"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "r.html") and os.path.getsize(tmp_path / "r.html") > 10_000
    trace = json.load(gzip.open(out, "rt"))
    events = trace["traceEvents"]
    steps = [e for e in events if e.get("cat") == "step"]
    assert [e["name"] for e in steps] == [f"step {i}" for i in range(6)]
    duration_us = (tiny_run.manifest["end_ns"] - tiny_run.manifest["start_ns"]) / 1000
    assert all(e["ts"] >= 0 and e["ts"] + e["dur"] <= duration_us for e in steps)
    recorded = list(tiny_run.rank_steps("0")["duration_s"])
    assert [e["dur"] / 1e6 for e in steps] == pytest.approx(recorded)
    snapshots = [e for e in events if e.get("cat") == "py-spy"]
    assert snapshots and any(e["args"]["owns_gil"] for e in snapshots)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "optimizer steps" in names and "thread MainThread" in names
    # the torch.profiler window (asked for: on a CPU job it is off by default) lands on the same
    # clock: inside the run, and inside the recorded steps it profiled
    if os.path.exists(os.path.join(tiny_run.path, "trace", "0.json.gz")):
        torch_ops = [
            e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function")
        ]
        assert torch_ops
        first_step, last_end = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
        assert all(first_step <= e["ts"] <= last_end for e in torch_ops)


def test_report_command_errors_are_one_line(tmp_path):
    proc = subprocess.run(
        [PYTHON, "-m", "traindx", "report", str(tmp_path / "nope")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.strip().startswith("diagnose: error: no such run folder")
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # a real diagnose run (the module's tiny or markup run)
def test_a_ten_minute_run_renders_under_five_megabytes(tiny_run, tmp_path):
    """The tiny run's real evidence stretched to a 10-minute run: its steps repeated at 0.1 s
    per step (6000 steps), py-spy snapshots every 0.5 s, 12000 py-spy samples, and 8 GPUs of
    NVML rows every 0.5 s: the report stays under 5 MB."""
    run_dir = tmp_path / "long"
    shutil.copytree(tiny_run.path, run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    start = manifest["start_ns"]
    span = 600 * 10**9
    stem = f"p{manifest['ranks']['0']}"  # rank 0's files are named by its pid
    events = [
        json.loads(l) for l in (run_dir / "events" / f"{stem}.jsonl").read_text().splitlines() if l.strip()
    ]
    step_events = [e for e in events if e["type"] in ("step_begin", "step_end", "gc")]
    others = [e for e in events if e not in step_events]
    first = min(e["t"] for e in step_events)
    # 0.1 s per step whatever this machine's speed: 6000 steps, the worst case for the chart
    period = 6 * 10**8
    scale = period / (max(e["t"] for e in step_events) - first + 1)
    with open(run_dir / "events" / f"{stem}.jsonl", "w") as f:
        for e in others:
            f.write(json.dumps(e) + "\n")
        for k in range(span // period):
            for e in step_events:
                e2 = dict(e, t=first + k * period + int((e["t"] - first) * scale), step=e["step"] + k * 6)
                f.write(json.dumps(e2) + "\n")
    snaps = (run_dir / "pyspy" / f"{stem}-dump.jsonl").read_text().splitlines()
    with open(run_dir / "pyspy" / f"{stem}-dump.jsonl", "w") as f:
        for i in range(1200):  # one every 0.5 s
            snap = json.loads(snaps[i % len(snaps)])
            snap["t"] = start + i * 5 * 10**8
            f.write(json.dumps(snap) + "\n")
    for source in ("all", "gil"):
        p = run_dir / "pyspy" / f"{stem}-{source}.speedscope.json"
        doc = json.loads(p.read_text())
        for prof in doc["profiles"]:
            reps = max(1, 12000 // max(1, len(prof["samples"])))
            prof["samples"] = prof["samples"] * reps
            prof["weights"] = prof["weights"] * reps
        p.write_text(json.dumps(doc))
    with open(run_dir / "nvml.csv", "w") as f:
        f.write("t,gpu,util,mem_util,sm_clock_mhz,mem_used_bytes,power_w,clock_event_reasons\n")
        for i in range(1200):
            for g in range(8):
                f.write(
                    f"{start + i * 5 * 10**8},{g},{(i * 7 + g) % 100},{i % 50},{1500 + i % 300},{2**34},{300 + i % 400},{4 if i % 3 else 0}\n"
                )
    manifest["end_ns"] = start + span
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    run = load_run(run_dir)
    assert len(run.steps) >= 5000
    path = write_report(run, judge_run(run, _jit_findings(tiny_run)))
    size = os.path.getsize(path)
    assert size <= 5 * 2**20, f"{size / 2**20:.1f} MB"
    data = build_report_data(run, judge_run(run, []))
    assert data["gpu"]["available"] and len(data["gpu"]["series"]) == 8


@pytest.mark.slow
def test_report_in_chromium(tiny_run):
    findings = _jit_findings(tiny_run)
    comparison = {
        "verdict": "candidate 1.9× faster; loss parity holds",
        "arms": {"baseline": {"median_step_s": 0.52}, "candidate": {"median_step_s": 0.27}},
        "speedup": 1.93,
    }
    path = write_report(tiny_run, judge_run(tiny_run, findings), comparison=comparison)
    n_steps = len(tiny_run.steps)

    def checks(page):
        assert page.locator("#step-chart rect.step").count() == n_steps
        assert "upgrade flash-attn-4" in page.inner_text("#verdict")
        assert page.inner_text("#verdict-command") == "pip install -U 'flash-attn-4>=4.0.0b26'"
        ids = page.eval_on_selector_all("#findings .finding", "els => els.map(e => e.dataset.id)")
        assert ids == ["jit.fa4_steady_recompile", "gc.gen2_in_steps", "evidence.note"]
        assert page.locator("#gil svg g.frame").count() > 5
        assert page.locator("#lanes svg rect.seg").count() >= 1
        assert "No GPU metrics" in page.inner_text("#gpu")
        assert "1.9× faster" in page.inner_text("#comparison")
        assert page.locator("#findings .copyable button.copy").count() >= 2
        # the step chart is laid out at a readable size, by time or by step as the switch says
        page.click(".view-switch button[data-view=time]")
        box = page.locator("#step-chart").bounding_box()
        assert box["width"] > 800 and box["height"] > 150
        assert not page.locator("#step-chart-by-step").is_visible()
        page.click(".view-switch button[data-view=step]")
        assert (
            page.locator("#step-chart-by-step").is_visible() and not page.locator("#step-chart").is_visible()
        )
        assert page.locator("#step-chart-by-step rect.step").count() == n_steps

    _chromium_check(path, "report.png", checks=checks)


@pytest.mark.slow  # a real diagnose run (the module's tiny or markup run)
def test_report_command_shows_a_fix_comparison_from_the_run_folder(tiny_run, h200_run, tmp_path):
    """A --fix candidate folder holds comparison.json (recipes.ab.compare_runs); re-rendering it
    shows the arms side by side."""
    from traindx.recipes.ab import compare_runs

    run_dir = tmp_path / "candidate"
    shutil.copytree(tiny_run.path, run_dir)
    comparison = compare_runs(h200_run, load_run(run_dir))
    (run_dir / "comparison.json").write_text(json.dumps(comparison, default=str))
    proc = subprocess.run(
        [PYTHON, "-m", "traindx", "report", str(run_dir), "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    html = open(run_dir / "report.html", encoding="utf-8").read()
    section = html[html.index('id="comparison"') :]
    assert "Before and after" in html and "baseline" in section and "candidate" in section
    assert f"{comparison['speedup']:.2f}×" in section
    assert "loss parity" in section


@pytest.mark.slow  # a real diagnose run (the module's tiny or markup run)
def test_terminal_summary_says_what_the_html_verdict_says(tiny_run):
    import io

    from rich.console import Console

    from traindx.report.terminal import print_summary

    findings = _jit_findings(tiny_run)
    out = io.StringIO()
    print_summary(
        tiny_run, judge_run(tiny_run, findings), "report.html", console=Console(file=out, width=200)
    )
    text = out.getvalue()
    html = open(write_report(tiny_run, judge_run(tiny_run, findings)), encoding="utf-8").read()
    headline = build_summary(tiny_run, judge_run(tiny_run, findings))["verdict"]["headline"]
    assert f"Verdict: {headline}" in text and headline in html
    assert "pip install -U 'flash-attn-4>=4.0.0b26'" in text
    # the same ranking: the JIT finding before the GC one, the info finding as a note after the table
    assert text.index("FA4 recompiles") < text.index("Generation-2 GC") < text.index("note: a note")


@pytest.mark.slow  # a real diagnose run (the module's tiny or markup run)
def test_the_report_marks_what_fix_applies_and_what_are_alternatives(tiny_run):
    """--fix's planner (traindx.fixing.run.loop) decides; the report and the terminal mark each
    prescription as the one applied, an alternative, or by hand."""
    import io

    from rich.console import Console

    from traindx.report.terminal import print_summary

    steps = tuple(int(s) for s in tiny_run.steps["step"])
    threads = Finding(
        id="cpu.threads",
        title="Intra-op threads oversubscribe the cores",
        severity="medium",
        analyzer="cpu",
        seconds_lost_per_step=0.02,
        steps_affected=steps,
        prescriptions=(
            Prescription(
                kind="env",
                summary="set OMP_NUM_THREADS=1",
                automatic=True,
                change={"env": {"OMP_NUM_THREADS": "1"}},
                expected_gain_s_per_step=0.02,
            ),
            Prescription(
                kind="env",
                summary="set MKL_NUM_THREADS=1",
                automatic=True,
                change={"env": {"MKL_NUM_THREADS": "1"}},
                expected_gain_s_per_step=0.01,
            ),
            Prescription(kind="code", summary="call torch.set_num_threads(1) at start-up"),
        ),
    )
    data = build_report_data(tiny_run, judge_run(tiny_run, [threads]))
    marks = [p["fix"] for p in data["findings"][0]["prescriptions"]]
    # the loop measures OMP first, MKL next (within --fix-tries): the code line is by hand
    assert marks == ["applied", "next", "by_hand"]
    assert data["verdict"]["fix"] == "applied" and data["verdict"]["headline"] == "set OMP_NUM_THREADS=1"
    html = open(write_report(tiny_run, judge_run(tiny_run, [threads])), encoding="utf-8").read()
    assert html.count('data-fix="applied"') == 1 and html.count('data-fix="next"') == 1
    assert html.count('data-fix="by_hand"') == 1
    out = io.StringIO()
    print_summary(tiny_run, judge_run(tiny_run, [threads]), console=Console(file=out, width=80))
    text = out.getvalue()
    assert "1. the verdict above [--fix applies this]" in text
    assert "diagnose --fix applies this" in text and "+ 2 alternatives in the report" in text
