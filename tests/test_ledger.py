"""The time ledger on real jobs under `diagnose`: every step's wall time split into measured
categories that sum to it exactly; known injected costs land in their category; start-up is its
own row; predictions of a fix from the record. The same findings and severities with two
CPU-burning processes beside the job, chains and the residual: test_ledger_load.py."""

import json
import os
import sys

import pandas as pd
import pytest
from ledger_helpers import CATEGORY_COLUMNS, JOBS, _assert_sums_exactly, _run

import traindx
from traindx.analyzers.core import savings as S
from traindx.analyzers.core.findings import Finding
from traindx.derive import ledger as L


@pytest.fixture(scope="module")
def getitem_run(tmp_path_factory):
    # 8 samples x 4 ms of busy pure Python in __getitem__: at least 32 ms of data wait per step
    return _run(
        tmp_path_factory.mktemp("getitem"),
        "slow_getitem.py",
        "--steps",
        "12",
        "--item-ms",
        "4",
        "--batch",
        "8",
    )


@pytest.mark.slow  # a real diagnose run (the module's getitem run)
def test_ledger_sums_to_wall_time_and_busy_getitem_is_data(getitem_run):
    run, proc = getitem_run
    led = run.ledger
    assert list(led.columns) == L.COLUMNS
    assert sorted(led["step"]) == list(range(12))
    _assert_sums_exactly(led)
    steady = L.steady_rows(run)
    data = steady["data_s"]
    # __getitem__ busy-waits on the wall clock: the wait cannot be shorter than 8 x 4 ms, and
    # on an idle-enough machine it is not much longer; it is the largest line of the step
    assert data.median() >= 0.9 * 0.032, steady
    assert (
        steady["data_s"] >= steady[[c for c in CATEGORY_COLUMNS if c != "data_s"]].max(axis=1)
    ).mean() > 0.7
    # forward/backward and the optimizer step are measured too; nothing compiles on this job
    assert steady["forward_backward_s"].sum() > 0 and steady["optimizer_s"].sum() > 0
    assert led["compile_s"].sum() == 0 and led["io_s"].sum() == 0
    # ledger.csv beside findings.json: start-up first, then one row per step
    csv = pd.read_csv(os.path.join(run.path, "ledger.csv"))
    assert list(csv["phase"]) == ["startup"] + ["step"] * 12
    assert list(csv["step"]) == [-1] + list(range(12))
    # and the terminal's one-line breakdown
    assert "step " in proc.stderr and " = data " in proc.stderr and "unexplained" in proc.stderr
    assert "start-up " in proc.stderr and "imports, model build, data set-up" in proc.stderr
    # the report draws it: a stacked bar per step with the data line in it, and the run total
    with open(os.path.join(run.path, "report.html"), encoding="utf-8") as f:
        html = f.read()
    assert 'id="ledger"' in html and 'id="ledger-line"' in html and 'id="ledger-startup"' in html
    assert html.count('data-cat="data"') >= 12 + 1


@pytest.mark.slow  # a real diagnose run (the module's getitem run)
def test_startup_is_its_own_row(getitem_run):
    run, _ = getitem_run
    start = run.startup_ledger
    assert len(start) == 1 and int(start["step"].iloc[0]) == L.STARTUP_STEP
    _assert_sums_exactly(start)
    first = run.ledger.sort_values("step").iloc[0]
    assert int(start["end_ns"].iloc[0]) == int(first["start_ns"])
    # importing torch and building the model take time before the first step: not step 0's
    assert start["wall_s"].iloc[0] > 0.2
    # the first batch fetch begins step 0 (its wrapper starts a few µs before the boundary; a
    # preemption there can stretch those to ms on a loaded machine, never to a fetch)
    assert start["data_s"].iloc[0] < 0.5 * first["data_s"] and start["optimizer_s"].iloc[0] == 0


