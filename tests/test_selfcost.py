"""What traindx costs the job, stated by every run (issue 47): the shim's own accounting (its
wrappers, its step-end work, its threads), the work it sheds above its budget, the ledger's
`traindx` line (never the job's host work), and the statement a run folder makes of itself.
Built in code: no timing is asserted, only where measured nanoseconds are booked."""

import json
import os
import sys

import numpy as np
import pandas as pd
import pytest

import traindx
from traindx.analyzers import analyze
from traindx.derive import ledger as L
from traindx.derive.selfcost import cost_line, self_cost

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiler", "shim")
)
from _traindx_shim import selfcost  # noqa: E402


@pytest.fixture
def shim_cost(monkeypatch):
    """selfcost with fresh state; its events collected instead of written."""
    emitted = []
    monkeypatch.setattr(selfcost, "emit", lambda type_, **f: emitted.append((type_, f)))
    monkeypatch.setattr(selfcost, "_pending", {})
    monkeypatch.setattr(selfcost, "_parts", {})
    fresh = dict(selfcost._state, carry_ns=0, purpose_ns=0, threads_cpu=None, window_cost=0, window_wall=0)
    fresh.update(window_steps=0, level=0, steps=0, wall_ns=0, shim_ns=0, threads_ns=0, judged=True)
    monkeypatch.setattr(selfcost, "_state", fresh)
    monkeypatch.setattr(selfcost, "shed_state", {"sample_scale": 1.0, "data_runq": True, "stat_every": 1})
    monkeypatch.setattr(selfcost, "BUDGET_PCT", 1.0)
    return emitted


def test_a_step_states_its_wrappers_and_the_previous_step_ends_work(shim_cost):
    """The wrappers' own time and the previous step end's work (it ran inside this step) are the
    step's shim_ns; what was spent on purpose (a profiler export, a memory hunt) is not."""
    selfcost.add("data", 3_000)
    selfcost.add("forward", 2_000)
    selfcost.add("forward", -5)  # a clock step back is no negative cost
    selfcost.step_end_work(50_000, {"step.cpu": 40_000, "step.begin": 30_000}, purpose_ns=30_000)
    fields = selfcost.step_fields(7, 10_000_000)
    assert fields["shim_ns"] == 3_000 + 2_000 + 20_000
    assert fields["shim_end_ns"] == 20_000 and fields["shim_purpose_ns"] == 30_000
    assert fields["shim_threads_cpu_s"] == 0  # the first reading: no interval yet
    again = selfcost.step_fields(8, 10_000_000)
    assert again["shim_ns"] == 0 and "shim_purpose_ns" not in again  # booked once
    selfcost.summary()
    kind, summary = shim_cost[-1]
    assert kind == "self_cost" and summary["steps"] == 2 and summary["shim_ns"] == 25_000
    assert summary["parts"]["wrap.forward"] == 2_000 and summary["parts"]["step.cpu"] == 40_000


def test_the_summarys_parts_are_its_judged_steps(shim_cost):
    """Start-up steps' work (the thread census at steps 0-1, the first device reads) stays out of
    the parts, as out of `steps`: parts over steps is a steady step's cost."""
    selfcost.add("forward", 9_000)
    selfcost.step_fields(1, 10_000_000)  # step 1 ends: a start-up step
    selfcost.step_end_work(3_000_000, {"step.cpu": 3_000_000})
    selfcost.add("forward", 2_000)
    selfcost.step_fields(5, 10_000_000)  # the first judged step
    selfcost.step_end_work(50_000, {"step.cpu": 40_000})
    selfcost.summary()
    summary = shim_cost[-1][1]
    assert summary["steps"] == 1 and summary["parts"] == {"wrap.forward": 2_000, "step.cpu": 40_000}


