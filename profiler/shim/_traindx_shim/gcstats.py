"""GC pauses, aggregated per step (logging each gen-0 collection would cost more than it tells)."""

import gc
import time

from . import emit, schema

_agg = {}
_start = [0]


def _callback(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter_ns()
        return
    pause = time.perf_counter_ns() - _start[0]
    gen = info.get("generation", 0)
    count, total, longest, collected = _agg.get(gen, (0, 0, 0, 0))
    _agg[gen] = (count + 1, total + pause, max(longest, pause), collected + info.get("collected", 0))


def emit_step(step):
    if not _agg:
        return
    snapshot = dict(_agg)
    _agg.clear()
    for gen, (count, total, longest, collected) in sorted(snapshot.items()):
        emit(
            schema.GC,
            step=step,
            generation=gen,
            count=count,
            total_s=total / 1e9,
            max_s=longest / 1e9,
            collected=collected,
        )


def install():
    gc.callbacks.append(_callback)
