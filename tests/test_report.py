"""The report: its data for real runs, escaping of the job's strings, the Perfetto export, the
`diagnose report` command, and the page itself opened in a real headless Chromium."""

import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

import pytest

from traindx.analyzers.findings import Finding, Prescription
from traindx.cli.outputs import read_findings
from traindx.derive.run import load_run
from traindx.report.data import build_report_data, build_summary, comparison_view, prescription_text
from traindx.report.html import write_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
ARTIFACTS = os.path.join(ROOT, "test-artifacts")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ESCAPING_JOB = os.path.join(ROOT, "tests", "data", "report_escaping_job.py")
MARKUP = (
    "<script>window.__pwned=1</script>",
    "<img src=x onerror=window.__pwned=2>",
    "<b onmouseover=window.__pwned=3>worker</b>",
    "<script>document.title='pwned'</script>",
)


def diagnose(run_dir, *job, options=(), env=None):
    cmd = [PYTHON, "-m", "traindx", "--quiet", "--run-dir", str(run_dir), *options, "--", *job]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env={**os.environ, **(env or {})}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_run(run_dir), proc


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
def test_report_data_of_a_real_run_matches_its_record(tiny_run):
    findings = read_findings(tiny_run.path)
    data = build_report_data(tiny_run, findings)
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
    assert tree["value"] == pytest.approx(sum(c["value"] for c in tree["children"]))
    assert data["lanes"]["threads"] and data["lanes"]["snapshots"] >= 3
    assert any("iteration" in line["text"] for line in data["log_tail"])
    json.dumps(data)  # plain data, ready for any renderer


def test_findings_ranked_by_seconds_lost_and_verdict_is_the_top_change(tiny_run):
    findings = _jit_findings(tiny_run)
    data = build_report_data(tiny_run, findings)
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
    assert build_summary(tiny_run, findings)["verdict"] == v


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
        run, findings, comparison={"verdict": MARKUP[0], "arms": {MARKUP[2]: {MARKUP[1]: MARKUP[3]}}}
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
    html = open(write_report(load_run(run_dir), []), encoding="utf-8").read()
    assert "NCCL_DEBUG" in html
    for secret in (
        "hf_abcdefghijklmnopqrstuvwxyz123456",
        "zz-do-not-show",
        "AWS_SECRET_ACCESS_KEY",
        "HF_TOKEN",
    ):
        assert secret not in html


# -- Perfetto, size, command ----------------------------------------------------------------------
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
    path = write_report(run, _jit_findings(tiny_run))
    size = os.path.getsize(path)
    assert size <= 5 * 2**20, f"{size / 2**20:.1f} MB"
    data = build_report_data(run, [])
    assert data["gpu"]["available"] and len(data["gpu"]["series"]) == 8


# -- a real browser -------------------------------------------------------------------------------
def _chromium_check(path, screenshot, expect_text=(), checks=None):
    """Open the report in headless Chromium: no console errors, the page's script ran, the key
    elements are drawn; keeps a full-page screenshot under test-artifacts/."""
    if not CHROMIUM:
        pytest.skip("chromium is not installed (.ci/run installs Debian's chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (the dev extra) drives Chromium")
    os.makedirs(ARTIFACTS, exist_ok=True)
    problems = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on(
                "console", lambda m: m.type in ("error", "warning") and problems.append(f"{m.type}: {m.text}")
            )
            page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
            page.on("dialog", lambda d: (problems.append(f"dialog: {d.message}"), d.dismiss()))
            requests = []
            page.on("request", lambda r: r.url.startswith("file://") or requests.append(r.url))
            page.goto("file://" + os.path.abspath(path))
            page.wait_for_selector("html[data-ready='1']", timeout=10_000)
            assert page.evaluate("window.__pwned") is None
            assert page.title() != "pwned" and page.title().startswith("traindx")
            assert page.inner_text("#verdict-headline").strip()
            assert page.locator("#step-chart rect.step").count() >= 1
            body = page.inner_text("body")
            for text in expect_text:
                assert text in body
            if checks:
                checks(page)
            page.screenshot(path=os.path.join(ARTIFACTS, screenshot), full_page=True)
        finally:
            browser.close()
    assert not problems, problems
    assert not requests, f"the report reached for the network: {requests}"


