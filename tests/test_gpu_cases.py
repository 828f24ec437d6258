"""The GPU cases of bench/jobs/gpu_cases.py, recorded on an H200: each finding priced within 25 %
of what its fix measured, the healthy twins quiet, the launch-bound job's candidates and arms;
and the GPU view's rules on made-up numbers."""

import ast
import os
import warnings

import numpy as np
import pandas as pd
import pytest
from gpu_view_helpers import DATA, ROOT, load

import traindx
from traindx.profiler import gputime as derive

# -- the GPU cases of bench/jobs/gpu_cases.py, recorded on an H200: predicted vs measured ----------
# Run folders recorded on one H200 by bench/gpu_view.sh (each case and its --fixed twin, 40 steps,
# py-spy and the default torch.profiler window), trimmed by bench/gpu_view_fixture.py into
# tests/data/h200-gpu-view-cases.tar.xz (tests/data/h200-gpu-view-cases.README). The judge must
# price each case's cause within 25 % of what its fixed twin measured, at the right line, one
# cause one finding. Lines: bench/jobs/gpu_cases.py as it was recorded.
GPU_CASES_ARCHIVE = os.path.join(DATA, "h200-gpu-view-cases.tar.xz")
RECORDED_LINES = {"pageable_copy": 101, "empty_cache": 115, "item_check": 58, "cpu_batch": 65}
GOAL = 0.25


def _fixture_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gpu_view_fixture", os.path.join(ROOT, "bench", "gpu_view_fixture.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def h200_cases(tmp_path_factory):
    """{run name: (run, findings or None)}, analysed on first use."""
    root = tmp_path_factory.mktemp("h200-gpu-view-cases")
    _fixture_tool().extract(GPU_CASES_ARCHIVE, str(root))
    cache = {}

    def get(name, analyze=True):
        if name not in cache:
            cache[name] = [load(str(root / name)), None]
        if analyze and cache[name][1] is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cache[name][1] = traindx.analyze(cache[name][0])
        return cache[name]

    return get


def _measured(h200_cases, case):
    from traindx.analyzers.core import evidence as ev

    bad, _ = h200_cases(f"{case}-bad", analyze=False)
    fixed, _ = h200_cases(f"{case}-fixed", analyze=False)
    return ev.median_step_s(bad) - ev.median_step_s(fixed)


def _roots(findings):
    return [
        f
        for f in findings
        if f.cause is None and f.severity not in ("info",) and not f.id.startswith("verdict.")
    ]


def _priced(f):
    gains = [p.expected_gain_s_per_step for p in f.prescriptions if p.expected_gain_s_per_step is not None]
    return max(gains) if gains else f.seconds_lost_per_step


def _check_case(h200_cases, case, expected, price=None):
    """The case's top root is the expected finding, priced within GOAL of the measured saving
    (by its best prescription, or `price`); every other root on the bad run promises little
    beside it (no second finding of the same seconds)."""
    _, findings = h200_cases(f"{case}-bad")
    roots = _roots(findings)
    assert roots and roots[0].id.startswith(expected), [(f.id, f.title) for f in roots]
    top = roots[0]
    measured = _measured(h200_cases, case)
    priced = (price or _priced)(top)
    ratio = priced / measured
    assert abs(ratio - 1) <= GOAL, (case, ratio, priced, measured)
    others = sum(_priced(f) or 0.0 for f in roots[1:])
    assert others <= 0.75 * measured, [(f.id, _priced(f)) for f in roots[1:]]
    return top, findings


def test_h200_pageable_copy_priced_at_the_copy_line(h200_cases):
    top, findings = _check_case(h200_cases, "pageable", "gpu_idle.pageable_copy")
    assert top.evidence["line"] == RECORDED_LINES["pageable_copy"]
    assert top.evidence["file"].endswith("gpu_cases.py")
    # the host's view (host_work at the line) and the GPU's wait for it are the copy's symptoms
    at_line = [
        f
        for f in findings
        if f.id in ("host_work.code", "gpu_idle.host_starved")
        and f.evidence.get("line") == RECORDED_LINES["pageable_copy"]
    ]
    assert at_line and all(f.cause == "gpu_idle.pageable_copy" and not f.prescriptions for f in at_line)
    assert "pin_memory" in top.prescriptions[0].summary
    # the twin (pinned, non_blocking) reads the loss once per step: the GPU idles only while
    # the profiler closes its window after that read, which is no cost of the job's
    _, twin = h200_cases("pageable-fixed")
    assert not [f for f in twin if f.id == "sync.host_device" and f.severity != "info"]


