"""The GPU's own clock at the shim's measured boundaries, on every step (not only in the
torch.profiler window).

A CUDA event recorded at host time h completes at GPU time g, when the GPU has finished all the
work queued before it. Events are recorded (never waited for) at each step boundary and at the
start and end of the measured calls: the DataLoader's __next__, backward, the optimizer step,
garbage collections, and the end of each host-device sync, collective and checkpoint span.
Events are read lazily: at a later step boundary, `query()` (a status read, never a wait) tells
whether a step's events have completed; only then are their GPU times read (`elapsed_time`).
One `gpu_time` event per completed step carries the raw pairs, relative to the step's first
mark, for the derive layer (traindx.profiler.gputime) to turn into busy and idle time:

  {"type": "gpu_time", "step": k, "device": i, "marks": [[label, host_ns, gpu_us], ...]}

gpu_us is the GPU time of the mark since the step's first mark (elapsed_time, µs); the last
mark is the next step's first (the boundary), so consecutive steps chain exactly. Labels:
"step" (a boundary), "data>"/"data<", "bwd>"/"bwd<", "opt>"/"opt<", "gc>"/"gc<" (start/end),
"sync<", "coll<", "io<" (end of those spans).

Nothing happens before the job initialises CUDA itself (never initialising it here), nor on a
CPU-only job (one flag read per wrapped call), nor while a CUDA graph is being captured or
torch.compile traces. Events are pooled and reused. Cost: bench/gpu_view_overhead.py.
TRAINDX_GPU_TIME=off turns it off.
"""

from __future__ import annotations

import atexit
import collections
import gc
import os
import threading
import time

from . import emit, importhooks, passes_for, report_error, schema, steps

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType
    from typing import Any

GPU_TIME_EVENT = schema.GPU_TIME
MAX_PENDING_STEPS = 64  # steps whose events the GPU has not reached yet; older are dropped
MAX_MARKS_PER_STEP = 256  # a step with more measured calls keeps its first ones (and the end)
_now = time.time_ns
_state: dict[str, Any] = {
    "torch": None,
    "active": False,
    "checked": False,
    "pool": [],
    "marks": [],
    "step": None,
    "pending": collections.deque(),
    "dropped": 0,
    "device": None,
    "capturing": None,
    "compiling": None,
    "in_mark": False,
}
_lock = threading.Lock()


def _can_record() -> bool:
    """CUDA is in use here and the caller is not inside a graph capture or a dynamo trace."""
    if not _state["active"]:
        return False
    try:
        check = _state["compiling"]
        if check is not None and check():
            return False
        capturing = _state["capturing"]
        return not (capturing is not None and capturing())
    except Exception:
        return False


def mark(label: str) -> None:
    """Record one event on the current stream, paired with the host clock."""
    if not _can_record() or _state["in_mark"]:
        return  # in_mark: a GC pass that starts inside a mark marks nothing (marks stay in order)
    marks = _state["marks"]
    if len(marks) >= MAX_MARKS_PER_STEP or _state["step"] is None:
        return
    _state["in_mark"] = True
    try:
        pool = _state["pool"]
        event = pool.pop() if pool else _state["torch"].cuda.Event(enable_timing=True)
        event.record()
        marks.append((label, _now(), event))
    except Exception as exc:
        _state["active"] = False  # a broken CUDA context: stop, say so once, never break the job
        report_error("gpu time mark", exc)
    finally:
        _state["in_mark"] = False


def _boundary(step: int) -> None:
    """At each step boundary (the step about to begin): close the last step, read finished ones.
    A step hook only once CUDA is in use (_maybe_start): a CPU job's step boundaries stay as
    they are (any boundary hook makes the next step begin after the hooks have run)."""
    if not _state["active"]:
        return
    try:
        with _lock:
            if _state["step"] is not None and _state["marks"]:
                if _can_record():
                    torch = _state["torch"]
                    pool = _state["pool"]
                    event = pool.pop() if pool else torch.cuda.Event(enable_timing=True)
                    event.record()
                    closing = ("step", _now(), event)
                    _state["marks"].append(closing)
                    _close(_state["step"], _state["marks"])
                    _state["marks"] = [closing]
                else:
                    _state["marks"] = []
            _state["step"] = step
            if not _state["marks"]:
                _state["marks"] = []
                mark("step")
            _harvest()
    except Exception as exc:
        _state["active"] = False
        report_error("gpu time boundary", exc)