@pytest.mark.slow
def test_torch_save_is_io_in_the_steps_that_save_with_its_line(tmp_path):
    run, proc = _run(tmp_path, "checkpoint_every.py", "--steps", "16", "--save-every", "4")
    led = run.ledger.set_index("step")
    _assert_sums_exactly(run.ledger)
    # the job saves after the optimizer step of steps 3, 7, 11 and 15: inside steps 4, 8 and 12
    # (the step boundary is the optimizer step); the save after step 15 ends the job
    saving = set(led.index[led["io_s"] > 0])
    assert saving == {4, 8, 12}, led["io_s"]
    spans = run.spans[run.spans["cat"] == "io"]
    assert len(spans) >= 4 and set(spans["call"]) == {"torch.save"}
    caller = spans["caller"].iloc[0]
    with open(os.path.join(JOBS, "checkpoint_every.py")) as f:
        line = next(i for i, text in enumerate(f, 1) if "torch.save(" in text)
    assert caller["file"].endswith("checkpoint_every.py") and caller["line"] == line
    # the periodic finding names the call, its line and the period; its saving is the io line
    found = [f for f in traindx.analyze(run) if f.id == "steps.periodic_slow"]
    assert len(found) == 1, [(f.id, f.title) for f in traindx.analyze(run)]
    f = found[0]
    assert f.evidence["period"] == 4 and f.cause is None
    assert f"torch.save at {caller['file']}:{line}" in f.summary
    assert f"torch.save at {caller['file']}:{line} runs every 4 steps" in f.prescriptions[0].summary
    assert f.removes == {"categories": ["io"]}
    steady = L.steady_rows(run)
    # ... plus what the saves cost the saving and next steps beyond their own span
    after = S.io_after_effect(steady)
    assert after is not None and after >= 0
    assert f.prescriptions[0].expected_gain_s_per_step == pytest.approx(steady["io_s"].mean() + after)
    assert f"checkpoint_every.py:{line}" in proc.stderr


def test_a_save_period_is_found_when_the_warm_up_rule_took_half_the_run():
    """The same job recorded beside other tests (tests/data/cpu-checkpoint-load-fell.README):
    the load fell mid-run, the warm-up rule took steps 0-7 and left two of the three saves in
    the steady window. The shim-timed writes still show the period over the steps after step
    0: the finding names torch.save, its line and period 4, not an unexplained variation."""
    from traindx.derive.run import load_run

    run = load_run(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "cpu-checkpoint-load-fell"),
        cache=False,
    )
    found = {f.id: f for f in traindx.analyze(run)}
    f = found.get("steps.periodic_slow")
    assert f is not None, [(x.id, x.severity, x.title) for x in found.values()]
    assert f.evidence["period"] == 4 and f.severity == "high"
    assert "torch.save at " in f.summary and "checkpoint_every.py:49" in f.summary
    assert set(f.evidence.get("slow_steps") or f.steps_affected) <= {4, 8, 12}
    assert "steps.instability" not in found or found["steps.instability"].severity == "info"


# -- the sweep itself ----------------------------------------------------------------------------
def _table(rows, columns):
    return pd.DataFrame(rows, columns=columns)


def test_priority_sweep_counts_each_nanosecond_once():
    """Two steps; a compile on the autograd thread inside the main thread's backward counts as
    compile; a GC inside a data wait counts once, as GC; a data wait of another thread does not
    count. A run recorded before forward spans: the forward is the stretch from the data wait's
    end to the backward; the training thread's untimed rest is host time."""
    steps = _table(
        [("0", 0, 1000, 2000, 1e-6), ("0", 1, 2000, 3000, 1e-6)],
        ["rank", "step", "start_ns", "end_ns", "duration_s"],
    )
    spans = _table(
        [
            ("0", "data", 1000, 1300, 1, None, None),
            ("0", "gc", 1100, 1200, 1, None, None),
            ("0", "backward", 1500, 1900, 1, None, None),
            ("0", "optimizer", 1900, 1950, 1, None, None),
            ("0", "data", 2000, 2900, 2, None, None),  # another thread: not the training loop
            ("0", "optimizer", 2950, 3010, 1, None, None),  # crosses the step end: clipped
        ],
        ["rank", "cat", "start_ns", "end_ns", "tid", "caller", "call"],
    )
    compiles = _table([("0", "cute_dsl", 1600, 1700)], ["rank", "kind", "start_ns", "end_ns"])
    events = _table([("0", "process_start", 400)], ["rank", "type", "t"])
    led, start = L.compute(steps, spans, compiles, events)
    s0 = led.set_index("step").loc[0]
    ns = {c: round(s0[f"{c}_s"] * 1e9) for c in L.CATEGORIES + ("unexplained",)}
    assert ns["data"] == 200 and ns["gc"] == 100 and ns["compile"] == 100
    assert ns["forward_backward"] == 200 + 300  # forward 1300..1500, backward minus the compile
    assert ns["optimizer"] == 50 and ns["host"] == 50 and ns["unexplained"] == 0
    s1 = led.set_index("step").loc[1]
    assert round(s1["data_s"] * 1e9) == 0 and round(s1["optimizer_s"] * 1e9) == 50
    assert round(s1["host_s"] * 1e9) == 950 and s1["unexplained_s"] == 0
    assert len(start) == 1 and round(start["wall_s"].iloc[0] * 1e9) == 600
    _assert_sums_exactly(led)