def test_a_step_end_preempted_by_other_work_counts_only_its_own_cpu(shim_cost):
    """A step end that took 900 µs of wall on a loaded machine but 60 µs of the thread's CPU:
    the step states 60 µs (the job waited for a core meanwhile, as it would without the shim);
    its CPU never counts above its wall less what was on purpose."""
    selfcost.step_end_work(900_000, {"step.cpu": 850_000}, cpu_ns=60_000)
    assert selfcost.step_fields(7, 10_000_000)["shim_end_ns"] == 60_000
    selfcost.step_end_work(500_000, {"step.begin": 400_000}, purpose_ns=400_000, cpu_ns=480_000)
    fields = selfcost.step_fields(8, 10_000_000)
    assert fields["shim_end_ns"] == 100_000 and fields["shim_purpose_ns"] == 400_000
    selfcost.summary()
    assert shim_cost[-1][1]["end_clock"] == "thread"


def test_over_its_budget_the_shim_sheds_work_and_says_so(shim_cost):
    """1 ms of its own in each 10 ms step (11 % > the 1 % budget): after a window of steps the
    host sampler halves its rate, then the data spans' run-queue reads go and the machine's
    /proc/stat is read every STAT_EVERY steps, then the sampler's floor; each level is one
    `shed` event. Under the budget nothing is shed."""
    for step in range(selfcost.FIRST_JUDGED_STEP, selfcost.FIRST_JUDGED_STEP + selfcost.WINDOW):
        selfcost.step_end_work(10_000, {})  # 0.1 % of the step: under the budget
        selfcost.step_fields(step, 10_000_000)
    assert not [e for e in shim_cost if e[0] == "shed"] and selfcost.shed_state["sample_scale"] == 1.0
    first = selfcost.FIRST_JUDGED_STEP + selfcost.WINDOW
    for step in range(first, first + 4 * selfcost.WINDOW):
        selfcost.step_end_work(1_000_000, {})
        selfcost.step_fields(step, 10_000_000)
    sheds = [f for kind, f in shim_cost if kind == "shed"]
    assert [s["level"] for s in sheds] == [1, 2, 3]  # three levels, then it stays
    assert sheds[0]["cost_pct"] > 1.0 and sheds[0]["budget_pct"] == 1.0
    assert selfcost.shed_state == {"sample_scale": 0.0, "data_runq": False, "stat_every": selfcost.STAT_EVERY}


def _table(rows, cols):
    return pd.DataFrame(rows, columns=cols)


def test_the_ledger_books_traindx_own_time_as_its_line_never_as_host_work():
    """A step of 1000 ns: data 0-200, a `traindx` span (the shim's step-end work) 200-300,
    backward 400-800, optimizer 800-900; the cpu event says the wrappers took 50 ns more (its
    shim_ns less the step end's work): traindx's line is 150 ns, host 350 - 50 = 250 ns, and the
    row still sums to the step's wall time."""
    steps = _table([("0", 0, 0, 1000, 1e-6)], ["rank", "step", "start_ns", "end_ns", "duration_s"])
    spans = _table(
        [
            ("0", "data", 0, 200, 1, None, None),
            ("0", "traindx", 200, 300, 1, None, None),
            ("0", "forward", 300, 400, 1, None, None),
            ("0", "backward", 400, 800, 1, None, None),
            ("0", "optimizer", 800, 900, 1, None, None),
        ],
        ["rank", "cat", "start_ns", "end_ns", "tid", "caller", "call"],
    )
    compiles = _table([], ["rank", "kind", "start_ns", "end_ns"])
    events = _table([], ["rank", "type", "t"])
    cpu = _table([("0", 0, 150, 100)], ["rank", "step", "shim_ns", "shim_end_ns"])
    led, _ = L.compute(steps, spans, compiles, events, cpu=cpu)
    row = led.iloc[0]
    ns = {c: round(row[f"{c}_s"] * 1e9) for c in L.CATEGORIES + ("unexplained",)}
    assert ns["traindx"] == 100 + 50 and ns["host"] == 100 - 50
    assert ns["data"] == 200 and ns["forward_backward"] == 500 and ns["optimizer"] == 100
    assert sum(ns.values()) == 1000
    without, _ = L.compute(steps, spans, compiles, events)  # a run without the shim's own accounting
    assert round(without.iloc[0]["traindx_s"] * 1e9) == 100 and round(without.iloc[0]["host_s"] * 1e9) == 100


