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

import functools
import os
import sys
import threading
import time

from . import (
    bus,
    control,
    cpustat,
    emit,
    gcstats,
    get_writer,
    guarded,
    hostsample,
    importhooks,
    is_training,
    report_error,
    schema,
    training_evidence,
)

MAX_STEPS = int(os.environ.get("TRAINDX_MAX_STEPS") or 0)
MARKER_SPEC = (os.environ.get("TRAINDX_STEP_MARKER") or "").strip()
_PID = os.getpid()


def _requested_stop():
    """(steps, reason) once `diagnose --until-diagnosed` asked every rank to stop at one step
    (control/stop.json); (0, "") until then."""
    request = control.read("stop.json")
    if not request:
        return 0, ""
    try:
        return max(int(request.get("steps", 0)), 1), str(request.get("reason", "diagnose"))[:200]
    except (TypeError, ValueError):
        return 0, ""


_state = {
    "step": 0,
    "begin": None,
    "torch": None,
    "megatron": False,
    "mode": "marker" if MARKER_SPEC else "auto",  # "marker": only markers end steps
    "marker_calls": 0,
    "stop_pending": False,
    "train_thread": None,
    "opt_created_t": None,
    "opt_thread": None,  # the first optimizer: arms step 0's begin
    "first_activity": None,  # (t, what) of the first batch/forward/backward since torch import
    "stepped": False,  # an outermost optimizer step completed at least once
    "closer": None,  # key of the optimizer whose outermost step ends an iteration
    "learning": True,  # the closer of the first iteration is not known yet
    "unseen": set(),  # created optimizers not yet seen stepping (learning only)
    "created": 0,
    "nested": set(),
    "skipped": 0,
    "backward_depth": 0,
    "marker_installed": False,
    "marker_in_main": False,
}
# outermost optimizer steps since the last boundary: [key, t_end, source], and their keys
_cycle = []
_cycle_keys = set()
# running step calls, outermost first: [kind, key, calls nested directly inside]
_stack = []


def current_step():
    return _state["step"]


def in_step_since():
    return _state["begin"]


# called at each step boundary with the step about to begin (the torch.profiler window)
boundary_hooks = []


def _call_boundary_hooks(step):
    for hook in boundary_hooks:
        try:
            hook(step)
        except Exception as exc:
            report_error("step boundary hook", exc)


def _begin(t, retro=False):
    if boundary_hooks:
        _call_boundary_hooks(_state["step"])
        if not retro:
            t = time.time_ns()  # what a hook costs (a trace export) falls between steps, not in one
    _state["begin"] = t
    emit("step_begin", step=_state["step"], t=t)


def _begin_step0(t, by, retro=False):
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


def kernel_compile_started(t):
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


def _end(source, t=None, retro=False):
    t = time.time_ns() if t is None else t
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
    gcstats.emit_step(step)
    try:
        cpustat.emit_step(step)
        if _trains_here():
            cpustat.emit_threads(step, _state["torch"])
    except Exception as exc:
        report_error("cpu evidence", exc)
    hostsample.flush(step)
    bus.publish(schema.STEP_ENDED, step)  # compiles: torch.compile's metrics of this step
    _emit_alloc(step)
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
    _begin(t, retro=retro)


def _after_step(step):
    """The forward's discovery ends after DISCOVER_STEPS steps; the host sampler follows the
    thread that ends the steps."""
    if not _trains_here():
        return
    if _forward["discovering"] and step + 1 >= DISCOVER_STEPS:
        _discovered()
    tid = threading.get_ident()
    if tid != _state["train_thread"]:
        hostsample.start(tid)


def _trains_here():
    """This process is the one that imported the shim, or one that showed training evidence
    (a fork-started rank); never a DataLoader worker."""
    return os.getpid() == _PID or is_training()