def test_measured_forward_closures_and_host_are_booked_where_they_run():
    """With forward spans: fwd/bwd is forward + backward only; what the training thread does
    between its measured calls is host; a forward and backward inside an optimizer step's
    closure (Lightning) are fwd/bwd, the closure's rest host, the step's own rest optimizer;
    a rank whose training thread no span shows is unexplained."""
    steps = _table(
        [("0", 0, 1000, 2000, 1e-6), ("0", 1, 2000, 3000, 1e-6), ("1", 0, 1000, 2000, 1e-6)],
        ["rank", "step", "start_ns", "end_ns", "duration_s"],
    )
    spans = _table(
        [
            ("0", "data", 1000, 1100, 1, None, None),
            ("0", "forward", 1200, 1400, 1, None, None),
            ("0", "backward", 1500, 1700, 1, None, None),
            ("0", "optimizer", 1700, 1800, 1, None, None),
            ("0", "data", 2000, 2100, 1, None, None),
            ("0", "optimizer", 2100, 2900, 1, None, None),
            ("0", "closure", 2150, 2850, 1, None, None),
            ("0", "forward", 2200, 2400, 1, None, None),
            ("0", "backward", 2500, 2800, 1, None, None),
        ],
        ["rank", "cat", "start_ns", "end_ns", "tid", "caller", "call"],
    )
    led, _ = L.compute(
        steps, spans, pd.DataFrame(columns=["rank", "kind", "start_ns", "end_ns"]), pd.DataFrame()
    )
    ns = {
        (r.rank, r.step): {c: round(getattr(r, f"{c}_s") * 1e9) for c in L.CATEGORIES + ("unexplained",)}
        for r in led.itertuples()
    }
    assert ns[("0", 0)] == dict(
        ns[("0", 0)], data=100, forward_backward=400, optimizer=100, host=400, unexplained=0
    )
    assert ns[("0", 1)] == dict(
        ns[("0", 1)], data=100, forward_backward=500, optimizer=100, host=300, unexplained=0
    )
    assert ns[("1", 0)]["unexplained"] == 1000 and ns[("1", 0)]["host"] == 0
    _assert_sums_exactly(led)


def test_ledger_of_many_ranks_sums_exactly():
    """16 ranks x 500 steps x 3 spans: every row sums to its step. The cost at scale (64 ranks x
    2,000 steps, once asserted < 30 s here) is measured by bench/analysis_speed.py, out of the
    suite: a wall-clock bound is one another job's load can move."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(JOBS)), "bench"))
    from analysis_speed import ledger_tables

    n_ranks, n_steps = 16, 500
    steps, spans = ledger_tables(n_ranks, n_steps)
    led, _ = L.compute(
        steps, spans, pd.DataFrame(columns=["rank", "kind", "start_ns", "end_ns"]), pd.DataFrame()
    )
    assert len(led) == n_ranks * n_steps
    _assert_sums_exactly(led)


# -- predictions --------------------------------------------------------------------------------
def _steady_data_cpu(run, steady, field="cpu"):
    """The training thread's CPU seconds (or run-queue wait: field="runq") inside
    DataLoader.__next__ per steady step, straight from the shim's data spans."""
    ev = run.events
    spans = ev[(ev["type"] == "span") & (ev["cat"] == "data")]
    total = 0.0
    for row in steady.itertuples():
        inside = spans[(spans["start"] >= row.start_ns) & (spans["start"] < row.end_ns)]
        total += float(inside[field].sum())
    return total / len(steady)


@pytest.mark.slow  # a real diagnose run (the module's getitem run)
def test_shim_records_cpu_evidence_per_step(getitem_run):
    run, _ = getitem_run
    steady = L.steady_rows(run)
    cpu = run.events[run.events["type"] == "cpu"]
    assert set(steady["step"].astype(int)) <= set(cpu["step"].astype(int))
    # busy pure Python in __getitem__ on the training thread: its CPU seconds are in the data
    # spans, never more than their wall time; the process has at least the thread's CPU
    data_cpu = _steady_data_cpu(run, steady)
    assert 0 < data_cpu <= steady["data_s"].mean() + 1e-3
    assert (cpu["proc_cpu_s"] + 1e-3 >= cpu["thread_cpu_s"]).all()
    # the machine is read at most every 100 ms: the steps with a reading carry it, spanning the
    # steps since the last one (sys_span_s)
    read = cpu[cpu["running"].notna()]
    assert len(read) and (read["running"] >= 1).all()  # the training thread that reads it is running
    assert (read["sys_idle_s"] <= read["sys_total_s"]).all() and (read["sys_span_s"] > 0).all()
    assert int(cpu["cores"].dropna().iloc[0]) == len(os.sched_getaffinity(0))
    evd = L.cpu_evidence(run)
    assert evd["data_cpu"] == pytest.approx(data_cpu)
    assert evd["proc_cpu"] == pytest.approx(cpu[cpu["step"].isin(steady["step"])]["proc_cpu_s"].mean())