@pytest.mark.slow
def test_report_in_chromium(tiny_run):
    findings = _jit_findings(tiny_run)
    comparison = {
        "verdict": "candidate 1.9× faster; loss parity holds",
        "arms": {"baseline": {"median_step_s": 0.52}, "candidate": {"median_step_s": 0.27}},
        "speedup": 1.93,
    }
    path = write_report(tiny_run, findings, comparison=comparison)
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


# -- a real GPU run: the seed case recorded on an H200 (tests/data/h200-seed-b17-tensor) ----------
H200_RUN = os.path.join(ROOT, "tests", "data", "h200-seed-b17-tensor")


@pytest.fixture(scope="module")
def h200_run(tmp_path_factory):
    if not os.path.isdir(H200_RUN):
        pytest.skip("the H200 run record is not in tests/data")
    dest = tmp_path_factory.mktemp("h200") / "run"
    shutil.copytree(H200_RUN, dest)
    return load_run(dest)


def test_report_data_of_the_h200_seed_run(h200_run):
    from traindx.analyzers import analyze

    data = build_report_data(h200_run, analyze(h200_run))
    # the verdict is the JIT analyzer's fix, and its gain is nearly the whole step
    v = data["verdict"]
    assert v["kind"] == "change" and "max_seqlen" in v["headline"]
    assert v["gain_s"] > 0.5 * data["stats"]["steady_median_s"]
    # every step after the first is mostly a compile of the same backward kernel
    steps = data["timeline"]["ranks"]["0"]
    assert all(s["cause"] == "compile" for s in steps[1:])
    recompiles = [c for c in data["compiles"] if "_flash_attn_bwd" in c["kernel"] and not c["first"]]
    assert recompiles and all(c["key_diff"] for c in recompiles)
    assert any("tensor" in d["after"] for c in recompiles for d in c["key_diff"])
    # the GPU sat idle while the steps compiled; the GIL holder is the autograd thread, named
    assert data["gpu"]["available"] and data["stats"]["gpu_util_in_steps"] < 20
    assert {"util", "sm_clock_mhz", "power_w"} <= set(data["gpu"]["series"][0]["metrics"])
    top = data["gil"][0]["threads"][0]
    assert top["thread"].startswith("Dummy-1") and top["gil_share"] > 0.5
    kinds = {n["kind"] for n in data["gil"][0]["hottest"]}
    assert "library" in kinds and "user" not in {data["gil"][0]["hottest"][-1]["kind"]}


@pytest.mark.slow
def test_h200_report_in_chromium(h200_run):
    from traindx.analyzers import analyze

    path = write_report(h200_run, analyze(h200_run))

    def checks(page):
        assert page.locator("#gpu svg.gpu-chart").count() == 3
        assert page.locator("#gpu svg.gpu-chart polyline").count() == 3
        assert "max_seqlen" in page.inner_text("#verdict-headline")
        assert page.locator("#findings table.compiles tr").count() > 5
        assert "Dummy-1" in page.inner_text("#lanes")
        # a click on the main thread's frame in the icicle widens it to the full width
        main = page.locator('#gil svg.icicle g.frame[data-d="1"][data-name^="MainThread"]').first
        before = float(main.locator("rect").get_attribute("width"))
        main.click()
        assert before < 600 < float(main.locator("rect").get_attribute("width"))
        page.locator('#gil svg.icicle g.frame[data-d="0"]').first.click()
        assert float(main.locator("rect").get_attribute("width")) == pytest.approx(before, abs=0.01)

    _chromium_check(path, "report-h200-seed.png", checks=checks)


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


