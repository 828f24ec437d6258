"""What the shim itself costs the job, measured in the job, and the work it sheds above a budget.

Three parts, added up at each step end into the step's `cpu` event (cpustat.py) and, every
SUMMARY_EVERY steps and at exit, one `self_cost` event with the run so far:
  shim_ns          ns the job's threads spent in the shim's code in the step: the wrappers'
                   own time (a wrapper adds its time less the wrapped call's: add(); wall
                   clock) and the previous step end's work (step events, CPU and memory
                   evidence, the host samples' flush), which runs after the boundary and so
                   inside this step: its thread CPU time (shim_end_ns; the wall also holds
                   waits for a core); that work is also a `traindx` span (the ledger's line)
  shim_threads_cpu_s  CPU seconds of the shim's own threads (the event writer, the host
                   sampler) in the step: they hold the GIL while they run Python, so a job
                   thread that needs it waits; counted whole (an upper bound)
  parts            (self_cost event only) ns per component over the judged steps (`steps`:
                   from FIRST_JUDGED_STEP; the work on purpose left out):
                   the wrappers by kind, each piece of the step-end work (wall), the threads

Budget (TRAINDX_BUDGET_PCT, default 1; 0: never shed): when the shim's cost over the last
WINDOW steps exceeds it, the shim sheds work, cheapest evidence first, one level per window,
and says so in a `shed` event {step, level, what, cost_pct}: 1 the host sampler at half its
rate (down to MIN_SAMPLE_HZ); 2 the run-queue reads of the data spans off; 3 the host sampler
at its floor (level 2 also reads the machine's /proc/stat STAT_EVERY times less often: each
reading then spans more steps, `sys_span_s`). The cost of the helpers (py-spy, the output relay, NVML) is read by `diagnose`
from /proc; their share of the job's time is the derive layer's (traindx.derive.selfcost).
"""

from __future__ import annotations

import atexit
import os
import time

from . import emit, roles, schema

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from typing import Any

SELF_COST = schema.SELF_COST
SHED = schema.SHED
BUDGET_PCT = float(os.environ.get("TRAINDX_BUDGET_PCT") or 1.0)
WINDOW = 20  # steps the budget is judged over
FIRST_JUDGED_STEP = 5  # start-up steps (imports, first allocations) are not the steady cost
SUMMARY_EVERY = 100
MIN_SAMPLE_HZ = 5.0
STAT_EVERY = 10  # shed level 2: /proc/stat read this many times less often (cpustat.STAT_INTERVAL_NS)
_now = time.time_ns
# wrappers' own ns per kind since the last step end, and over the run
_pending: dict[str, int] = {}
_parts: dict[str, int] = {}
_state: dict[str, Any] = {
    "carry_ns": 0,  # the previous step end's work: it ran inside the step now ending
    "purpose_ns": 0,  # the part of it spent on purpose (profiler window, memory hunt)
    "threads_cpu": None,  # {ident: ns} at the last step end
    "window_cost": 0,
    "window_wall": 0,
    "window_steps": 0,
    "level": 0,
    "steps": 0,
    "wall_ns": 0,
    "shim_ns": 0,
    "threads_ns": 0,
    "judged": True,  # the step that just ended is judged: its step end's parts are booked
}
# what a shed level turns down: read by the code that does the work (hostsample, spans)
shed_state: dict[str, Any] = {"sample_scale": 1.0, "data_runq": True, "stat_every": 1}


def add(kind: str, ns: int) -> None:
    """A wrapper's own time (its whole call less the wrapped call's): a dict update."""
    if ns > 0:
        _pending[kind] = _pending.get(kind, 0) + ns


def step_end_work(ns: int, parts: dict[str, int], purpose_ns: int = 0, cpu_ns: int | None = None) -> None:
    """The step end's own work (steps._end), booked to the step it ran in: the next one.
    ns: its wall time; cpu_ns: the thread's CPU time in it, what the per-step cost counts (the
    wall also holds the job's wait for a core on a loaded machine, a wait it has without the
    shim too). purpose_ns: the part of it spent looking closer on purpose (a torch.profiler
    window's start, stop and export; a memory hunt's census): stated once, never judged as a
    per-step cost."""
    per_step = max(0, ns - purpose_ns)
    _state["carry_ns"] += per_step if cpu_ns is None else min(per_step, max(0, cpu_ns))
    _state["purpose_ns"] += purpose_ns
    if _state["judged"]:  # the summary's parts are the judged steps' (as its `steps` count)
        for k, v in parts.items():
            _parts[k] = _parts.get(k, 0) + v


