"""The caching allocator's stats read on a clock (issue 47): at most every ALLOC_INTERVAL_NS, each
reading spanning the steps since the last one; the memory line keeps the device series at its
readings, and the allocator analyzer places a spanning reading's retries in its slowest steady
steps. A stand-in torch.cuda and a fake clock: no GPU, no timing asserted."""

import os
import sys
import types

import pandas as pd

from traindx.analyzers.memory.allocator import _retry_steps

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiler", "shim")
)
from _traindx_shim import cpustat, memwatch, stepwork  # noqa: E402


def _stand_in_torch(allocated):
    """torch with a CUDA allocator whose stats say `allocated[0]` bytes; counts its reads."""
    reads = []

    def nested(device=None):
        reads.append(1)
        return {
            "num_alloc_retries": len(reads) // 2,
            "allocated_bytes": {"all": {"current": allocated[0]}},
            "reserved_bytes": {"all": {"current": 2 * allocated[0]}},
        }

    cuda = types.SimpleNamespace(
        is_initialized=lambda: True, memory_stats_as_nested_dict=nested, mem_get_info=lambda: (1, 80 << 30)
    )
    return types.SimpleNamespace(cuda=cuda), reads


def test_the_allocator_is_read_on_a_clock_each_reading_spanning_its_steps(monkeypatch):
    clock = [0]
    events = []
    monkeypatch.setattr(cpustat, "_clock", lambda: clock[0])
    monkeypatch.setattr(stepwork, "ALLOC_INTERVAL_NS", 100_000_000)
    monkeypatch.setattr(stepwork, "_alloc", {"read_ns": None, "step": None})
    monkeypatch.setattr(stepwork, "emit", lambda type_, **f: events.append((type_, f)))
    monkeypatch.setattr(memwatch, "emit", lambda type_, **f: events.append((type_, f)))
    fresh = dict(
        memwatch._state, history=[], dev_history=[], hunt=None, hunted=True, dev_total=None, ours=None
    )
    monkeypatch.setattr(memwatch, "_state", fresh)
    allocated = [1 << 30]
    torch, reads = _stand_in_torch(allocated)
    for step in range(1, 9):  # 40 ms steps: a reading at steps 1, 4 and 7
        clock[0] = step * 40_000_000
        allocated[0] += 1 << 20
        memwatch.emit_step(step, torch, stepwork.emit_alloc(step, torch))
    alloc = [f for t, f in events if t == "alloc"]
    assert [a["step"] for a in alloc] == [1, 4, 7] and len(reads) == 3
    assert "span_steps" not in alloc[0]  # the first reading spans nothing before it
    assert [(a["span_steps"], round(a["span_s"], 3)) for a in alloc[1:]] == [(3, 0.12), (3, 0.12)]
    mem = [f for t, f in events if t == "mem"]
    assert [m["step"] for m in mem] == list(range(1, 9))  # host memory still every step
    assert [m["step"] for m in mem if "dev_alloc_bytes" in m] == [1, 4, 7]
    assert mem[0]["dev_total_bytes"] == 80 << 30  # the device's size at the first reading
    assert memwatch._state["dev_history"] == [
        (1, (1 << 30) + (1 << 20)),
        (4, (1 << 30) + (4 << 20)),
        (7, (1 << 30) + (7 << 20)),
    ]
    # a step boundary that goes back (a new training loop counting from 0) reads at once
    clock[0] += 1
    assert stepwork.emit_alloc(0, torch) is not None


def test_a_readings_retries_fall_in_its_slowest_steady_steps():
    durations = pd.Series(dict.fromkeys(range(3, 13), 0.01))
    durations[6] = 0.030  # the slow step of the reading at step 8
    durations[11] = 0.025
    durations[12] = 0.020  # the reading at step 12 had two: its two slowest steps
    steady = set(range(3, 13))
    rows = pd.DataFrame(
        {"step": [0, 4, 8, 12], "num_alloc_retries": [0, 0, 1, 3], "span_steps": [None, 4, 4, 4]}
    )
    assert _retry_steps(rows, steady, durations) == (3, {6, 11, 12})
    # records read every step (no span_steps): a reading's retries are its own step's
    old = pd.DataFrame({"step": [4, 5, 6, 7], "num_alloc_retries": [0, 0, 2, 2]})
    assert _retry_steps(old, steady, durations) == (2, {6})
    # a reading whose steps are all outside the steady window counts none
    warm = pd.DataFrame({"step": [2], "num_alloc_retries": [5], "span_steps": [2]})
    assert _retry_steps(warm, steady, durations) == (0, set())


def test_device_growth_read_every_third_step_is_judged_at_its_readings(tmp_path):
    """A device leak of 64 MiB a step, the allocator read every 3rd step (the clock on ~35 ms
    steps): found at 64 MiB a step (the change per step between readings), and the device runs
    out counted from its last reading, not from a step without one."""
    from records import RunBuilder

    from traindx.analyzers.memory import memory

    b = RunBuilder(tmp_path / "run")
    mib = 1 << 20
    for _ in range(60):
        step = b.step(0.035)
        dev = {}
        if step % 3 == 0:
            dev = {
                "dev_alloc_bytes": (1024 + 64 * step) * mib,
                "dev_reserved_bytes": (2048 + 64 * step) * mib,
            }
            if step == 0:
                dev["dev_total_bytes"] = 80 * 1024 * mib
        b.event("mem", step=step, rss_bytes=900 * mib, heap_bytes=300 * mib, **dev)
    (found,) = [f for f in memory.analyze(b.load()) if f.evidence.get("series") == "dev_alloc_bytes"]
    assert round(found.evidence["rate_mb_per_step"]) == 64
    # 80 GiB less 2048 + 64 x 57 MiB reserved at the last reading (step 57), at 64 MiB a step
    expected = 57 + (80 * 1024 - 2048 - 64 * 57) / 64  # (the fitted rate's last bits: +-1 step)
    assert abs(found.evidence["runs_out_at_step"] - expected) <= 1