def test_workers_step_model_documented_cases():
    # 30 ms of loading CPU per batch, 6 ms of single-threaded compute, 2 workers, 2 idle cores:
    # the training process is busy 12/30 of the time, so each task gets 2 / (0.4 + 2) = 0.83 of
    # a core and the workers make a batch every 30 / (2 x 0.83) = 18 ms (was 36 ms)
    assert S.workers_step_model(0.030, 0.006, 0.006, 2, 2, 0) == pytest.approx(0.018, rel=1e-3)
    # two CPU burners beside it: 2 / (2 + 0.4 + 2) = 0.45 of a core each: 33 ms
    assert S.workers_step_model(0.030, 0.006, 0.006, 2, 2, 2) == pytest.approx(0.033, rel=1e-3)
    # the compute stage is the slower one: it sets the step, at its own 20 ms (the workers,
    # busy a tenth of the time, leave it a whole core); a burner beside it takes a share of it
    assert S.workers_step_model(0.004, 0.020, 0.020, 2, 2, 0) == pytest.approx(0.020, rel=1e-3)
    assert S.workers_step_model(0.004, 0.020, 0.020, 2, 2, 2) == pytest.approx(0.020 * 3.2 / 2, rel=1e-3)
    # a job held to the one core it had gains nothing; with both cores it is bounded by all its
    # CPU work over them, and never faster than one core per worker
    assert S.workers_step_capped(0.030, 0.006, 0.006, 2, 1.0) == pytest.approx(0.036)
    assert S.workers_step_capped(0.030, 0.006, 0.006, 2, 2.0) == pytest.approx(0.018)
    assert S.workers_step_capped(0.030, 0.006, 0.006, 1, 2.0) == pytest.approx(0.030)