def test_h200_empty_cache_priced_by_the_gpu_idle_in_the_allocator(h200_cases):
    top, findings = _check_case(h200_cases, "empty_cache", "alloc.empty_cache")
    assert top.evidence["cost_method"].startswith("cudaMalloc/cudaFree: the GPU's idle")
    # the host's time in the allocator is more than the step loses: part of it overlaps kernels
    assert top.evidence["malloc_free_s_per_step"] > top.seconds_lost_per_step
    first = top.prescriptions[0]
    assert first.change["code"]["line"] == RECORDED_LINES["empty_cache"]
    assert first.change["code"]["op"] == "delete"
    assert not [f for f in findings if f.id == "gpu.launch_bound"]


def test_h200_item_syncs_are_the_cause_not_launch_bound_kernels(h200_cases):
    top, findings = _check_case(h200_cases, "item_sync", "sync.host_device")
    site = top.evidence["call_sites"][0]
    assert (site["function"], site["line"], site["per_step"]) == ("forward", RECORDED_LINES["item_check"], 48)
    assert top.evidence["syncs_in_model_per_step"] == 48
    assert f"gpu_cases.py:{RECORDED_LINES['item_check']}" in top.prescriptions[-1].summary
    # tiny kernels between the syncs: a CUDA graph cannot capture a sync, so the syncs go first
    launch = [f for f in findings if f.id == "gpu.launch_bound"]
    assert launch and launch[0].cause == "sync.host_device" and not launch[0].prescriptions


@pytest.mark.slow  # ten runs re-analysed (~15 s on 2 busy cores)
def test_h200_every_case_within_25_percent_and_healthy_twins_quiet(h200_cases):
    top, _ = _check_case(h200_cases, "host_batch", "gpu_idle.host_starved")
    assert (top.evidence["function"], top.evidence["line"]) == ("cpu_batch", RECORDED_LINES["cpu_batch"])
    # the twin graphs the model AND steps a fused optimizer: both prescriptions, the whole loss
    top, _ = _check_case(
        h200_cases, "tiny_kernels", "gpu.launch_bound", price=lambda f: f.seconds_lost_per_step
    )
    # ...and its two prescriptions, priced by the ledger's optimizer and forward/backward spans,
    # add up to what the twin saved
    gains = [p.expected_gain_s_per_step for p in top.prescriptions[:2]]
    assert "fused=True" in top.prescriptions[0].summary
    assert abs(sum(gains) / _measured(h200_cases, "tiny_kernels") - 1) <= GOAL
    for case in ("pageable", "empty_cache", "item_sync"):
        _check_case(
            h200_cases,
            case,
            {"pageable": "gpu_idle.pageable_copy", "empty_cache": "alloc.", "item_sync": "sync.host_device"}[
                case
            ],
        )
    # the twins recorded in full: nothing above medium (the loss read once per step is the norm)
    for twin in ("pageable-fixed", "empty_cache-fixed"):
        _, findings = h200_cases(twin)
        loud = [f for f in _roots(findings) if f.severity in ("high", "critical")]
        assert not loud, [(f.id, f.title) for f in loud]