def _stop_now(where):
    # only the training thread stops, never a DataLoader worker or a prefetch thread
    if os.getpid() != _PID or threading.get_ident() != _state["train_thread"]:
        return
    _state["stop_pending"] = False
    emit("stop", step=_state["step"], at=where)
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
    keep = (
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
    emit("alloc", step=step, **{k.replace(".", "_"): stats.get(k) for k in keep})


# -- activity: what begins step 0 and where a pending stop happens --------------------------------
def _activity(what):
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


def _guarded_activity(what):
    try:
        _activity(what)
    except SystemExit:
        raise
    except Exception as exc:
        report_error(f"step activity ({what})", exc)


_forward = {"active": False, "wrapper": None, "original": None, "discovering": True, "is_compiling": None}
# 1 while the training thread is inside its outermost module call (the wrapper's inner calls)
_forward_depth = [0]
# the modules the training thread called outermost while discovering: {id: weakref}
_top_modules = {}
_hooked = {}  # id -> hook handles of the modules timed by their own hooks
_hook_start = {}  # id(module) -> start ns of its running outermost call
DISCOVER_STEPS = 2  # steps 0 and 1 find the outermost modules; then their hooks time them
# called with (start_ns, end_ns) after each outermost module call of the training thread
forward_hooks = []


def _sync_forward_hook():
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


def _install_wrapper(torch):
    module_cls = torch.nn.Module
    original = module_cls.__call__
    compiler = torch.compiler
    # a flag read (~20 ns); is_compiling also asks the exporter (~0.5 µs): too dear per call
    is_compiling = getattr(compiler, "is_dynamo_compiling", None) or compiler.is_compiling
    _forward["is_compiling"] = is_compiling
    grad_enabled = torch.is_grad_enabled
    depth, now, ident = _forward_depth, time.time_ns, threading.get_ident

    def __call__(self, *args, **kwargs):
        # first: while dynamo traces, nothing below is read (no guard on our state)
        if is_compiling() or depth[0]:
            return original(self, *args, **kwargs)
        if _forward["active"]:
            _guarded_activity("forward")
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
            _forward_done(start, now(), tid, grad_enabled())

    _forward["wrapper"], _forward["original"] = __call__, original
    module_cls.__call__ = __call__
    _skip_in_dynamo(sys.modules.get("torch._dynamo.eval_frame"))


def _remember_module(module):
    import weakref

    key = id(module)
    try:
        _top_modules[key] = weakref.ref(module, lambda _r, key=key: _top_modules.pop(key, None))
    except TypeError:
        pass


def _discovered():
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


def _register_hooks(key, module):
    _hooked[key] = (
        module.register_forward_pre_hook(_module_pre),
        module.register_forward_hook(_module_post, always_call=True),
    )


def _without_forward_hooks(save):
    """torch.save of a whole module pickles its hooks: ours would then need the shim to load.
    They are taken off for the save and put back after it."""

    @functools.wraps(save)
    def torch_save(*args, **kwargs):
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


def _module_pre(module, args):
    check = _forward["is_compiling"]
    if check is not None and check():
        return None
    if threading.get_ident() == _state["train_thread"] and not _forward_depth[0]:
        _hook_start.setdefault(id(module), time.time_ns())
    return None


def _module_post(module, args, output):
    check = _forward["is_compiling"]
    if check is not None and check():
        return None
    start = _hook_start.pop(id(module), None)
    if start is not None:
        torch = _state["torch"]
        _forward_done(
            start,
            time.time_ns(),
            threading.get_ident(),
            torch.is_grad_enabled() if torch is not None else True,
        )
    return None


def _forward_done(start, end, tid, grad):
    try:
        if grad:
            emit("span", cat="forward", start=start, t=end, tid=tid)
        else:  # an evaluation's forward (no_grad): the same line, told apart for the judge
            emit("span", cat="forward", start=start, t=end, tid=tid, grad=False)
        for hook in forward_hooks:
            hook(start, end)
    except Exception as exc:
        report_error("forward span", exc)


def _skip_in_dynamo(eval_frame):
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


# -- optimizer steps ------------------------------------------------------------------------------
def _outer_pre(key):
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


def _clear_cycle():
    del _cycle[:]
    _cycle_keys.clear()


def _outer_done(key, source, skipped):
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


def _push(kind, key):
    if _stack:
        _stack[-1][2] += 1
        if kind == "torch" and not any(frame[1] == key for frame in _stack) and key not in _state["nested"]:
            _state["nested"].add(key)
            _state["unseen"].discard(key)
    frame = [kind, key, 0]
    _stack.append(frame)
    return frame


def _torch_pre_hook(optimizer, args, kwargs):
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


def _torch_post_hook(optimizer, args, kwargs):
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


def _wrap_outer_step(step_fn, source, key_of, skip_when_empty):
    """A step method that is an optimizer step of its own (GradScaler.step, Megatron's, DeepSpeed's):
    outermost, it marks the boundary even when it does not call the inner optimizer."""

    @functools.wraps(step_fn)
    def step(self, *args, **kwargs):
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

    step.__traindx_wrapped__ = True
    return step


def _scaler_key(scaler, args, kwargs):
    return id(args[0] if args else kwargs.get("optimizer"))


def _scaler_skips(scaler):
    # a disabled scaler calls optimizer.step() itself; an enabled one skips it on inf grads
    return bool(getattr(scaler, "_enabled", True))


# -- backward: the fallback boundary and an activity ----------------------------------------------
def _wrap_backward(fn):
    @functools.wraps(fn)
    def backward(*args, **kwargs):
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
def marker(source="traindx.step"):
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


def _on_traindx(module):
    # a job that imports traindx marks its own steps with traindx.step(): from now on only
    # markers end steps (deciding at the first call would be too late: the optimizer steps of
    # that first iteration would already be steps of their own)
    if _state["mode"] != "marker":
        _state["mode"] = "marker"
        emit("step_marker", source="traindx.step", step=_state["step"])
        import atexit

        atexit.register(_marker_never_called)


def _marker_never_called():
    if not _state["marker_calls"]:
        report_error(
            "traindx.step",
            LookupError("the job imported traindx but never called traindx.step(): no steps were marked"),
        )


def _marker_target():
    module_name, _, qualname = MARKER_SPEC.partition(":")
    return module_name, qualname


def _install_marker(module):
    """Wrap `qualname` in `module`: each return of it ends a step."""
    if _state["marker_installed"]:
        return True
    _, qualname = _marker_target()
    owner = module
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part, None)
        if owner is None:
            return False
    name = parts[-1]
    raw = vars(owner).get(name) if hasattr(owner, "__dict__") else None
    if raw is None:
        raw = getattr(owner, name, None)
    if raw is None:
        return False
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    fn = raw.__func__ if kind else raw
    if not callable(fn):
        return False

    @functools.wraps(fn)
    def marked(*args, **kwargs):
        out = fn(*args, **kwargs)
        marker("--step-marker")
        return out

    setattr(owner, name, kind(marked) if kind else marked)
    _state["marker_installed"] = True
    emit("step_marker_installed", target=MARKER_SPEC)
    return True


