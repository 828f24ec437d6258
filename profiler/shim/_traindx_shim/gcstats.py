"""GC pauses, aggregated per step (logging each gen-0 collection would cost more than it tells)."""

from __future__ import annotations

import gc
import time

from . import emit, schema

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from typing import Any

_agg: dict[Any, Any] = {}
_start = [0]


def _callback(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _start[0] = time.perf_counter_ns()
        return
    pause = time.perf_counter_ns() - _start[0]
    gen = info.get("generation", 0)
    count, total, longest, collected = _agg.get(gen, (0, 0, 0, 0))
    _agg[gen] = (count + 1, total + pause, max(longest, pause), collected + info.get("collected", 0))


def emit_step(step: int) -> None:
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


def install() -> None:
    gc.callbacks.append(_callback)
