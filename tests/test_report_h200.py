"""The report of a real GPU run (the seed case recorded on an H200, tests/data/h200-seed-b17-tensor);
the FA4 seed example's cold start on the CPU: test_fix.py's test_report_of_the_cold_start_baseline."""

import json

import pytest
from report_helpers import _chromium_check

from traindx.analyzers.core.findings import Finding
from traindx.judgement import judge_run
from traindx.report.data import build_report_data, build_summary
from traindx.report.html import write_report


def test_report_data_of_the_h200_seed_run(h200_run):
    data = build_report_data(h200_run, judge_run(h200_run))
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
    path = write_report(h200_run, judge_run(h200_run))

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


# (the report of the FA4 seed example's cold start on the CPU, real flash_attn.cute compiling in
# fake mode: test_fix.py's test_report_of_the_cold_start_baseline, over the baseline arm of its
# cold-start --fix run, which made the same cold run a second time here)


def test_time_in_events_no_analyzer_named_is_a_finding_the_verdict_points_at(h200_run):
    """Steps that are mostly compiles, with no specialised finding (here: the JIT analyzer's left
    out), still get a finding of the judge layer, and the verdict names it (no report-made
    headline that findings.json never sees)."""
    from traindx.analyzers.core import step_causes, verdict

    found = step_causes.analyze(h200_run, [])
    assert [f.id for f in found] == ["steps.time_in_events"]
    f = found[0]
    assert f.evidence["kind"] == "compile" and f.severity in ("medium", "high")
    assert f.evidence["steps"] >= len(h200_run.steps) - 2 and f.share_of_step >= 0.1
    v = verdict.judge(h200_run, found)
    assert v.id == "verdict.cause" and v.evidence["top"] == "steps.time_in_events"
    data = build_summary(h200_run, judge_run(h200_run, found + [v]))
    assert data["verdict"]["kind"] == "problem" and data["verdict"]["headline"] == f.title
    # an analyzer's root finding claims the time: no second finding for it
    assert (
        step_causes.analyze(h200_run, [Finding(id="jit.x", title="t", severity="high", analyzer="jit")]) == []
    )


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
    data = build_report_data(h200_run, judge_run(h200_run, findings))
    gil = next(f for f in findings if f.id == "gil.contention")
    row = next(t for t in data["gil"][0]["threads"] if t["thread"].startswith(gil.evidence["thread"]))
    assert row["gil_share"] == pytest.approx(gil.evidence["gil_share"], abs=0.001)
    startup = data["ledger"]["startup"]["wall_s"]
    assert data["stats"]["startup_s"] == startup
    out = io.StringIO()
    print_summary(h200_run, judge_run(h200_run, findings), console=Console(file=out, width=80))
    html = render_html(data)
    assert f"start-up {fmt_s(startup)}" in html and f"start-up {fmt_s(startup)[:-2]}" in out.getvalue()
    n = data["timeline"]["cause_counts"].get("compile")
    assert n and f"JIT compile ({n} steps)" in html
    assert f"{data['stats']['compiles']} JIT compiles" in out.getvalue()