def _close(step: int, marks: list[Any]) -> None:
    pending = _state["pending"]
    pending.append((step, marks))
    while len(pending) > MAX_PENDING_STEPS:
        _state["dropped"] += 1
        _release(pending.popleft()[1][:-1])


def _release(marks: list[Any]) -> None:
    _state["pool"].extend(m[2] for m in marks)


def _harvest(wait: bool = False) -> None:
    """Emit every pending step whose events have all completed (oldest first; stop at the first
    that has not: the GPU reaches them in order)."""
    pending = _state["pending"]
    while pending:
        step, marks = pending[0]
        if wait:
            marks[-1][2].synchronize()
        if not all(m[2].query() for m in marks):
            return
        pending.popleft()
        first = marks[0][2]
        out = [
            [label, h, 0.0 if i == 0 else round(first.elapsed_time(e) * 1000.0, 2)]
            for i, (label, h, e) in enumerate(marks)
        ]
        emit(
            GPU_TIME_EVENT,
            step=step,
            device=_state["device"],
            marks=out,
            **({"dropped_steps": _state["dropped"]} if _state["dropped"] else {}),
        )
        _release(marks[:-1])  # the last mark is the next step's first: still in use


def _maybe_start() -> None:
    """After each measured call until CUDA is in use: one flag read, then torch's own
    is_initialized (never initialising CUDA here); once it is, the step hook goes in."""
    if _state["active"] or _state["checked"]:
        return
    if _cuda_ready():
        steps.boundary_hooks.append(_boundary)


def _cuda_ready() -> bool:
    torch = _state["torch"]
    if torch is None:
        return False
    try:
        if not torch.cuda.is_initialized():
            return False
        _state["checked"] = True
        _state["device"] = torch.cuda.current_device()
        _state["capturing"] = getattr(torch.cuda, "is_current_stream_capturing", None)
        compiler = getattr(torch, "compiler", None)
        _state["compiling"] = getattr(compiler, "is_dynamo_compiling", None)
        _state["active"] = True
        return True
    except Exception as exc:
        report_error("gpu time start", exc)
        _state["checked"] = True
        return False


def flush() -> None:
    """At exit: the events still pending are waited for (the job is over) and emitted."""
    if not _state["active"]:
        return
    try:
        with _lock:
            _harvest(wait=True)
    except Exception as exc:
        report_error("gpu time flush", exc)


# -- the measured calls ----------------------------------------------------------------------
def _around(fn: Callable[..., Any], start: str, end: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _state["active"]:
            try:
                return fn(*args, **kwargs)
            finally:
                _maybe_start()
        mark(start)
        try:
            return fn(*args, **kwargs)
        finally:
            mark(end)

    return passes_for(wrapper, fn)


def _on_dataloader(module: ModuleType) -> None:
    cls = module._BaseDataLoaderIter
    cls.__next__ = _around(cls.__next__, "data>", "data<")


def _opt_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _state["active"]:
        mark("opt>")


def _opt_post(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _state["active"]:
        mark("opt<")
    else:
        _maybe_start()


_END_OF_SPAN = {"sync": "sync<", "collective": "coll<", "io": "io<"}


def _on_torch(torch: Any) -> None:
    _state["torch"] = torch
    torch.autograd.backward = _around(torch.autograd.backward, "bwd>", "bwd<")
    # torch is imported here only once the job has imported it: the shim never imports it first
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_opt_pre)  # a hook's return value replaces the args:
    register_optimizer_step_post_hook(_opt_post)  # these return None
    # the spans module times syncs, collectives and checkpoints: mark where each ends
    from . import spans

    original = spans._span

    def span(cat: str, start: int, end: int, **extra: Any) -> None:
        original(cat, start, end, **extra)
        label = _END_OF_SPAN.get(cat)
        if label is not None and _state["active"]:
            mark(label)

    spans._span = span


def _gc_callback(phase: str, info: dict[str, Any]) -> None:
    if _state["active"]:
        mark("gc>" if phase == "start" else "gc<")


def register() -> None:
    if (os.environ.get("TRAINDX_GPU_TIME") or "").lower() in ("0", "off", "no"):
        return  # the overhead benchmark's control arm
    importhooks.on_import("torch", _on_torch)
    importhooks.on_import("torch.utils.data.dataloader", _on_dataloader)
    gc.callbacks.append(_gc_callback)
    # a forked child (a DataLoader worker) must not touch the parent's CUDA context
    os.register_at_fork(after_in_child=lambda: _state.update(active=False, checked=True))

    atexit.register(flush)