def _threads_cpu_ns() -> dict[tuple[int, str], int]:
    """{(ident, name): CPU ns so far} of the shim's own threads, as each last reported it on
    itself (roles.report_cpu): a clock read per thread here cost the job's step end ~5-20 µs."""
    return {(ident, name): ns for ident, (name, ns) in list(roles.OWN_CPU.items())}


def step_fields(step: int, wall_ns: int | None) -> dict[str, Any]:
    """The step's own cost (fields of its `cpu` event); judges the budget."""
    carried, purpose = _state["carry_ns"], _state["purpose_ns"]
    own = sum(_pending.values()) + carried
    # start-up steps (the first steps' thread census, the first allocator and device reads) and
    # the work on purpose (a profiler window, a hunt) are not the steady cost: the parts count
    # the judged steps, as the summary's `steps` does
    judged = _state["judged"] = bool(wall_ns) and step >= FIRST_JUDGED_STEP
    for k, v in _pending.items() if judged else ():
        _parts["wrap." + k] = _parts.get("wrap." + k, 0) + v
    _pending.clear()
    _state["carry_ns"] = _state["purpose_ns"] = 0
    now = _threads_cpu_ns()
    prev = _state["threads_cpu"]
    _state["threads_cpu"] = now
    threads = 0
    for thread, ns in now.items() if prev is not None else ():
        used = max(0, ns - prev.get(thread, ns))
        threads += used
        if judged:
            _parts["thread." + thread[1]] = _parts.get("thread." + thread[1], 0) + used
    fields: dict[str, Any] = {"shim_ns": own, "shim_end_ns": carried, "shim_threads_cpu_s": threads / 1e9}
    if purpose:
        fields["shim_purpose_ns"] = purpose
    if wall_ns and step >= FIRST_JUDGED_STEP:
        _state["steps"] += 1
        _state["wall_ns"] += wall_ns
        _state["shim_ns"] += own
        _state["threads_ns"] += threads
        _judge(step, own + threads, wall_ns)
    if step and step % SUMMARY_EVERY == 0:
        summary(step)
    return fields


def _judge(step: int, cost_ns: int, wall_ns: int) -> None:
    _state["window_cost"] += cost_ns
    _state["window_wall"] += wall_ns
    _state["window_steps"] += 1
    if _state["window_steps"] < WINDOW:
        return
    pct = 100.0 * _state["window_cost"] / max(1, _state["window_wall"] - _state["window_cost"])
    _state.update(window_cost=0, window_wall=0, window_steps=0)
    if BUDGET_PCT <= 0 or pct <= BUDGET_PCT or _state["level"] >= 3:
        return
    _state["level"] += 1
    level = _state["level"]
    if level == 1:
        shed_state["sample_scale"] = 0.5
        what = "host sampler at half its rate"
    elif level == 2:
        shed_state.update(data_runq=False, stat_every=STAT_EVERY)
        what = f"run-queue reads of the data spans off, machine-wide CPU read {STAT_EVERY}x less often"
    else:
        shed_state["sample_scale"] = 0.0  # the sampler's floor (MIN_SAMPLE_HZ)
        what = f"host sampler at {MIN_SAMPLE_HZ:g} Hz"
    emit(SHED, step=step, level=level, what=what, cost_pct=round(pct, 3), budget_pct=BUDGET_PCT)


def summary(step: int | None = None) -> None:
    """The run so far: steps judged, their wall, the shim's ns in them, its threads' CPU, parts."""
    emit(
        SELF_COST,
        step=step,
        steps=_state["steps"],
        wall_ns=_state["wall_ns"],
        shim_ns=_state["shim_ns"],
        threads_ns=_state["threads_ns"],
        end_clock="thread",  # shim_end_ns is the thread's CPU time (older shims: wall)
        level=_state["level"],
        budget_pct=BUDGET_PCT,
        parts=dict(_parts),
    )


def register() -> None:
    """The run's summary at exit (before the writer's own exit handler: registered after it)."""
    atexit.register(_final)


def _final() -> None:
    if _state["steps"]:
        summary(None)
