"""The forward pass the ledger measures: a `forward` span for each outermost nn.Module call of
the training thread. Module discovery (a wrapper of nn.Module.__call__ for the first steps), then
forward hooks on the modules found; both step aside while dynamo traces. steps drives it (when
the wrapper is needed, when discovery ends); the shared state is stepstate's.

These hooks sit on the job's hot path: a few dict reads per call, no stack walks.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import weakref

from . import emit, report_error, selfcost
from .frames import describe, is_library_file, is_library_path
from .stepstate import _state

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    import weakref
    from collections.abc import Callable
    from types import FrameType
    from typing import Any

# "activity": steps' activity (step 0's begin, a pending stop), called while "active"; steps sets it
_forward: dict[str, Any] = {
    "active": False,
    "wrapper": None,
    "original": None,
    "discovering": True,
    "is_compiling": None,
    "activity": None,
}
# 1 while the training thread is inside its outermost module call (the wrapper's inner calls)
_forward_depth = [0]
# the modules the training thread called outermost while discovering: {id: weakref}
_top_modules: dict[int, weakref.ref[Any]] = {}
_hooked: dict[int, tuple[Any, Any]] = {}  # id -> hook handles of the modules timed by their own hooks
_hook_start: dict[int, int] = {}  # id(module) -> start ns of its running outermost call
DISCOVER_STEPS = 2  # steps 0 and 1 find the outermost modules; then their hooks time them
# called with (start_ns, end_ns) after each outermost module call of the training thread
forward_hooks: list[Callable[[int, int], object]] = []
# called with (args, grad) after each outermost call of the training thread: its positional
# inputs and whether grad was enabled (nograd_feeds.py: does training read a no-grad phase's rows)
input_hooks: list[Callable[[Any, bool], object]] = []
# called with (module, output) after an outermost call of a module in eval mode with grad enabled
# (hooked modules, after discovery): an evaluation that builds a graph (switches.py)
eval_grad_hooks: list[Callable[[Any, Any], object]] = []
# called with (module, True) before and (module, False) after an outermost call of a module in eval
# mode (a --fix arm that runs evaluations without grad: switches.py)
eval_call_hooks: list[Callable[[Any, bool], object]] = []


def _sync_forward_hook() -> None:
    """The forward pass the ledger measures (a `forward` span) is the training thread's
    outermost nn.Module call. Watching every module call costs every one of them, so:

    - a wrapper of nn.Module.__call__, only while it is needed: until step 0 begins (an
      activity), while a stop is pending, and for the first DISCOVER_STEPS steps, in which it
      learns which modules the training thread calls outermost (the model, a loss module) and
      times them (an inner call costs one frame and a flag read: bench/forward_overhead.py);
    - then a forward pre-hook and an always-called forward hook on those modules only (their own
      calls cost a few µs; every other module call nothing).

    Not a global module hook: torch.compile(module) warns on the job's stderr when one exists,
    and dynamo guards on their number (one more recompile). The wrapper and the hooks step aside
    while dynamo traces, so they leave no guard behind."""
    torch = _state["torch"]
    if torch is None:
        return
    _forward["active"] = _state["stop_pending"] or (
        _state["begin"] is None and (_state["opt_created_t"] is not None or _state["first_activity"] is None)
    )
    need = _forward["active"] or _forward["discovering"]
    module_cls = torch.nn.Module
    if need and _forward["wrapper"] is None:
        _install_wrapper(torch)
    elif not need and module_cls.__call__ is _forward["wrapper"]:
        # restored unless someone wrapped it after us (then ours stays, inactive)
        module_cls.__call__ = _forward["original"]
        _forward["wrapper"] = None


def _install_wrapper(torch: Any) -> None:
    module_cls = torch.nn.Module
    original = module_cls.__call__
    compiler = torch.compiler
    # a flag read (~20 ns); is_compiling also asks the exporter (~0.5 µs): too dear per call
    is_compiling = getattr(compiler, "is_dynamo_compiling", None) or compiler.is_compiling
    _forward["is_compiling"] = is_compiling
    grad_enabled = torch.is_grad_enabled
    depth, now, ident = _forward_depth, time.time_ns, threading.get_ident

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        # first: while dynamo traces, nothing below is read (no guard on our state)
        if is_compiling() or depth[0]:
            return original(self, *args, **kwargs)
        if _forward["active"]:
            _forward["activity"]("forward")
        tid = ident()
        train = _state["train_thread"] or _state["opt_thread"]
        if not _forward["discovering"] or (train is not None and tid != train):
            return original(self, *args, **kwargs)  # another thread's model: not the step's
        key = id(self)
        if key not in _top_modules:
            _remember_module(self)
        if key in _hooked:
            return original(self, *args, **kwargs)  # its own hooks time it
        depth[0] = 1
        start = now()
        try:
            return original(self, *args, **kwargs)
        finally:
            depth[0] = 0
            _forward_done(start, now(), tid, grad_enabled(), args)

    _forward["wrapper"], _forward["original"] = __call__, original
    module_cls.__call__ = __call__
    _skip_in_dynamo(sys.modules.get("torch._dynamo.eval_frame"))


def _remember_module(module: Any) -> None:
    key = id(module)
    try:
        forget = lambda _r, key=key: _top_modules.pop(key, None)
        _top_modules[key] = weakref.ref(module, forget)
    except TypeError:
        pass


def _discovered() -> None:
    """Discovery is over: the outermost modules get hooks of their own; the wrapper goes."""
    _forward["discovering"] = False
    torch = _state["torch"]
    for key, ref in list(_top_modules.items()):
        module = ref()
        if module is None or key in _hooked:
            continue
        try:
            _register_hooks(key, module)
        except Exception as exc:
            report_error("forward hooks", exc)
    if torch is not None:
        _sync_forward_hook()


def _register_hooks(key: int, module: Any) -> None:
    _hooked[key] = (
        module.register_forward_pre_hook(_module_pre),
        module.register_forward_hook(_module_post, always_call=True),
    )


def _without_forward_hooks(save: Callable[..., Any]) -> Callable[..., Any]:
    """torch.save of a whole module pickles its hooks: ours would then need the shim to load.
    They are taken off for the save and put back after it."""

    @functools.wraps(save)
    def torch_save(*args: Any, **kwargs: Any) -> Any:
        if not _hooked:
            return save(*args, **kwargs)
        taken = list(_hooked)
        for key in taken:
            for handle in _hooked.pop(key):
                handle.remove()
        try:
            return save(*args, **kwargs)
        finally:
            for key in taken:
                ref = _top_modules.get(key)
                module = ref() if ref is not None else None
                if module is not None:
                    try:
                        _register_hooks(key, module)
                    except Exception as exc:
                        report_error("forward hooks", exc)

    return torch_save


def _module_pre(module: Any, args: object) -> None:
    check = _forward["is_compiling"]
    if check is not None and check():
        return None
    if threading.get_ident() == _state["train_thread"] and not _forward_depth[0]:
        entered = time.time_ns()
        _hook_start.setdefault(id(module), entered)
        if eval_call_hooks and not getattr(module, "training", True):
            for call_hook in eval_call_hooks:
                call_hook(module, True)
        selfcost.add("forward", time.time_ns() - entered)
    return None


def _module_post(module: Any, args: object, output: object) -> None:
    check = _forward["is_compiling"]
    if check is not None and check():
        return None
    start = _hook_start.pop(id(module), None)
    if start is not None:
        end = time.time_ns()
        torch = _state["torch"]
        grad = torch.is_grad_enabled() if torch is not None else True
        _forward_done(start, end, threading.get_ident(), grad, args)
        evaluating = not getattr(module, "training", True)
        if grad and eval_grad_hooks and evaluating:
            for hook in eval_grad_hooks:
                hook(module, output)
        if eval_call_hooks and evaluating:
            for call_hook in eval_call_hooks:
                call_hook(module, False)
        selfcost.add("forward", time.time_ns() - end)
    return None


def _forward_done(start: int, end: int, tid: int, grad: bool, args: Any = ()) -> None:
    try:
        if grad:
            _forward["last_grad"] = True
            emit("span", cat="forward", start=start, t=end, tid=tid)
        else:  # an evaluation's forward (no_grad, inference_mode): told apart for the ledger
            extra = {}
            if _forward.get("last_grad", True):
                # the first of a run of them (an evaluation, a generate() loop) names the job's
                # line that called it; the others of the run are its (one stack walk per run)
                _forward["last_grad"] = False
                extra["caller"] = _job_frame()
            emit("span", cat="forward", start=start, t=end, tid=tid, grad=False, **extra)
        for hook in forward_hooks:
            hook(start, end)
        for input_hook in input_hooks:
            input_hook(args, grad)
    except Exception as exc:
        report_error("forward span", exc)


def _job_frame() -> dict[str, Any] | None:
    """The innermost frame of the job's own code (not installed code: a framework's generate()
    or evaluation loop is called from the job's line), else the innermost non-library one.
    Where installed code called that run of the job's frames and was itself called by the job (a
    framework's hook dispatch: a callback, a handler), `hook` is the outermost frame of the run:
    the job's line the framework ran (the callback's own work is the evaluation, not only its
    forward)."""
    frame: FrameType | None = sys._getframe(2)
    fallback = None
    while frame is not None:
        name = frame.f_code.co_filename
        if not is_library_path(name):
            found = describe(frame)
            hook = _hook_frame(frame)
            if hook is not None and hook is not frame:
                found["hook"] = describe(hook)
            return found
        if fallback is None and not is_library_file(name):
            fallback = describe(frame)
        frame = frame.f_back
    return fallback


def _hook_frame(frame: FrameType, limit: int = 256) -> FrameType | None:
    """The outermost job frame of the run that holds `frame`, when installed code called it and
    the job's code is further out (the job called the framework that called it back); else None
    (a plain loop: the job's frames reach the script's top)."""
    while frame.f_back is not None and not is_library_path(frame.f_back.f_code.co_filename):
        frame = frame.f_back
    outer = frame.f_back
    while outer is not None and limit > 0:
        if not is_library_path(outer.f_code.co_filename):
            return frame
        outer, limit = outer.f_back, limit - 1
    return None


def _skip_in_dynamo(eval_frame: Any) -> None:
    """torch.compile(module) keeps the module's __call__ of the moment it compiled: ours, if the
    wrapper was in place. Dynamo must not start a graph at our frame (its guards would watch our
    state, and its compiles would name our file): it skips it as it skips nn.Module.__call__ and
    compiles the module's own code below it. Inlined (a submodule called inside a compiled
    forward) it still traces through, as before."""
    if eval_frame is None or _forward["wrapper"] is None:
        return
    try:
        eval_frame.skip_code(_forward["wrapper"].__code__)
    except Exception as exc:
        report_error("dynamo skip of the module-call wrapper", exc)
