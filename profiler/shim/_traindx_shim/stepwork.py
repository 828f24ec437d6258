"""A step end's evidence (GC, CPU, host samples, allocator, memory), each part timed: what
the shim's step end costs the job (selfcost.py books it)."""

from __future__ import annotations

import time

from . import bus, cpustat, emit, gcstats, hostsample, memwatch, report_error, schema, selfcost

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from typing import Any


def evidence(step: int, wall_ns: int | None, torch: Any, trains_here: bool) -> dict[str, int]:
    """The step's evidence (GC, CPU, host samples, allocator, memory): ns per part."""
    parts: dict[str, int] = {}
    t0 = time.time_ns()
    gcstats.emit_step(step)
    t1 = time.time_ns()
    try:
        cpustat.emit_step(step, selfcost.step_fields(step, wall_ns))
        if trains_here:
            cpustat.emit_threads(step, torch)
    except Exception as exc:
        report_error("cpu evidence", exc)
    t2 = time.time_ns()
    hostsample.flush(step)
    t3 = time.time_ns()
    bus.publish(schema.STEP_ENDED, step)  # compiles: torch.compile's metrics of this step
    dev = emit_alloc(step, torch)
    t4 = time.time_ns()
    hunt = memwatch._state["hunt"]
    if trains_here:
        try:
            memwatch.emit_step(step, torch, dev)
        except Exception as exc:
            report_error("memory evidence", exc)
    t5 = time.time_ns()
    # a memory hunt's census ran in it (begun, or its second census): on purpose, not per step
    parts["hunting"] = int(hunt is not None or memwatch._state["hunt"] is not None)
    parts.update(
        {
            "step.gc": t1 - t0,
            "step.cpu": t2 - t1,
            "step.samples": t3 - t2,
            "step.alloc": t4 - t3,
            "step.mem": t5 - t4,
        }
    )
    return parts


ALLOC_KEYS = (
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "reserved_bytes.all.current",
    "reserved_bytes.all.peak",
    "inactive_split_bytes.all.current",
)


def _pick(nested: dict[str, Any], key: str) -> Any:
    node: Any = nested
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


ALLOC_INTERVAL_NS = cpustat.STAT_INTERVAL_NS  # allocator reads: at most 10 a second
_alloc: dict[str, Any] = {"read_ns": None, "step": None}  # the last reading: its clock, its step


def emit_alloc(step: int, torch: Any) -> dict[str, Any] | None:
    """The caching allocator's stats (GPU only), also returned for the memory line; None on the
    steps between readings. Read at most every ALLOC_INTERVAL_NS (every step of longer steps):
    the nested dict of ~300 entries cost ~80-100 µs a step on an H100 host, and its counters
    (retries, OOMs, device mallocs) are cumulative, so a reading that spans several steps
    (span_steps, span_s: since the last reading) loses no event, only which of its steps had it.
    From the nested dict the allocator gives: torch.cuda.memory_stats() (and memory_allocated(),
    which calls it) flattens and sorts all of it in Python first."""
    if torch is None or not torch.cuda.is_initialized():
        return None
    now = cpustat._clock()
    last, last_step = _alloc["read_ns"], _alloc["step"]
    if last is not None and now - last < ALLOC_INTERVAL_NS and last_step is not None and step > last_step:
        return None
    try:
        nested = torch.cuda.memory_stats_as_nested_dict()
        fields = {k.replace(".", "_"): _pick(nested, k) for k in ALLOC_KEYS}
    except Exception:
        try:  # an older torch: the flat form
            stats = torch.cuda.memory_stats()
            fields = {k.replace(".", "_"): stats.get(k) for k in ALLOC_KEYS}
        except Exception:
            return None
    _alloc.update(read_ns=now, step=step)
    span = (
        {}
        if last is None or last_step is None
        else {"span_steps": step - last_step, "span_s": (now - last) / 1e9}
    )
    emit("alloc", step=step, **fields, **span)
    return fields