def test_terminal_summary_says_what_the_html_verdict_says(tiny_run):
    import io

    from rich.console import Console

    from traindx.report.terminal import print_summary

    findings = _jit_findings(tiny_run)
    out = io.StringIO()
    print_summary(tiny_run, findings, "report.html", console=Console(file=out, width=200))
    text = out.getvalue()
    html = open(write_report(tiny_run, findings), encoding="utf-8").read()
    headline = build_summary(tiny_run, findings)["verdict"]["headline"]
    assert f"Verdict: {headline}" in text and headline in html
    assert "pip install -U 'flash-attn-4>=4.0.0b26'" in text
    # the same ranking: the JIT finding before the GC one, the info finding as a note after the table
    assert text.index("FA4 recompiles") < text.index("Generation-2 GC") < text.index("note: a note")


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
    data = build_report_data(load_run(tmp_path / "r"), [])
    assert data["verdict"]["kind"] == "nosteps" and data["run"]["exit_code"] == 3
    html = (tmp_path / "r" / "report.html").read_text()
    assert "exited with code 3" in html and "&lt;i&gt;loading&lt;/i&gt;" in html


def test_perfetto_export_of_the_h200_run_has_compiles_on_their_thread_and_gpu_counters(h200_run, tmp_path):
    from traindx.report.perfetto import export_trace

    trace = json.load(open(export_trace(h200_run, str(tmp_path / "t.json"))))
    events = trace["traceEvents"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    compiles = [e for e in events if str(e.get("cat", "")).startswith("compile")]
    assert len(compiles) == len(h200_run.compiles)
    backward = [e for e in compiles if "_flash_attn_bwd" in e["name"]]
    assert backward and {tracks[(e["pid"], e["tid"])] for e in backward} == {"thread Dummy-1"}
    # each compile sits inside the run, and the recompiles inside their steps
    steps = {e["args"]["step"]: e for e in events if e.get("cat") == "step"}
    for e in backward:
        step = steps[e["args"]["step"]]
        assert step["ts"] - 1e3 <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1e3
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert {"GPU 0 util %", "GPU 0 SM clock MHz", "GPU 0 power W"} <= counters


# -- the FA4 seed example on the CPU (real flash_attn.cute compiling in fake mode) -----------------
def _have_fa4():
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("flash_attn", "cutlass"))


@pytest.mark.fa4
@pytest.mark.skipif(not _have_fa4(), reason="flash-attn-4 / nvidia-cutlass-dsl not installed")
@pytest.mark.slow
def test_report_of_the_fa4_seed_cold_start(tmp_path):
    run, _ = diagnose(
        tmp_path / "seed",
        PYTHON,
        "examples/fa4_seed.py",
        "--steps",
        "2",
        env={"TRAINDX_TORCH_PROFILE": "off"},
    )
    from traindx.analyzers import analyze

    findings = analyze(run)
    data = build_report_data(run, findings)
    first = data["timeline"]["ranks"]["0"][0]
    assert first["cause"] == "compile" and first["compile_s"] > 0.5 * first["duration_s"]
    kernels = {c["kernel"].split(":")[0] for c in data["compiles"]}
    assert {"_flash_attn_fwd", "_flash_attn_bwd"} <= kernels
    assert all(c["first"] and c["step"] == 0 for c in data["compiles"])
    backward = next(c for c in data["compiles"] if c["kernel"].startswith("_flash_attn_bwd"))
    assert backward["is_main_thread"] is False and backward["call_site"].endswith(")")
    # the lanes draw the autograd thread that compiles (whether one of py-spy's 2 s snapshots
    # falls inside its compile depends on timing: not asserted)
    lanes = {t["name"]: t for t in data["lanes"]["threads"]}
    assert backward["thread"] in lanes
    assert any(c["thread"] == backward["thread"] for c in data["lanes"]["compiles"])
    path = write_report(run, findings)

    def checks(page):
        assert page.locator("#step-chart rect.compile-mark").count() == len(data["compiles"])
        assert page.locator("#lanes svg rect.lane-compile").count() >= 1
        assert "_flash_attn_bwd" in page.inner_text("#compiles")

    _chromium_check(path, "report-fa4-seed.png", checks=checks)


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


