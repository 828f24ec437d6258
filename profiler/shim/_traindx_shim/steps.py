"""Step boundaries: a step is one training iteration.

What ends a step, strongest signal first (docs/run-record.md, "What a step is"):
1. A step marker: `traindx.step()` called by the job, or each return of the function named by
   `diagnose --step-marker module:function` (TRAINDX_STEP_MARKER). A job that imports traindx,
   or a run with --step-marker, gets its steps from the marker alone; the signals below stand
   down from then on.
2. The outermost optimizer step of an iteration, counted once. A step call nested in another
   (an optimizer container stepping its inner optimizers, GradScaler.step calling
   optimizer.step, Megatron's and DeepSpeed's wrappers) is inside the outer one: a stack of
   running step calls tells them apart. Several optimizers stepped one after another in one
   iteration (GAN D then G, Muon + AdamW, actor + critic) form a cycle; the last optimizer of the
   cycle (the "closer") ends the iteration. The closer is learned in the first iteration: it is
   known at once when every optimizer the job created (less those seen stepping nested) has
   stepped; otherwise when an optimizer steps a second time, and then step 0's end is placed
   back at the previous outermost step (events carry explicit times). An optimizer stepping
   twice without the closer in between (the job switched optimizers) relearns the cycle the same
   way. GradScaler.step is an outermost step even when it skips optimizer.step (inf grads): the
   iteration happened; step_end counts the skipped calls.
3. Backward: a job that never creates a torch optimizer (weights updated by hand) ends a step
   at each outermost backward's return. With gradient accumulation and no optimizer, one
   backward is one step (use a marker there).

Step 0 begins at the first DataLoader batch fetch or outermost module forward with grad mode
on, or backward, after the first optimizer exists, whichever comes first: set-up after building
the optimizer (a Trainer's, an evaluation under no_grad before training) is start-up, not step 0. GC before that is
emitted as step -1 (start-up). Without any optimizer, step 0 begins at the first of those
activities after torch is imported.

`--steps N` (TRAINDX_MAX_STEPS): after step N-1 ends, the job is stopped (SystemExit(0)) at the
first batch fetch, outermost forward, backward or outermost optimizer step of iteration N, so
the job's end-of-iteration code (its log line after zero_grad) still runs for the last step.

These hooks sit on the job's hot path: a few dict reads per call, no stack walks. The global
module-call wrapper is installed only while it is needed (until step 0 begins, and while a
stop is pending).
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import time

from . import (
    control,
    emit,
    gcstats,
    get_writer,
    guarded,
    hostsample,
    importhooks,
    is_training,
    optinfo,
    report_error,
    schema,
    selfcost,
    stepwork,
    training_evidence,
)
from .forward import (  # noqa: F401  (re-exported: bench/forward_overhead.py drives them through steps)
    DISCOVER_STEPS,
    _discovered,
    _forward,
    _hooked,
    _module_post,
    _module_pre,
    _skip_in_dynamo,
    _sync_forward_hook,
    _without_forward_hooks,
    forward_hooks,
)
from .markers import (
    _install_marker_in_main,
    _marker_in_main,
    _marker_never_found,
    _marker_target,
    _on_marker_module,
    _on_traindx,
    set_step_end,
)
from .stepstate import MARKER_SPEC, _state

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType
    from typing import Any

MAX_STEPS = int(os.environ.get("TRAINDX_MAX_STEPS") or 0)
_PID = os.getpid()


def _requested_stop() -> tuple[int, str]:
    """(steps, reason) once `diagnose --until-diagnosed` asked every rank to stop at one step
    (control/stop.json); (0, "") until then."""
    request = control.read("stop.json")
    if not request:
        return 0, ""
    try:
        return max(int(request.get("steps", 0)), 1), str(request.get("reason", "diagnose"))[:200]
    except (TypeError, ValueError):
        return 0, ""


# outermost optimizer steps since the last boundary: [key, t_end, source], and their keys
_cycle: list[list[Any]] = []
_cycle_keys: set[int] = set()
# running step calls, outermost first: [kind, key, calls nested directly inside]
_stack: list[list[Any]] = []


def current_step() -> int:
    return _state["step"]


def in_step_since() -> int | None:
    return _state["begin"]


# called at each step boundary with the step about to begin (the torch.profiler window, the GPU
# clock's marks); a hook returns True when it looked closer on purpose there (a window's start,
# stop or export): its time is then stated once, not as a per-step cost
boundary_hooks: list[Callable[[int], object]] = []
_on_purpose = [False]  # a hook of this boundary returned True


def _call_boundary_hooks(step: int) -> None:
    for hook in boundary_hooks:
        try:
            if hook(step) is True:
                _on_purpose[0] = True
        except Exception as exc:
            report_error("step boundary hook", exc)


def _begin(t: int, retro: bool = False) -> None:
    if boundary_hooks:
        _call_boundary_hooks(_state["step"])
        if not retro:
            t = time.time_ns()  # what a hook costs (a trace export) falls between steps, not in one
    _state["begin"] = t
    emit("step_begin", step=_state["step"], t=t)


def _begin_step0(t: int, by: str, retro: bool = False) -> None:
    """Step 0 begins: what came before it is start-up (its GC is emitted as step -1)."""
    if not retro:
        gcstats.emit_step(-1)
    if boundary_hooks:
        _call_boundary_hooks(0)
        if not retro:
            t = time.time_ns()
    _state["begin"] = t
    emit("step_begin", step=0, t=t, begun_by=by)
    _sync_forward_hook()
    if _trains_here():
        hostsample.start(threading.get_ident())


def kernel_compile_started(t: int) -> None:
    """A kernel compile or autotune (Triton, CuTe DSL) after the optimizer exists, before any
    batch, forward or backward was seen: a job that calls its kernels outside nn.Modules (a
    functional FLA or FA4 call) has begun its first iteration there, so its first compile and
    autotune seconds belong to step 0, not to start-up. Called when the compile is recorded."""
    if _state["begin"] is not None or _state["step"] != 0 or os.getpid() != _PID:
        return
    created = _state["opt_created_t"]
    if created is None or t < created:
        return
    gcstats.emit_step(-1)
    _begin_step0(t, "kernel compile", retro=True)


def _end(source: str, t: int | None = None, retro: bool = False) -> None:
    work0 = time.time_ns()
    # the thread's own CPU clock times the step end's work (~1 us a read): under load the wall
    # clock also counts the time the job waited for a core meanwhile, which is not the shim's
    cpu0 = time.thread_time_ns()
    t = work0 if t is None else t
    step = _state["step"]
    if _state["begin"] is None and step == 0:
        # no batch/forward/backward seen: step 0 began with the first activity, else at the
        # optimizer's creation
        first = _state["first_activity"]
        if _state["opt_created_t"] is not None and (first is None or first[0] < _state["opt_created_t"]):
            first = (_state["opt_created_t"], "optimizer_created")
        if first is not None:
            _begin_step0(min(first[0], t), first[1], retro=True)
    begin = _state["begin"]
    fields = {"skipped_optimizer_steps": _state["skipped"]} if _state["skipped"] else {}
    _state["skipped"] = 0
    if step == 0:  # a marker-only job shows no other training evidence: py-spy follows it now
        training_evidence("step")
    emit(
        "step_end",
        step=step,
        t=t,
        source=source,
        duration_s=None if begin is None else (t - begin) / 1e9,
        **fields,
    )
    parts = stepwork.evidence(step, None if begin is None else t - begin, _state["torch"], _trains_here())
    _after_step(step)
    _state["step"] = step + 1
    _state["train_thread"] = threading.get_ident()
    asked, why = _requested_stop()
    if (MAX_STEPS and step + 1 >= MAX_STEPS) or (asked and step + 1 >= asked):
        # stop at the first batch/forward/backward/optimizer step of the next iteration, so
        # the job's own end-of-iteration code (its log line, its loss) still runs for this step
        _state["stop_pending"] = True
        emit(
            schema.STOP_REQUESTED,
            step=step,
            reason=f"--steps {MAX_STEPS}" if MAX_STEPS and step + 1 >= MAX_STEPS else why,
        )
        _sync_forward_hook()
    mark = time.time_ns()
    _on_purpose[0] = False
    _begin(t, retro=retro)
    done = time.time_ns()
    cpu = time.thread_time_ns() - cpu0
    parts["step.begin"] = done - mark  # the boundary hooks: a torch.profiler window's export
    # the work after the boundary is the next step's time, and traindx's line of its ledger; the
    # hooks' every-step work (the anomaly check, the GPU clock's marks) is a per-step cost
    hunting = parts.pop("hunting", 0)
    purpose = (parts["step.begin"] if _on_purpose[0] else 0) + (parts["step.mem"] if hunting else 0)
    if purpose:  # the parts on purpose are stated once, never in the per-step parts
        parts = {
            k: v
            for k, v in parts.items()
            if not (k == "step.begin" and _on_purpose[0]) and not (k == "step.mem" and hunting)
        }
    selfcost.step_end_work(done - work0, parts, purpose, cpu)
    emit("span", cat="traindx", start=max(t, work0), t=done, tid=threading.get_ident())


def _after_step(step: int) -> None:
    """The forward's discovery ends after DISCOVER_STEPS steps; the host sampler follows the
    thread that ends the steps."""
    if not _trains_here():
        return
    if _forward["discovering"] and step + 1 >= DISCOVER_STEPS:
        _discovered()
    tid = threading.get_ident()
    if tid != _state["train_thread"]:
        hostsample.start(tid)


def _trains_here() -> bool:
    """This process is the one that imported the shim, or one that showed training evidence
    (a fork-started rank); never a DataLoader worker."""
    return os.getpid() == _PID or is_training()


def _stop_now(where: str) -> None:
    # only the training thread stops, never a DataLoader worker or a prefetch thread
    if os.getpid() != _PID or threading.get_ident() != _state["train_thread"]:
        return
    _state["stop_pending"] = False
    emit("stop", step=_state["step"], at=where)
    w = get_writer()
    if w is not None:
        w.flush()
    raise SystemExit(0)


# -- activity: what begins step 0 and where a pending stop happens --------------------------------
def _activity(what: str) -> None:
    if _state["marker_in_main"] and not _state["marker_installed"]:
        _install_marker_in_main()
    if _state["stop_pending"]:
        _stop_now(what)
    if _state["begin"] is not None:
        return
    if _state["opt_created_t"] is not None:
        torch = _state["torch"]
        if what != "backward" and torch is not None and not torch.is_grad_enabled():
            return  # an evaluation before training (Lightning's sanity check) is still set-up
        if threading.get_ident() == _state["opt_thread"]:
            _begin_step0(time.time_ns(), what)
    elif _state["first_activity"] is None:
        _state["first_activity"] = (time.time_ns(), what)
        _sync_forward_hook()


def _guarded_activity(what: str) -> None:
    try:
        _activity(what)
    except SystemExit:
        raise
    except Exception as exc:
        report_error(f"step activity ({what})", exc)


_forward["activity"] = _guarded_activity  # what the module-call wrapper does while active


# -- optimizer steps ------------------------------------------------------------------------------
def _outer_pre(key: int) -> None:
    """An outermost optimizer step begins."""
    if _state["stop_pending"]:
        _stop_now("optimizer step")
    if _state["mode"] != "auto":
        return
    if key in _cycle_keys:
        # stepping again before the closer: the iteration ended at the previous outermost step
        # (the first iteration, or the job switched optimizers)
        last_key, t_end, source = _cycle[-1]
        _state["closer"] = last_key
        _state["learning"] = False
        _state["unseen"] = set()
        _clear_cycle()
        _end(source, t_end, retro=True)
        if _state["stop_pending"]:
            _stop_now("optimizer step")  # this iteration is already past its start


def _clear_cycle() -> None:
    del _cycle[:]
    _cycle_keys.clear()


def _outer_done(key: int, source: str, skipped: bool) -> None:
    """An outermost optimizer step returned (`skipped`: it did not update the weights)."""
    if skipped:
        _state["skipped"] += 1
    _state["stepped"] = True
    if _state["mode"] != "auto":
        return
    t = time.time_ns()
    if key == _state["closer"]:
        _clear_cycle()
        _end(source, t)
        return
    _cycle.append([key, t, source])
    _cycle_keys.add(key)
    if _state["learning"]:
        unseen = _state["unseen"]
        unseen.discard(key)
        if not unseen:
            # every optimizer the job made has stepped (or steps inside another): this one closes
            _state["closer"] = key
            _state["learning"] = False
            _clear_cycle()
            _end(source, t)


def _push(kind: str, key: int) -> list[Any]:
    if _stack:
        _stack[-1][2] += 1
        if kind == "torch" and not any(frame[1] == key for frame in _stack) and key not in _state["nested"]:
            _state["nested"].add(key)
            _state["unseen"].discard(key)
    frame = [kind, key, 0]
    _stack.append(frame)
    return frame


def _torch_pre_hook(optimizer: object, args: object, kwargs: object) -> None:
    try:
        key = id(optimizer)
        for i in range(len(_stack) - 1, -1, -1):
            if _stack[i][0] == "torch" and _stack[i][1] == key:
                del _stack[i:]  # left behind by a step that raised
                break
        if not _stack:
            _outer_pre(key)
        _push("torch", key)
    except SystemExit:
        raise
    except Exception as exc:
        report_error("optimizer pre hook", exc)


def _torch_post_hook(optimizer: object, args: object, kwargs: object) -> None:
    try:
        key = id(optimizer)
        for i in range(len(_stack) - 1, -1, -1):
            if _stack[i][0] == "torch" and _stack[i][1] == key:
                del _stack[i:]
                if i == 0:
                    _outer_done(key, "torch.optim", skipped=False)
                return
    except Exception as exc:
        report_error("optimizer post hook", exc)


def _wrap_outer_step(
    step_fn: Callable[..., Any],
    source: str,
    key_of: Callable[[Any, tuple[Any, ...], dict[str, Any]], int],
    skip_when_empty: Callable[[Any], bool],
) -> Callable[..., Any]:
    """A step method that is an optimizer step of its own (GradScaler.step, Megatron's, DeepSpeed's):
    outermost, it marks the boundary even when it does not call the inner optimizer."""

    @functools.wraps(step_fn)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = not _stack
        frame = None
        try:
            key = key_of(self, args, kwargs)
            if outer:
                _outer_pre(key)
            frame = _push("wrap", key)
        except SystemExit:
            raise
        except Exception as exc:
            report_error(f"{source} step hook", exc)
        try:
            return step_fn(self, *args, **kwargs)
        finally:
            if frame is not None:
                try:
                    for i in range(len(_stack) - 1, -1, -1):
                        if _stack[i] is frame:
                            del _stack[i:]
                            break
                    if outer:
                        _outer_done(frame[1], source, skipped=frame[2] == 0 and skip_when_empty(self))
                except Exception as exc:
                    report_error(f"{source} step hook", exc)

    step.__traindx_wrapped__ = True  # type: ignore[attr-defined]  # a function's own attribute
    return step


def _scaler_key(scaler: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    return id(args[0] if args else kwargs.get("optimizer"))


def _scaler_skips(scaler: object) -> bool:
    # a disabled scaler calls optimizer.step() itself; an enabled one skips it on inf grads
    return bool(getattr(scaler, "_enabled", True))


# -- backward: the fallback boundary and an activity ----------------------------------------------
def _wrap_backward(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def backward(*args: Any, **kwargs: Any) -> Any:
        if _state["backward_depth"]:
            return fn(*args, **kwargs)  # Tensor.backward calls torch.autograd.backward
        _guarded_activity("backward")
        _state["backward_depth"] += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            _state["backward_depth"] -= 1
        if _state["mode"] == "auto" and not _state["created"] and not _state["stepped"] and not _stack:
            try:
                _end("backward")  # no optimizer in this job: one backward, one step
            except Exception as exc:
                report_error("backward step boundary", exc)
        return out

    return backward


# -- the step marker ------------------------------------------------------------------------------
def marker(source: str = "traindx.step") -> None:
    """One iteration ended (traindx.step(), --step-marker)."""
    try:
        if _state["stop_pending"]:
            _stop_now(source)
        _state["marker_calls"] += 1
        _end(source)
    except SystemExit:
        raise
    except Exception as exc:
        report_error("step marker", exc)


# -- installation ---------------------------------------------------------------------------------
@guarded("torch import hook")
def _on_torch(torch: Any) -> None:
    _state["torch"] = torch
    # torch is imported here only once the job has imported it: the shim never imports it first
    from torch.optim.optimizer import (
        Optimizer,
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    register_optimizer_step_pre_hook(_torch_pre_hook)
    register_optimizer_step_post_hook(_torch_post_hook)
    original_init = Optimizer.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        try:
            _state["created"] += 1
            if _state["learning"]:
                _state["unseen"].add(id(self))
            if _state["opt_created_t"] is None:
                _state["opt_created_t"] = time.time_ns()
                _state["opt_thread"] = threading.get_ident()
                emit(
                    "optimizer_created",
                    optimizer=type(self).__name__,
                    params=optinfo.trained_params(self),
                    **optinfo.implementation(self),
                )
                _sync_forward_hook()
        except Exception as exc:
            report_error("optimizer init hook", exc)

    Optimizer.__init__ = __init__

    scaler = torch.amp.GradScaler
    if not getattr(scaler.step, "__traindx_wrapped__", False):
        scaler.step = _wrap_outer_step(scaler.step, "grad_scaler", _scaler_key, _scaler_skips)
    torch.save = _without_forward_hooks(torch.save)
    torch.Tensor.backward = _wrap_backward(torch.Tensor.backward)
    torch.autograd.backward = _wrap_backward(torch.autograd.backward)
    _sync_forward_hook()
    if _state["marker_in_main"]:
        _install_marker_in_main()


@guarded("DataLoader step hook")
def _on_dataloader(module: Any) -> None:
    cls = module._BaseDataLoaderIter
    original = cls.__next__

    def __next__(self: Any) -> Any:
        _guarded_activity("batch")
        return original(self)

    cls.__next__ = __next__


@guarded("megatron import hook")
def _on_megatron_optimizer(module: ModuleType) -> None:
    for name in dir(module):
        cls = getattr(module, name)
        if not isinstance(cls, type) or "step" not in vars(cls):
            continue
        if not any(base.__name__ == "MegatronOptimizer" for base in cls.__mro__):
            continue
        megatron_cls: Any = cls  # one with a step of its own (checked above)
        megatron_cls.step = _wrap_outer_step(
            megatron_cls.step, "megatron", lambda self, a, k: id(self), lambda self: True
        )
    _state["megatron"] = True


@guarded("deepspeed import hook")
def _on_deepspeed_engine(module: Any) -> None:
    # DeepSpeedEngine.step runs every micro-batch; _take_model_step once per optimizer step,
    # also when an fp16 overflow makes the ZeRO optimizer skip the update
    cls = module.DeepSpeedEngine
    cls._take_model_step = _wrap_outer_step(
        cls._take_model_step, "deepspeed", lambda self, a, k: id(self), lambda self: True
    )


def register() -> None:
    set_step_end(marker)  # a wrapped --step-marker function ends steps through it
    importhooks.on_import("torch", _on_torch)
    importhooks.on_import("torch._dynamo.eval_frame", guarded("dynamo import hook")(_skip_in_dynamo))
    importhooks.on_import("torch.utils.data.dataloader", _on_dataloader)
    importhooks.on_import("megatron.core.optimizer.optimizer", _on_megatron_optimizer)
    importhooks.on_import("deepspeed.runtime.engine", _on_deepspeed_engine)
    importhooks.on_import("traindx", _on_traindx)
    if MARKER_SPEC:
        module_name, _ = _marker_target()
        _state["marker_in_main"] = _marker_in_main()
        if module_name != "__main__":
            importhooks.on_import(module_name, _on_marker_module)

        atexit.register(_marker_never_found)