def _marker_in_main():
    """Whether --step-marker names a function of the script itself (`__main__` or its name)."""
    module_name, _ = _marker_target()
    stem = os.path.splitext(os.path.basename(sys.argv[0] if sys.argv else ""))[0]
    return module_name in ("__main__", stem)


def _install_marker_in_main():
    # the script's functions exist only once its top level has run: retried at each activity
    main = sys.modules.get("__main__")
    if main is not None and _state["marker_in_main"]:
        _install_marker(main)


def _on_marker_module(module):
    if not _install_marker(module):
        report_error("--step-marker", LookupError(f"{MARKER_SPEC}: no such function in that module"))


def _marker_never_found():
    if MARKER_SPEC and not _state["marker_installed"]:
        report_error(
            "--step-marker",
            LookupError(f"{MARKER_SPEC}: the job never defined that function; no step was marked by it"),
        )


# -- installation ---------------------------------------------------------------------------------
@guarded("torch import hook")
def _on_torch(torch):
    _state["torch"] = torch
    from torch.optim.optimizer import (
        Optimizer,
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    register_optimizer_step_pre_hook(_torch_pre_hook)
    register_optimizer_step_post_hook(_torch_post_hook)
    original_init = Optimizer.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        try:
            _state["created"] += 1
            if _state["learning"]:
                _state["unseen"].add(id(self))
            if _state["opt_created_t"] is None:
                _state["opt_created_t"] = time.time_ns()
                _state["opt_thread"] = threading.get_ident()
                emit("optimizer_created", optimizer=type(self).__name__)
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
def _on_dataloader(module):
    cls = module._BaseDataLoaderIter
    original = cls.__next__

    def __next__(self):
        _guarded_activity("batch")
        return original(self)

    cls.__next__ = __next__


@guarded("megatron import hook")
def _on_megatron_optimizer(module):
    for name in dir(module):
        cls = getattr(module, name)
        if not isinstance(cls, type) or "step" not in vars(cls):
            continue
        if not any(base.__name__ == "MegatronOptimizer" for base in cls.__mro__):
            continue
        cls.step = _wrap_outer_step(cls.step, "megatron", lambda self, a, k: id(self), lambda self: True)
    _state["megatron"] = True


@guarded("deepspeed import hook")
def _on_deepspeed_engine(module):
    # DeepSpeedEngine.step runs every micro-batch; _take_model_step once per optimizer step,
    # also when an fp16 overflow makes the ZeRO optimizer skip the update
    cls = module.DeepSpeedEngine
    cls._take_model_step = _wrap_outer_step(
        cls._take_model_step, "deepspeed", lambda self, a, k: id(self), lambda self: True
    )


def register():
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
        import atexit

        atexit.register(_marker_never_found)