def test_time_in_events_no_analyzer_named_is_a_finding_the_verdict_points_at(h200_run):
    """Steps that are mostly compiles, with no specialised finding (here: the JIT analyzer's left
    out), still get a finding of the judge layer, and the verdict names it (no report-made
    headline that findings.json never sees)."""
    from traindx.analyzers import step_causes, verdict

    found = step_causes.analyze(h200_run, [])
    assert [f.id for f in found] == ["steps.time_in_events"]
    f = found[0]
    assert f.evidence["kind"] == "compile" and f.severity in ("medium", "high")
    assert f.evidence["steps"] >= len(h200_run.steps) - 2 and f.share_of_step >= 0.1
    v = verdict.judge(h200_run, found)
    assert v.id == "verdict.cause" and v.evidence["top"] == "steps.time_in_events"
    data = build_summary(h200_run, found + [v])
    assert data["verdict"]["kind"] == "problem" and data["verdict"]["headline"] == f.title
    # an analyzer's root finding claims the time: no second finding for it
    assert (
        step_causes.analyze(h200_run, [Finding(id="jit.x", title="t", severity="high", analyzer="jit")]) == []
    )


def test_the_report_marks_what_fix_applies_and_what_are_alternatives(tiny_run):
    """--fix's planner (traindx.cli.fixloop) decides; the report and the terminal mark each
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
    data = build_report_data(tiny_run, [threads])
    marks = [p["fix"] for p in data["findings"][0]["prescriptions"]]
    # the loop measures OMP first, MKL next (within --fix-tries): the code line is by hand
    assert marks == ["applied", "next", "by_hand"]
    assert data["verdict"]["fix"] == "applied" and data["verdict"]["headline"] == "set OMP_NUM_THREADS=1"
    html = open(write_report(tiny_run, [threads]), encoding="utf-8").read()
    assert html.count('data-fix="applied"') == 1 and html.count('data-fix="next"') == 1
    assert html.count('data-fix="by_hand"') == 1
    out = io.StringIO()
    print_summary(tiny_run, [threads], console=Console(file=out, width=80))
    text = out.getvalue()
    assert "1. the verdict above [--fix applies this]" in text
    assert "diagnose --fix applies this" in text and "+ 2 alternatives in the report" in text


def test_one_number_per_quantity_across_terminal_and_report(h200_run):
    """The GIL share the report's table shows is the GIL finding's own; start-up is one value
    in the terminal, the numbers and the step chart; compile counts say what they count."""
    import io

    from rich.console import Console

    from traindx.analyzers import analyze
    from traindx.common.units import fmt_s
    from traindx.report.html import render_html
    from traindx.report.terminal import print_summary

    findings = analyze(h200_run)
    data = build_report_data(h200_run, findings)
    gil = next(f for f in findings if f.id == "gil.contention")
    row = next(t for t in data["gil"][0]["threads"] if t["thread"].startswith(gil.evidence["thread"]))
    assert row["gil_share"] == pytest.approx(gil.evidence["gil_share"], abs=0.001)
    startup = data["ledger"]["startup"]["wall_s"]
    assert data["stats"]["startup_s"] == startup
    out = io.StringIO()
    print_summary(h200_run, findings, console=Console(file=out, width=80))
    html = render_html(data)
    assert f"start-up {fmt_s(startup)}" in html and f"start-up {fmt_s(startup)[:-2]}" in out.getvalue()
    n = data["timeline"]["cause_counts"].get("compile")
    assert n and f"JIT compile ({n} steps)" in html
    assert f"{data['stats']['compiles']} JIT compiles" in out.getvalue()