def test_h200_launch_bound_job_gets_a_fused_optimizer_and_a_compiled_model_as_candidates(
    h200_cases, tmp_path
):
    """The H200's launch-bound record (400 narrow layers, no torch.compile in the job, AdamW made
    with fused=False, which turns off the foreach default: a per-parameter loop of 6,432
    launches a step): --fix's candidates are the optimizer made fused at the call that makes it,
    the model compiled in CUDA-graph mode where the job makes it, and both in one arm first,
    each priced by the time ledger's optimizer and forward/backward spans (bench/jobs/gpu_cases.py as it is
    now; the analyzer's own prescriptions are prose)."""
    from traindx.fixing.plan import source as fix_source
    from traindx.fixing.plan.planner import candidate_plans

    run, findings = h200_cases("tiny_kernels-bad")
    finding = next(f for f in findings if f.id == "gpu.launch_bound")
    optimizer = finding.evidence["optimizer"]
    assert optimizer["class"] == "AdamW" and optimizer["launches_per_step"] == 6432
    assert 0.5 < optimizer["share_of_profiled_step"] < 0.65  # its range: 88 -> 210 ms of 210 ms
    cands, _ = candidate_plans(run.manifest["command"], findings, run.path, cwd=ROOT)
    launch = [c for c in cands if c.finding == "gpu.launch_bound"]
    assert len(launch) == 3 and cands[0] is launch[0], [(c.finding, c.summary) for c in cands]
    both, fused, graph = launch
    assert all(c.mechanism == "source" for c in launch)
    job = os.path.join(ROOT, "bench", "jobs", "gpu_cases.py")
    (opt_edit,) = fused.plan.source_edits
    assert opt_edit["file"] == job and opt_edit["after"].endswith("fused=True)")
    (compile_edit,) = graph.plan.source_edits
    assert compile_edit["after"].strip() == "model.compile(mode='reduce-overhead')"
    with open(job, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert lines[compile_edit["line"] - 1].strip().startswith("model = MLP(")
    assert lines[opt_edit["line"] - 1].strip().startswith("opt = torch.optim.AdamW(")
    assert sorted(e["line"] for e in both.plan.source_edits) == sorted(
        [compile_edit["line"], opt_edit["line"]]
    )
    assert fused.predicted_saving_s_per_step == optimizer["saving_s"]
    assert graph.predicted_saving_s_per_step == finding.evidence["cuda_graph_saving_s"]
    assert both.predicted_saving_s_per_step == pytest.approx(
        fused.predicted_saving_s_per_step + graph.predicted_saving_s_per_step, abs=1e-5
    )
    assert finding.evidence["priced_by"].startswith("the time ledger's")
    # each arm's predicted step is its own prescription's saving, not the finding's first one
    # (the finding names no ledger line; H200 session 30: every arm was priced as the graph)
    from traindx.analyzers.core.savings import predicted_step_time

    for cand in launch:
        pred = predicted_step_time(run, finding, gain=cand.predicted_saving_s_per_step)
        assert pred["removed_s"] == cand.predicted_saving_s_per_step
        assert pred["predicted_step_s"] >= pred.get("gpu_busy_floor_s", 0.0)
    # the arm of both edits is one patch that makes a job that parses and builds both
    text = fix_source.patched_text(job, both.plan.source_edits)
    ast.parse(text)
    assert "fused=True)" in text and "model.compile(mode='reduce-overhead')" in text


LAUNCH_ARMS_ARCHIVE = os.path.join(DATA, "h200-launch-bound-arms.tar.xz")


def test_h200_launch_bound_arms_each_within_25_percent_of_its_prediction(tmp_path):
    """H200 session 30, one call (tests/data/h200-launch-bound-arms.README): the launch-bound job
    (400 tiny layers, AdamW(fused=False)) and two arms run beside it, each one planner edit:
    `fused=True` at the optimizer's call, and the model compiled in CUDA-graph mode. Each
    prescription's saving (the ledger's optimizer and forward/backward spans) against the
    saving `diagnose compare` measures on the GPU's clock: fused 74.3 vs 74.1 ms, graph 54.1 vs
    57.6 ms (the window's share had priced the fused one at 54.5 ms: -26 %)."""
    from traindx.recipes.ab import compare_runs

    _fixture_tool().extract(LAUNCH_ARMS_ARCHIVE, str(tmp_path))
    base = load(str(tmp_path / "tiny_kernels-bad"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        finding = next(f for f in traindx.analyze(base) if f.id == "gpu.launch_bound")
    predicted = {
        "fused": finding.evidence["optimizer"]["saving_s"],
        "graph": finding.evidence["cuda_graph_saving_s"],
    }
    assert [p.expected_gain_s_per_step for p in finding.prescriptions[:2]] == [
        predicted["fused"],
        predicted["graph"],
    ]  # ranked by gain: the optimizer first
    for arm, saving in predicted.items():
        comparison = compare_runs(base, load(str(tmp_path / f"{arm}-fixed")))
        assert comparison["baseline"]["step_source"] == "shim:gpu"
        measured = comparison["baseline"]["mean_step_s"] - comparison["candidate"]["mean_step_s"]
        assert abs(saving / measured - 1) <= GOAL, (arm, saving, measured)
        assert comparison["speedup"] >= 1.5 and comparison["loss_parity"]["passed"]


# -- the rules, on made-up numbers -------------------------------------------------------------
def test_derive_a_measured_call_keeps_its_line_across_the_step_mark():
    """The shim marks the step boundary inside optimizer.step: the stretches between opt> and
    opt< are the optimizer's on both sides of it, not host work."""

    def marks(step):
        return (
            [
                ["step", 0, 0.0],
                ["bwd>", 1000, 1.0],
                ["bwd<", 2000, 2.0],
                ["opt>", 3000, 3.0],
                ["step", 4000, 4.0],
            ]
            if step == 0
            else [
                ["step", 4000, 0.0],
                ["opt<", 5000, 1.0],
                ["sync<", 6000, 2.0],
                ["bwd>", 7000, 3.0],
                ["bwd<", 8000, 4.0],
                ["opt>", 9000, 5.0],
                ["step", 10000, 6.0],
            ]
        )

    events = pd.DataFrame({"rank": ["0", "0"], "step": [0, 1], "marks": [marks(0), marks(1)]})
    rows = derive.stretches(events)
    lines = {(r["step"], r["from"], r["to"]): r["line"] for _, r in rows.iterrows()}
    assert lines[(0, "opt>", "step")] == "optimizer"
    assert lines[(1, "step", "opt<")] == "optimizer"
    assert lines[(1, "opt<", "sync<")] == "sync"
    assert lines[(1, "sync<", "bwd>")] == "host"
    assert lines[(0, "bwd>", "bwd<")] == "backward"


def test_window_idle_overlap_and_the_first_step_of_a_window():
    from traindx.analyzers.core import gpu_window as gw

    trace = pd.DataFrame(
        {"cat": ["kernel", "kernel", "gpu_memcpy"], "start_ns": [300, 600, 650], "end_ns": [500, 700, 900]}
    )
    idle = gw.idle_intervals(trace, 0, 1000)
    assert idle.tolist() == [[0, 300], [500, 600], [900, 1000]]
    # work queued before the profiler started is not recorded: the idle before the first
    # recorded work of a window's first step is unknown
    assert gw.idle_intervals(trace, 0, 1000, opens_window=True).tolist() == [[500, 600], [900, 1000]]
    calls = gw.merged([250, 550, 560], [350, 580, 590])
    assert gw.overlap_s(idle, calls) == pytest.approx((50 + 40) / 1e9)


def test_a_sync_statement_reaches_back_to_the_previous_measured_call():
    """The tensor ops before a host read, back to the model's last module call, are the read's
    statement; a module call, an own function or the previous sync bound it."""
    from traindx.analyzers.gpu import host_sync

    py = pd.DataFrame(
        [
            # name, start, end, id, parent
            ("model.py(10): forward", 0, 1000, 1, float("nan")),
            ("torch/nn/modules/module.py(1773): _wrapped_call_impl", 10, 100, 2, 1),
            ("<built-in function gelu>", 110, 150, 3, 1),
            ("<built-in method isfinite of type object>", 160, 300, 4, 1),
            ("<built-in method all of Tensor object>", 310, 400, 5, 1),
            ("<built-in method item of Tensor object>", 410, 500, 6, 1),
        ],
        columns=["name", "start_ns", "end_ns", "py_id", "py_parent"],
    )
    frames = host_sync._Frames(py)
    op_start = np.array([20, 115, 165, 315, 415], np.int64)
    op_end = np.array([90, 145, 295, 395, 495], np.int64)
    ops, site, in_model = host_sync._statement_ops(frames, op_start, op_end, 450, -1)
    assert site == ("model.py", 10, "forward") and not in_model
    assert [a for a, _ in ops] == [115, 165, 315, 415]  # not the module call's op
    # the previous sync bounds it: what ran after that one only
    ops, _, _ = host_sync._statement_ops(frames, op_start, op_end, 450, 305)
    assert [a for a, _ in ops] == [315, 415]
    ops, _, _ = host_sync._statement_ops(frames, op_start, op_end, 450, 405)
    assert [a for a, _ in ops] == [415]
    # torch.profiler's own sync (its window closing) is not the job's
    own = pd.concat(
        [py, pd.DataFrame([("torch/profiler/profiler.py(800): stop", 600, 700, 7, 1)], columns=py.columns)]
    )
    assert host_sync._statement_ops(host_sync._Frames(own), op_start, op_end, 650, -1)[0] is None


def test_chains_one_cause_one_finding_for_gpu_views():
    from traindx.analyzers.core import chains
    from traindx.analyzers.core.findings import Finding, Prescription

    def finding(id_, seconds, **evidence):
        return Finding(
            id=id_,
            title=id_,
            severity="high",
            analyzer=id_.split(".")[0],
            seconds_lost_per_step=seconds,
            ranks=("0",),
            evidence=evidence,
            prescriptions=(Prescription(kind="code", summary="x", expected_gain_s_per_step=seconds),),
        )

    sync = finding("sync.host_device", 0.01, syncs_in_model_per_step=48)
    launch = finding("gpu.launch_bound", 0.027)
    starved = finding("gpu_idle.host_starved", 0.17, file="/job/train.py", line=65, function="make_batch")
    host = finding("host_work.code", 0.12, file="train.py", line=66, function="make_batch")
    other = finding("host_work.code", 0.02, file="train.py", line=90, function="log")
    linked = {
        f.title + str(f.evidence.get("line")): f for f in chains.link([sync, launch, starved, host, other])
    }
    assert linked["gpu.launch_boundNone"].cause == "sync.host_device"
    assert linked["host_work.code66"].cause == "gpu_idle.host_starved"
    assert linked["host_work.code90"].cause is None
    # syncs outside the model (the loss read once per step) leave launch-bound a cause of its own
    quiet = finding("sync.host_device", 0.01, syncs_in_model_per_step=0)
    assert chains.link([quiet, launch])[1].cause is None
