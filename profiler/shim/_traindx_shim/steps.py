"""Step boundaries: one step ends when the optimizer steps.

torch's global optimizer hooks fire for every torch optimizer. Megatron's MegatronOptimizer is
not one (its inner optimizer is, once per sub-optimizer of a ChainedOptimizer, and not at all
when found_inf skips the step), so where Megatron is imported its outermost `step` call marks
the boundary and the torch hooks stand down.
"""
import os
import threading
import time

from . import emit, get_writer, guarded, importhooks
from . import gcstats

_state = {"step": 0, "begin": None, "megatron_depth": 0, "megatron": False, "torch": None}
_local = threading.local()
MAX_STEPS = int(os.environ.get("TRAINDX_MAX_STEPS") or 0)


def current_step():
    return _state["step"]


def in_step_since():
    return _state["begin"]


# called at each step boundary with the step about to begin (the torch.profiler window)
boundary_hooks = []


def _begin(t):
    if boundary_hooks:
        for hook in boundary_hooks:
            try:
                hook(_state["step"])
            except Exception as exc:
                from . import report_error
                report_error("step boundary hook", exc)
        t = time.time_ns()  # what a hook costs (a trace export) falls between steps, not in one
    _state["begin"] = t
    emit("step_begin", step=_state["step"], t=t)


def _end(source):
    t = time.time_ns()
    step = _state["step"]
    begin = _state["begin"]
    emit("step_end", step=step, t=t, source=source,
         duration_s=None if begin is None else (t - begin) / 1e9)
    gcstats.emit_step(step)
    from . import compiles
    compiles.harvest_dynamo()
    _emit_alloc(step)
    _state["step"] = step + 1
    if MAX_STEPS and step + 1 >= MAX_STEPS:
        # stop at the job's next zero_grad or optimizer step, so the job's own end-of-step
        # code (its log line, its loss) still runs for the last step
        _state["stop_pending"] = True
        emit("stop_requested", step=step, reason=f"--steps {MAX_STEPS}")
    _begin(time.time_ns())


def _stop_if_pending():
    if _state.get("stop_pending"):
        _state["stop_pending"] = False
        w = get_writer()
        if w is not None:
            w.flush()
        raise SystemExit(0)


def _emit_alloc(step):
    torch = _state["torch"]
    if torch is None or not torch.cuda.is_initialized():
        return
    try:
        stats = torch.cuda.memory_stats()
    except Exception:
        return
    keep = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
            "num_device_free", "allocated_bytes.all.current", "allocated_bytes.all.peak",
            "reserved_bytes.all.current", "reserved_bytes.all.peak",
            "inactive_split_bytes.all.current")
    emit("alloc", step=step, **{k.replace(".", "_"): stats.get(k) for k in keep})


def _torch_pre_hook(optimizer, args, kwargs):
    # an optimizer that steps others (torchtitan's OptimizersContainer, a Lightning or
    # DeepSpeed wrapper that is itself a torch Optimizer) is one step, not one per inner optimizer
    outer = _state.get("outer_optimizer")
    if outer is None or outer is optimizer:  # (the same one again: its last step raised)
        _state["outer_optimizer"] = optimizer
        _stop_if_pending()


def _torch_post_hook(optimizer, args, kwargs):
    if _state["megatron_depth"]:
        return
    if _state.get("outer_optimizer") not in (None, optimizer):
        return
    _state["outer_optimizer"] = None
    try:
        _end("torch.optim")
    except SystemExit:
        raise
    except Exception as exc:
        from . import report_error
        report_error("optimizer post hook", exc)


@guarded("torch import hook")
def _on_torch(torch):
    _state["torch"] = torch
    from torch.optim.optimizer import (Optimizer, register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    register_optimizer_step_post_hook(_torch_post_hook)
    register_optimizer_step_pre_hook(_torch_pre_hook)
    original_zero_grad = Optimizer.zero_grad

    def zero_grad(self, *args, **kwargs):
        _stop_if_pending()
        return original_zero_grad(self, *args, **kwargs)

    Optimizer.zero_grad = zero_grad
    original_init = Optimizer.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if _state["begin"] is None:
            emit("optimizer_created", optimizer=type(self).__name__)
            _begin(time.time_ns())

    Optimizer.__init__ = __init__


@guarded("megatron import hook")
def _on_megatron_optimizer(module):
    for name in dir(module):
        cls = getattr(module, name)
        if not isinstance(cls, type) or "step" not in vars(cls):
            continue
        if not any(base.__name__ == "MegatronOptimizer" for base in cls.__mro__):
            continue
        cls.step = _wrap_megatron_step(cls.step)
    _state["megatron"] = True


def _wrap_megatron_step(step_fn):
    def step(self, *args, **kwargs):
        if _state["megatron_depth"] == 0:
            _stop_if_pending()
        if _state["begin"] is None:
            _begin(time.time_ns())
        _state["megatron_depth"] += 1
        try:
            return step_fn(self, *args, **kwargs)
        finally:
            _state["megatron_depth"] -= 1
            if _state["megatron_depth"] == 0:
                _end("megatron")
    return step


def register():
    importhooks.on_import("torch", _on_torch)
    importhooks.on_import("megatron.core.optimizer.optimizer", _on_megatron_optimizer)
