"""Process-wide switches that tax every op or step: recorded when torch is imported and each time
the job changes one, with the job's line that did it (`switch` events).

- autograd anomaly detection (`torch.set_anomaly_enabled`, which `set_detect_anomaly` and the
  `detect_anomaly` context call), deterministic algorithms, the default dtype, the intra-op
  thread count, CUDA memory-history recording: their setters are wrapped (one stack walk per
  call of a setter, nothing per op);
- a profiler the job started itself (torch.profiler / torch.autograd.profiler `profile`, entered
  or started from the job's code, never traindx's own window), a tracer or profile function the
  job set (`sys.settrace` / `sys.setprofile` / `threading.settrace`), `tracemalloc.start`;
- Python's development mode, and the debug variables of torch, dynamo, NCCL and the distributed
  package (`CUDA_LAUNCH_BLOCKING`, `TORCH_LOGS`, `NCCL_DEBUG`, ...) as the process sees them at
  torch's import: `set_by` says whether the environment or the job's own code set them.

A --fix candidate arm turns one off (`TRAINDX_RUNTIME_PATCHES=switch_off:<name>`): the wrapped
setter is called with the switch off, an environment variable is unset before the job starts and
again at torch's import. Events per switch are capped (a `with detect_anomaly():` every step
toggles it twice a step); the state is polled at nothing per op.
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
import threading
import weakref

from . import emit, forward, importhooks, report_error, schema, steps
from .frames import describe, first_user_frame, is_library_file
from .runtime_patches import requested

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

OFF_PREFIX = "switch_off:"
MAX_EVENTS_PER_SWITCH = 20
# debug variables that cost time in every op, launch, collective or compile, with the values
# that turn them on ("*": any non-empty value but the listed off values)
DEBUG_ENV: dict[str, tuple[str, ...]] = {
    "CUDA_LAUNCH_BLOCKING": ("1", "true", "yes", "on"),
    "PYTORCH_NO_CUDA_MEMORY_CACHING": ("*",),
    "TORCH_LOGS": ("*",),
    "TORCHDYNAMO_VERBOSE": ("1", "true"),
    "TORCH_COMPILE_DEBUG": ("1", "true"),
    "TORCHINDUCTOR_DEBUG": ("1", "true"),
    "TORCH_SHOW_CPP_STACKTRACES": ("1", "true"),
    "TORCH_CPP_LOG_LEVEL": ("info", "0"),
    "TORCH_DISTRIBUTED_DEBUG": ("detail", "info"),
    "NCCL_DEBUG": ("info", "trace"),
    "TORCH_NCCL_BLOCKING_WAIT": ("1",),
    "NCCL_BLOCKING_WAIT": ("1",),
    "TORCH_NCCL_DESYNC_DEBUG": ("1",),
    "PYTHONTRACEMALLOC": ("*",),
    "PYTHONMALLOC": ("debug", "malloc_debug", "pymalloc_debug"),
}
PROFILER_FILES = ("torch/profiler/profiler.py", "torch/autograd/profiler.py")
_OFF_VALUES = ("", "0", "false", "off", "no", "warn", "warning", "error")
_counts: dict[str, int] = {}
_last: dict[str, Any] = {}
_start_env = {k: os.environ.get(k) for k in DEBUG_ENV}  # as the process started (before the job ran)


def _off(name: str) -> bool:
    return OFF_PREFIX + name in requested()


def env_on(name: str, value: str | None) -> bool:
    if value is None:
        return False
    v = value.strip().lower()
    wanted = DEBUG_ENV.get(name, ())
    if "*" in wanted:
        return v not in _OFF_VALUES
    return v in wanted


def _record(
    name: str, value: Any, on: bool, via: str, where: dict[str, Any] | None = None, **extra: Any
) -> None:
    """One `switch` event, when the value changed and under the cap."""
    key = (value, on)
    if _last.get(name) == key:
        return
    _last[name] = key
    n = _counts.get(name, 0) + 1
    _counts[name] = n
    if n > MAX_EVENTS_PER_SWITCH:
        return
    source = linecache.getline(where["file"], where["line"]).strip() if where else None
    emit(
        schema.SWITCH,
        name=name,
        value=value,
        on=on,
        via=via,
        caller=where,
        source=source or None,
        step=steps.current_step(),
        changes=n,
        **extra,
    )


def _job_caller(via: tuple[str, ...] | None) -> dict[str, Any] | None:
    """The job's frame that called the hooked setter, or None when the call is not the job's: it
    came through traindx's own shim (its profiler window), or through library code other than the
    files `via` allows (torch's anomaly_mode.py for `set_detect_anomaly`): an internal save and
    restore of the state, not the job's choice. via None: any library frames on the way."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if "_traindx_shim" in filename:
            return None
        if not is_library_file(filename):
            return describe(frame)
        if via is not None and not filename.replace(os.sep, "/").endswith(via):
            return None
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _setter(
    name: str,
    original: Callable[..., Any],
    judge: Callable[..., tuple[Any, bool]],
    off: Callable[..., Any] | None,
    via: tuple[str, ...],
) -> Callable[..., Any]:
    """A wrapper of a setter: records what the job set and where; in a candidate arm that turns
    the switch off, calls `off(original, *args)` instead."""
    turned_off = off is not None and _off(name)

    @functools.wraps(original)
    def setter(*args: Any, **kwargs: Any) -> Any:
        try:
            value, on = judge(*args, **kwargs)
            where = _job_caller(via)
            if where is not None:  # a call of the job's (traindx's own and torch's internal calls are not)
                _record(name, value, on, "setter", where, forced_off=bool(turned_off and on))
        except Exception as exc:
            report_error(f"{name} switch hook", exc)
            return original(*args, **kwargs)
        if turned_off and on and off is not None:
            return off(original, *args, **kwargs)
        return original(*args, **kwargs)

    return setter


def _anomaly(mode: Any, *args: Any, **kwargs: Any) -> tuple[Any, bool]:
    return bool(mode), bool(mode)


def _anomaly_off(original: Callable[..., Any], mode: Any, *args: Any, **kwargs: Any) -> Any:
    return original(False, *args, **kwargs)


def _deterministic(mode: Any, *args: Any, **kwargs: Any) -> tuple[Any, bool]:
    return bool(mode), bool(mode)


def _dtype(dtype: Any, *args: Any, **kwargs: Any) -> tuple[Any, bool]:
    text = str(dtype)
    return text, text in ("torch.float64", "torch.double", "torch.complex128")


def _threads(n: Any, *args: Any, **kwargs: Any) -> tuple[Any, bool]:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    n = int(n)
    return n, n < max(1, cores // 4) or n > cores


def _skip(original: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    return None


def _memory_history(enabled: Any = "all", *args: Any, **kwargs: Any) -> tuple[Any, bool]:
    value = kwargs.get("enabled", enabled)
    return str(value), value not in (None, False)


def _memory_history_off(original: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    return None


def _wrap(
    module: Any,
    attr: str,
    name: str,
    judge: Callable[..., tuple[Any, bool]],
    off: Callable[..., Any] | None,
    via: tuple[str, ...] = (),
) -> None:
    original = getattr(module, attr, None)
    if original is None or getattr(original, "_traindx_switch", False):
        return
    wrapped = _setter(name, original, judge, off, via)
    wrapped._traindx_switch = True  # type: ignore[attr-defined]
    setattr(module, attr, wrapped)


def _on_torch(torch: Any) -> None:
    _wrap(torch, "set_anomaly_enabled", "anomaly", _anomaly, _anomaly_off, ("autograd/anomaly_mode.py",))
    _wrap(torch, "use_deterministic_algorithms", "deterministic", _deterministic, _anomaly_off)
    _wrap(torch, "set_default_dtype", "default_dtype", _dtype, _skip)
    _wrap(torch, "set_num_threads", "num_threads", _threads, _skip)
    _initial(torch)


def _initial(torch: Any) -> None:
    """The state at torch's import: the environment's variables, Python's dev mode."""
    _unset_requested_env()
    for name in DEBUG_ENV:
        value = os.environ.get(name)
        if env_on(name, value):
            set_by = "environment" if _start_env.get(name) == value else "job"
            _record("env:" + name, value, True, "environment", None, set_by=set_by)
    if getattr(sys.flags, "dev_mode", False):
        _record("python_dev_mode", True, True, "environment", None, set_by="environment")
    try:
        if torch.is_anomaly_enabled():
            _record("anomaly", True, True, "initial", None)
    except Exception:
        pass


def _unset_requested_env() -> None:
    for name in DEBUG_ENV:
        if _off("env:" + name) and name in os.environ:
            del os.environ[name]


def _on_cuda_memory(module: Any) -> None:
    _wrap(module, "_record_memory_history", "memory_history", _memory_history, _memory_history_off)


def _profile_class(cls: Any, name: str) -> None:
    """A profiler the job entered or started: `profiler` on at its enter/start, off at its
    exit/stop (the job's own frames only: traindx's window runs from the shim's)."""
    for attr, on in (("__enter__", True), ("start", True), ("__exit__", False), ("stop", False)):
        original = cls.__dict__.get(attr)
        if original is None or getattr(original, "_traindx_switch", False):
            continue

        def method(self: Any, *args: Any, _original: Any = original, _on: bool = on, **kwargs: Any) -> Any:
            try:
                where = _job_caller(PROFILER_FILES)
                if where is not None:
                    _record("profiler", name if _on else None, _on, "setter", where)
            except Exception as exc:
                report_error("profiler switch hook", exc)
            return _original(self, *args, **kwargs)

        method._traindx_switch = True  # type: ignore[attr-defined]
        functools.update_wrapper(method, original)
        setattr(cls, attr, method)


def _on_torch_profiler(module: Any) -> None:
    cls = getattr(module, "profile", None)
    if cls is not None:
        _profile_class(cls, f"{module.__name__}.profile")


def _trace_setter(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    turned_off = _off("trace")

    @functools.wraps(original)
    def settrace(fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            where = _job_caller(None)
            if where is not None:
                label = getattr(fn, "__qualname__", None) or type(fn).__name__ if fn is not None else None
                _record("trace", label, fn is not None, "setter", where, setter=name)
                if turned_off and fn is not None:
                    return None
        except Exception as exc:
            report_error("trace switch hook", exc)
        return original(fn, *args, **kwargs)

    return settrace


def _on_tracemalloc(module: Any) -> None:
    _wrap(module, "start", "tracemalloc", lambda *a, **k: (True, True), _skip)


def install_trace_hooks() -> None:
    """sys.settrace / sys.setprofile / threading.settrace|setprofile of the job."""
    for owner, attr in (
        (sys, "settrace"),
        (sys, "setprofile"),
        (threading, "settrace"),
        (threading, "setprofile"),
    ):
        original = getattr(owner, attr, None)
        if original is None or getattr(original, "_traindx_switch", False):
            continue
        wrapped = _trace_setter(f"{owner.__name__}.{attr}", original)
        wrapped._traindx_switch = True  # type: ignore[attr-defined]
        setattr(owner, attr, wrapped)


_watched: dict[int, Any] = {}  # id(output tensor) -> weakref: evaluation graphs not yet dropped
_used: dict[int, int] = {}  # id(module) -> backward passes seen through its eval-mode outputs
_reported: set[tuple[str, int]] = set()
MAX_WATCHED = 64
USED_ENOUGH = 3  # a module in eval mode whose outputs are backpropagated: trained so on purpose


def _graph_tensor(output: Any) -> Any:
    """The first tensor of a module's output that carries a graph (a tensor, a tuple or list, a
    dict or a ModelOutput), or None."""
    items = (
        output.values()
        if isinstance(output, dict)
        else output
        if isinstance(output, (tuple, list))
        else (output,)
    )
    for item in items:
        if getattr(item, "requires_grad", False) and getattr(item, "grad_fn", None) is not None:
            return item
    return None


def _on_eval_grad(module: Any, output: Any) -> None:
    """An outermost module in eval mode ran with grad enabled: watch its output's graph; dropped
    without a backward through it, the evaluation built a graph nobody used (`eval_grad`, at the
    job's line that called the model). Stack walks only for such calls, bounded."""
    try:
        if len(_watched) >= MAX_WATCHED or _used.get(id(module), 0) >= USED_ENOUGH:
            return
        if _counts.get("eval_grad", 0) >= MAX_EVENTS_PER_SWITCH:
            return
        tensor = _graph_tensor(output)
        where = first_user_frame() if tensor is not None else None
        if where is None or (where["file"], where["line"]) in _reported:
            return
        fired = [False]
        key = id(module)

        def backward_reached(grad: Any) -> None:
            fired[0] = True
            _used[key] = _used.get(key, 0) + 1

        def dropped(ref: Any, site: dict[str, Any] = where, name: str = type(module).__name__) -> None:
            _watched.pop(id(ref), None)
            place = (site["file"], site["line"])
            if not fired[0] and place not in _reported:
                _reported.add(place)
                _record("eval_grad", f"{place[0]}:{place[1]}", True, "forward", site, module=name)

        tensor.register_hook(backward_reached)
        ref = weakref.ref(tensor, dropped)
        _watched[id(ref)] = ref
    except Exception as exc:
        report_error("eval grad hook", exc)


_grad_before: list[bool] = []


def _eval_without_grad(module: Any, entering: bool) -> None:
    """A --fix arm's `switch_off:eval_grad`: an outermost module in eval mode runs without grad."""
    try:
        torch = sys.modules["torch"]
        if entering:
            _grad_before.append(torch.is_grad_enabled())
            torch.set_grad_enabled(False)
        elif _grad_before:
            torch.set_grad_enabled(_grad_before.pop())
    except Exception as exc:
        report_error("eval without grad", exc)


def register() -> None:
    forward.eval_grad_hooks.append(_on_eval_grad)
    if _off("eval_grad"):
        forward.eval_call_hooks.append(_eval_without_grad)
    _unset_requested_env()  # before the job runs: the variables of a candidate that turns them off
    install_trace_hooks()
    importhooks.on_import("torch", _on_torch)
    importhooks.on_import("torch.cuda.memory", _on_cuda_memory)
    importhooks.on_import("torch.profiler.profiler", _on_torch_profiler)
    importhooks.on_import("torch.autograd.profiler", _on_torch_profiler)
    importhooks.on_import("tracemalloc", _on_tracemalloc)