def _write_run(
    path, steps=40, step_ns=10_000_000, shim_ns=50_000, helpers=None, runq_s=0.0, idle_s=0.0, cpu_of=None
):
    """A run folder as diagnose writes it: the manifest (with the helpers' CPU) and one process's
    events: steps of step_ns, each with the shim's own cost in its `cpu` event (cpu_of(step):
    fields that replace a step's), the machine idle idle_s core-seconds a step."""
    os.makedirs(path / "events")
    pid, t0 = 4242, 1_700_000_000_000_000_000
    ev = [{"type": "process_start", "pid": pid, "rank": "0", "t": t0 - 1_000_000}]
    ev.append({"type": "training", "evidence": "optimizer", "rank": "0", "t": t0 - 500_000})
    for s in range(steps):
        begin, end = t0 + s * step_ns, t0 + (s + 1) * step_ns
        ev.append({"type": "step_begin", "step": s, "t": begin})
        ev.append(
            {"type": "span", "cat": "backward", "start": begin + 1_000_000, "t": end - 2_000_000, "tid": 1}
        )
        ev.append(
            {"type": "span", "cat": "optimizer", "start": end - 2_000_000, "t": end - 1_000_000, "tid": 1}
        )
        ev.append(
            {"type": "step_end", "step": s, "t": end, "source": "torch.optim", "duration_s": step_ns / 1e9}
        )
        cpu = {"type": "cpu", "step": s, "t": end, "proc_cpu_s": step_ns / 1e9, "thread_runq_s": runq_s}
        if shim_ns is not None:  # an older shim wrote no accounting of its own
            cpu.update(shim_ns=shim_ns, shim_end_ns=shim_ns // 2, shim_threads_cpu_s=0.0)
        cpu.update(sys_idle_s=idle_s, sys_total_s=2 * step_ns / 1e9, cores=2)
        cpu.update(cpu_of(s) if cpu_of else {})
        ev.append(cpu)
    if cpu_of:  # a shim whose step end is timed by the thread's CPU clock says so
        ev.append({"type": "self_cost", "t": t0 + steps * step_ns, "steps": steps, "end_clock": "thread"})
    with open(path / "events" / f"p{pid}.jsonl", "w") as f:
        f.write("\n".join(json.dumps(e) for e in ev) + "\n")
    manifest = {
        "traindx_run": 1,
        "command": ["python", "train.py"],
        "start_ns": t0 - 2_000_000,
        "end_ns": t0 + steps * step_ns,
        "exit_code": 0,
        "status": "finished",
        "ranks": {"0": pid},
        "missing": {},
        "self_cost": {"wall_s": steps * step_ns / 1e9, "helpers_cpu_s": helpers or {}},
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    return traindx.load_run(str(path))


def test_a_run_states_its_own_cost_in_findings(tmp_path):
    """50 µs of the shim in each 10 ms step, helpers on an idle machine (no wait for a core):
    the run states ~0.5 % of step time, in a `traindx.cost` info finding whose title is the
    sentence the terminal and the report print."""
    run = _write_run(tmp_path / "run", helpers={"pyspy": 0.05, "relay": 0.01, "diagnose": 0.02})
    cost = self_cost(run)
    assert cost is not None and cost["steps"] == 39  # step 0 is start-up's
    assert cost["shim_s_per_step"] == pytest.approx(50e-6)
    assert cost["helpers_s_per_step"] == 0  # no core was waited for: the helpers cost nothing
    assert cost["pct"] == pytest.approx(100 * 50e-6 / (0.01 - 50e-6), rel=1e-3)
    found = {f.id: f for f in analyze(run)}
    stated = found["traindx.cost"]
    assert stated.severity == "info" and stated.title.startswith("traindx cost this job ~0.5 % of step time")
    assert stated.title == cost_line(cost) and stated.evidence["helpers_cpu_s"]["pyspy"] == 0.05


def test_helpers_cost_the_job_only_where_it_waited_for_a_core(tmp_path):
    """The same run on a saturated machine: the training thread waited 1 ms a step for a core;
    the helpers took 0.1 of the 0.8 CPU-s the other tasks took meanwhile (the machine's busy
    time less the job's own): their share of the wait is booked to traindx."""
    run = _write_run(tmp_path / "run", helpers={"pyspy": 0.1}, runq_s=0.001)
    cost = self_cost(run)
    others = 40 * 0.02 - 40 * 0.01  # busy core-seconds less the job's own
    assert cost["helpers_s_per_step"] == pytest.approx(0.001 * 0.1 / others, rel=0.05)
    assert np.isfinite(cost["pct"]) and cost["pct"] > 100 * 50e-6 / 0.01


def test_helpers_cost_nothing_where_the_machine_had_idle_cores_for_them(tmp_path):
    """The same wait for a core, but the machine sat idle 5 ms a step (0.2 core-s over the
    steps, twice the helpers' 0.1 CPU-s): they ran on cores nobody wanted, the job's wait is
    not theirs. With 1 ms idle a step (0.04 core-s) the 0.06 left competed, and only that."""
    idle = _write_run(tmp_path / "idle", helpers={"pyspy": 0.1}, runq_s=0.001, idle_s=0.005)
    assert self_cost(idle)["helpers_s_per_step"] == 0
    some = _write_run(tmp_path / "some", helpers={"pyspy": 0.1}, runq_s=0.001, idle_s=0.001)
    competing = 0.1 * 39 / 40 - 39 * 0.001  # the judged steps' share of the helpers' CPU, less idle
    others = 39 * (0.02 - 0.001) - 39 * 0.01
    assert self_cost(some)["helpers_s_per_step"] == pytest.approx(0.001 * competing / others, rel=0.05)


def test_a_few_steps_preempted_inside_the_shim_do_not_move_the_stated_cost(tmp_path):
    """Every step: wrappers 30 µs (wall), step end 20 µs (thread CPU); every 10th step the
    machine-wide read adds 100 µs of the step end's CPU; four steps were preempted inside a
    wrapper for 5 ms. The statement: the step end's mean (30 µs) and the wrappers' typical step
    (30 µs), not the 5 ms waits (a mean would say ~550 µs)."""

    def cpu_of(s):
        end = 20_000 + (100_000 if s % 10 == 0 else 0)
        wrap = 30_000 + (5_000_000 if s in (7, 13, 21, 33) else 0)
        return {"shim_ns": end + wrap, "shim_end_ns": end}

    run = _write_run(tmp_path / "run", cpu_of=cpu_of)
    ends = [20_000 + (100_000 if s % 10 == 0 else 0) for s in range(1, 40)]
    assert self_cost(run)["shim_s_per_step"] == pytest.approx((np.mean(ends) + 30_000) / 1e9)


def test_a_run_without_the_shims_accounting_states_nothing(tmp_path):
    run = _write_run(tmp_path / "run", shim_ns=None)
    assert self_cost(run) is None
    assert "traindx.cost" not in {f.id for f in analyze(run)}


@pytest.mark.slow
def test_a_real_run_states_what_it_cost_the_job(tmp_path):
    """A real loop under diagnose: the terminal's last lines, the report and findings.json say
    what traindx cost this job; the manifest holds the helpers' CPU; the ledger has traindx's
    line, the shim's step-end work there and not in the job's host time."""
    from helpers import PY, diagnose

    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs", "fw_plain_loop.py")
    run_dir = tmp_path / "run"
    proc = diagnose(["--run-dir", str(run_dir), "--", PY, job, "--batches", "24"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = " ".join(proc.stderr.split())
    assert "traindx cost this job ~" in said and "% of step time" in said
    found = {f["id"]: f for f in json.loads((run_dir / "findings.json").read_text())}
    stated = found["traindx.cost"]["evidence"]
    assert stated["steps"] > 10 and stated["shim_s_per_step"] > 0 and np.isfinite(stated["pct"])
    assert "verdict-own-cost" in (run_dir / "report.html").read_text()
    helpers = json.loads((run_dir / "manifest.json").read_text())["self_cost"]["helpers_cpu_s"]
    assert {"pyspy", "relay", "diagnose"} <= set(helpers)
    led = traindx.load_run(str(run_dir)).ledger
    assert (led["traindx_s"] > 0).any()


def test_machine_reads_come_on_a_clock_and_span_the_steps_between_them(shim_cost, monkeypatch):
    """/proc/stat is read at most every STAT_INTERVAL_NS (40 ms steps, 100 ms: every 3rd step),
    and STAT_EVERY times less often once shed: the steps between carry no machine fields, and
    each reading says how many wall seconds it covers (sys_span_s), so idle cores stay a rate."""
    from _traindx_shim import cpustat

    events = []
    clock = [0]
    monkeypatch.setattr(cpustat, "emit", lambda type_, **f: events.append(f))
    monkeypatch.setattr(cpustat, "_clock", lambda: clock[0])
    monkeypatch.setattr(cpustat, "STAT_INTERVAL_NS", 100_000_000)

    def run(steps):
        events.clear()
        monkeypatch.setattr(cpustat, "_prev", {})
        monkeypatch.setattr(cpustat, "_machine", {"stat": None, "t": None, "read_ns": 0})
        for step in range(1, steps + 1):
            clock[0] = step * 40_000_000
            cpustat.emit_step(step)
        return [e["step"] for e in events if "sys_total_s" in e]

    assert run(8) == [4, 7]
    assert all(abs(e["sys_span_s"] - 0.12) < 1e-6 for e in events if "sys_total_s" in e)
    assert [e["step"] for e in events] == [2, 3, 4, 5, 6, 7, 8]  # every step keeps its own CPU fields
    selfcost.shed_state["stat_every"] = 3  # shed: every 300 ms
    assert run(17) == [9, 17]


def test_allocator_stats_read_from_the_nested_dict_match_torchs_flat_form(monkeypatch):
    """The step's `alloc` fields are read from the allocator's nested dict (no per-step flatten
    of ~300 entries); they are the values torch.cuda.memory_stats() would give for the same
    allocator state (torch's own flattening of that dict)."""
    import torch
    from _traindx_shim import stepwork

    nested = {
        "num_alloc_retries": 2,
        "num_ooms": 0,
        "num_device_alloc": 11,
        "allocated_bytes": {"all": {"current": 5 << 20, "peak": 7 << 20}, "small_pool": {"current": 1}},
        "reserved_bytes": {"all": {"current": 8 << 20, "peak": 9 << 20}},
        "inactive_split_bytes": {"all": {"current": 3}},
    }
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: nested)
    # torch's flattening of the same nested dict (memory_stats reads it through its own module)
    monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict", lambda device=None: nested)
    flat = torch.cuda.memory_stats()
    emitted = []
    monkeypatch.setattr(stepwork, "emit", lambda type_, **f: emitted.append(f))
    monkeypatch.setattr(stepwork, "_alloc", {"read_ns": None, "step": None})  # the first reading
    fields = stepwork.emit_alloc(3, torch)
    assert fields == {k.replace(".", "_"): flat.get(k) for k in stepwork.ALLOC_KEYS}
    assert fields["allocated_bytes_all_current"] == 5 << 20 and fields["num_sync_all_streams"] is None
    assert emitted == [dict(step=3, **fields)]