@pytest.mark.slow  # a real diagnose run (the module's getitem run)
def test_predicted_step_time_of_the_workers_fix_comes_from_the_cpu_evidence(getitem_run):
    run, _ = getitem_run
    found = [f for f in traindx.analyze(run) if f.id == "dataloader.starvation"]
    assert len(found) == 1
    f = found[0]
    workers, cpus = f.removes["workers"], f.removes["cpus"]
    assert f.removes == {"categories": ["data"], "workers": workers, "cpus": cpus}
    assert workers >= 2 and cpus == run.manifest["host"]["cpus"]
    pred = S.predicted_step_time(run, f)
    steady = L.steady_rows(run)
    assert pred["baseline_step_s"] == pytest.approx(steady["wall_s"].mean())
    # the documented model on the recorded evidence, recomputed here from the raw events
    cpu = run.events[run.events["type"] == "cpu"]
    cpu = cpu[cpu["step"].isin(steady["step"])]
    wall, data = steady["wall_s"].mean(), steady["data_s"].mean()
    data_cpu = _steady_data_cpu(run, steady)
    data_runq = _steady_data_cpu(run, steady, "runq")
    proc, thread = cpu["proc_cpu_s"].mean(), cpu["thread_cpu_s"].mean()
    thread_runq = cpu["thread_runq_s"].mean()
    cores = len(os.sched_getaffinity(0))
    # busy-waiting in __getitem__: the data line is CPU work or a wait for a core, hardly any
    # of it off the CPU
    load_wait = max(0.0, data - data_cpu - data_runq)
    assert load_wait <= 0.25 * data + 2e-3
    # the run-queue clock and the span's wall clock are read a few µs apart: the runnable part
    # never exceeds the span
    data_runq = min(data_runq, data - data_cpu)
    share = thread / (thread + thread_runq)
    own = 1 + max(0.0, proc - thread) / wall
    others = min(max(0.0, cores / share - own), max(0.0, cpu["running"].mean() - own))
    rest_cpu, rest_wall = proc - data_cpu, wall - data
    a = max(1.0, rest_cpu / rest_wall)
    rest_wait = max(0.0, rest_wall - rest_cpu / a - max(0.0, thread_runq - data_runq))
    # the per-task reading: the measured stage times, grown by the contention the workers add
    per_task = S.workers_step_measured(
        load_wait, data_cpu + data_runq, rest_wait, rest_wall - rest_wait, workers, cores, others, threads=own
    )
    # the per-group reading: the job held to the share its thread got (or the CPU it used)
    # plus the idle cores
    # idle cores as a rate: each /proc/stat reading states the wall seconds it spans (a shed
    # shim reads it every 10th step)
    read = cpu.dropna(subset=["sys_idle_s", "sys_span_s"]) if "sys_span_s" in cpu else cpu.iloc[:0]
    idle = (
        read["sys_idle_s"].sum() / read["sys_span_s"].sum() if len(read) else cpu["sys_idle_s"].mean() / wall
    )
    held = min(cores, max(proc / wall, share) + idle)
    per_group = S.workers_step_capped(
        data_cpu, rest_cpu, rest_wall, workers, held, load_wait=load_wait, rest_wait=rest_wait
    )
    low, high = min(per_task, per_group), max(per_task, per_group)
    assert pred["predicted_range_s"] == pytest.approx([low, high], rel=1e-6)
    # the point: the middle of the range for a loader that computes, towards the per-task
    # reading by the data line's off-CPU share
    point = per_task + (1 - load_wait / data) / 2 * (per_group - per_task)
    assert pred["predicted_step_s"] == pytest.approx(point, rel=1e-6)
    assert pred["removed_s"] == pytest.approx(pred["baseline_step_s"] - point, rel=1e-6)
    assert low <= pred["predicted_step_s"] <= high
    assert "CPU model" in pred["method"]
    # the finding shows the loading CPU the workers would take over
    assert f.evidence["cpu_in_dataloader_per_step_s"] == pytest.approx(data_cpu, abs=1e-4)
    # the prescription promises exactly what the model says the fix removes; on a machine
    # loaded enough that workers would find no free core the model prices it at a loss, and a
    # loss is never promised (chains.without_losing_prescriptions)
    promised = f.prescriptions[0].expected_gain_s_per_step
    if pred["removed_s"] > 0:
        assert promised == pytest.approx(pred["removed_s"])
    else:
        assert promised is None and "no gain expected" in f.prescriptions[0].summary
        assert f.evidence["unpriced"][0]["expected_gain_s_per_step"] == pytest.approx(pred["removed_s"])


@pytest.mark.slow  # a real diagnose run (the module's getitem run)
def test_workers_prediction_of_a_run_without_cpu_evidence(getitem_run, tmp_path):
    """A run recorded by an older shim (no `cpu` events, no CPU on the data spans) keeps the
    overlap bound: what stays is max(0, data / min(N, cpus - 1) - rest), and the step cannot
    shrink below all its CPU work spread over the cores."""
    import shutil

    run, _ = getitem_run
    old = tmp_path / "old-run"
    shutil.copytree(run.path, old)
    for name in os.listdir(old / "events"):
        path = old / "events" / name
        kept = []
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event.get("type") == "cpu":
                continue
            event.pop("cpu", None)
            kept.append(json.dumps(event))
        path.write_text("\n".join(kept) + "\n")
    run = traindx.load_run(str(old))
    assert L.cpu_evidence(run) is None
    f = [f for f in traindx.analyze(run) if f.id == "dataloader.starvation"][0]
    workers, cpus = f.removes["workers"], f.removes["cpus"]
    pred = S.predicted_step_time(run, f)
    steady = L.steady_rows(run)
    rest = steady["wall_s"] - steady["data_s"]
    left = (steady["data_s"] / min(workers, max(1, cpus - 1)) - rest).clip(lower=0)
    removed = (steady["data_s"] - left).clip(upper=steady["wall_s"] * (1 - 1 / cpus))
    assert pred["removed_s"] == pytest.approx(removed.mean())
    assert 0 < pred["removed_s"] <= steady["data_s"].mean()
    assert "predicted_range_s" not in pred


def test_findings_json_of_older_runs_still_loads():
    old = {
        "id": "gc.gen2_in_step",
        "title": "t",
        "severity": "low",
        "analyzer": "gc_pauses",
        "prescriptions": [],
        "steps_affected": [3],
        "ranks": ["0"],
    }
    f = Finding.from_dict(old)
    assert f.cause is None and f.symptoms == () and f.removes == {}
    assert Finding.from_dict(f.to_dict()) == f
