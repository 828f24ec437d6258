"""Compile events: CuTe DSL (and FA4's compile keys), Triton JIT and autotuning, torch.compile.

Each event says which kernel, how long, on which thread, in which step, and the first frame of
the job's own code on that thread. For FA4 it also keeps the compile key with its field names
and the call's arguments, so a recompile can be explained and replayed (`kernel-cache warm`).
"""

from __future__ import annotations

import atexit
import functools
import inspect
import linecache
import sys
import threading
import time
import weakref

from . import bus, emit, guarded, importhooks, report_error, schema, steps
from .frames import first_user_frame
from .values import (
    _key_field_names,
    is_tensor_like,
)
from .values import _type_label as _type_label  # re-exported
from .values import describe_value as describe_value  # re-exported
from .values import safe_repr as safe_repr  # re-exported: kernel_cache/cli/worker.py

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType, ModuleType
    from typing import Any

FA4_INTERFACE = "flash_attn" + ("\\" if sys.platform == "win32" else "/") + "cute"
FA4_CALL_SAMPLES = 8  # stack walks per (function, argument-type signature); later calls are counted
_fa4_calls = {}
_main_ident = threading.main_thread().ident


def _thread_fields() -> dict[str, Any]:
    th = threading.current_thread()
    return {"thread": th.name, "thread_id": th.ident, "is_main_thread": th.ident == _main_ident}


# kernel compiles and autotunes recorded so far (the torch.profiler window profiles steady steps)
counts: dict[str, int] = {"compiles": 0}


def _emit_compile(
    kind: str, kernel: str | None, start_ns: int, end_ns: int, duration_s: float | None = None, **fields: Any
) -> None:
    counts["compiles"] += 1
    if (
        kind != schema.COMPILE_DYNAMO
    ):  # (torch.compile's graphs for an evaluation before training stay start-up)
        steps.kernel_compile_started(start_ns)
    begin = steps.in_step_since()
    if duration_s is None:
        duration_s = (end_ns - start_ns) / 1e9
    emit(
        schema.COMPILE,
        kind=kind,
        kernel=kernel,
        start=start_ns,
        t=end_ns,
        duration_s=duration_s,
        step=steps.current_step(),
        in_step=begin is not None and start_ns >= begin,
        **_thread_fields(),
        **fields,
    )


def _fa4_context() -> dict[str, Any] | None:
    """The FA4 interface frame that asked for this compile: function, key fields, arguments."""
    f: FrameType | None = sys._getframe(3)
    while f is not None:
        code = f.f_code
        if (
            code.co_filename.endswith("interface.py")
            and FA4_INTERFACE in code.co_filename
            and "compile_key" in f.f_locals
        ):
            break
        f = f.f_back
    if f is None:
        return None
    local = f.f_locals
    key = local.get("compile_key")
    fields = types = None
    if isinstance(key, tuple):
        names = _key_field_names(f.f_code, f.f_lineno, len(key))
        labels = names or [f"key[{i}]" for i in range(len(key))]
        fields = {label: safe_repr(v, 300) for label, v in zip(labels, key)}
        types = {label: _type_label(v) for label, v in zip(labels, key)}
    code = f.f_code
    argnames = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    args = {name: describe_value(local.get(name)) for name in argnames if name in local}
    max_seqlen = {
        name: {
            "type": _type_label(local[name]),
            "value": local[name] if isinstance(local[name], int) else None,
        }
        for name in ("max_seqlen_q", "max_seqlen_k")
        if name in argnames and name in local
    }
    return {
        "function": code.co_name,
        "line": f.f_lineno,
        "key": safe_repr(key, 4000),
        "key_fields": fields,
        "key_types": types,
        "args": args,
        "max_seqlen": max_seqlen,
    }


# -- CuTe DSL ------------------------------------------------------------------------------------
@guarded("cutlass import hook")
def _on_cute_compiler(module: ModuleType) -> None:
    cls = module.CompileCallable
    original = cls._compile

    @functools.wraps(original)
    def _compile(self: Any, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.time_ns()
        ok = False
        try:
            result = original(self, func, *args, **kwargs)
            ok = True
            return result
        finally:
            end = time.time_ns()
            try:
                _record_cute(func, start, end, ok)
            except Exception as exc:
                report_error("cute compile hook", exc)

    cls._compile = _compile


def _kernel_name(func: Callable[..., Any]) -> str:
    bound = getattr(func, "__self__", None)
    if bound is not None:
        return f"{type(bound).__qualname__}.{getattr(func, '__name__', '?')}"
    if inspect.isfunction(func):
        return func.__qualname__
    return type(func).__qualname__


def _record_cute(func: Callable[..., Any], start: int, end: int, ok: bool) -> None:
    fa4 = _fa4_context()
    kernel = _kernel_name(func)
    module = getattr(type(getattr(func, "__self__", None) or func), "__module__", "")
    fields: dict[str, Any] = {"ok": ok, "caller": first_user_frame(2), "module": module}
    if fa4 is not None:
        fields.update(
            key=fa4.pop("key"),
            key_fields=fa4.pop("key_fields"),
            key_types=fa4.pop("key_types"),
            fa4=fa4,
            fa4_call_site=_last_fa4_site.get("site"),
        )
        kernel = f"{fa4['function']}:{kernel}"
    _emit_compile(schema.COMPILE_CUTE_DSL, kernel, start, end, **fields)


# -- FA4 call sites (the forward call is where a framework passes max_seqlen) --------------------
_last_fa4_site = {}


def _fa4_signature(kwargs: Any) -> tuple[Any, ...]:
    return tuple(
        sorted(
            (k, _type_label(v))
            for k, v in kwargs.items()
            if k.startswith("max_seqlen") or k.startswith("cu_seqlens")
        )
    )


@guarded("flash_attn import hook")
def _on_fa4_interface(module: ModuleType) -> None:
    for name in ("flash_attn_varlen_func", "flash_attn_func"):
        original = getattr(module, name, None)
        if original is None:
            continue
        setattr(module, name, _wrap_fa4_entry(name, original))
    # `from flash_attn.cute import flash_attn_varlen_func` binds the package's name: wrap it too
    package = sys.modules.get("flash_attn.cute")
    if package is not None:
        _wrap_package_names(package, module)
    else:
        importhooks.on_import("flash_attn.cute", lambda pkg: _wrap_package_names(pkg, module))


def _wrap_package_names(package: ModuleType, interface: ModuleType) -> None:
    for name in ("flash_attn_varlen_func", "flash_attn_func"):
        wrapped = getattr(interface, name, None)
        current = getattr(package, name, None)
        if wrapped is not None and current is getattr(wrapped, "__wrapped__", None):
            setattr(package, name, wrapped)


def _wrap_fa4_entry(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def entry(*args: Any, **kwargs: Any) -> Any:
        sample = None
        try:
            sig = (name, _fa4_signature(kwargs))
            seen = _fa4_calls.get(sig, 0)
            _fa4_calls[sig] = seen + 1
            if seen < FA4_CALL_SAMPLES:
                caller = first_user_frame(1)
                _last_fa4_site["site"] = caller
                sample = (seen, sig, caller, time.time_ns())
        except Exception as exc:
            report_error("fa4 call hook", exc)
        if sample is None:
            return original(*args, **kwargs)
        ok = False
        try:
            result = original(*args, **kwargs)
            ok = True
            return result
        finally:
            _emit_fa4_call(name, kwargs, sample, ok)

    return entry


def _emit_fa4_call(name: str, kwargs: Any, sample: tuple[Any, Any, Any, int], ok: bool) -> None:
    try:
        seen, sig, caller, start = sample
        end = time.time_ns()
        max_seqlen = {
            k: {"type": _type_label(v), "value": v if isinstance(v, int) else None}
            for k, v in kwargs.items()
            if k.startswith("max_seqlen")
        }
        emit(
            schema.FA4_CALL,
            function=name,
            caller=caller,
            source=_source_line(caller),
            call_index=seen,
            arg_types=dict(sig[1]),
            max_seqlen=max_seqlen,
            start=start,
            t=end,
            duration_s=(end - start) / 1e9,
            step=steps.current_step(),
            ok=ok,
            **_thread_fields(),
        )
    except Exception as exc:
        report_error("fa4 call hook", exc)


def _source_line(where: dict[str, Any] | None) -> str | None:
    if not where:
        return None
    return linecache.getline(where["file"], where["line"]).strip()[:300] or None


# -- Triton --------------------------------------------------------------------------------------
# Autotuning benchmarks every config, and the first run of each config JIT-compiles it: the
# autotune event counts only the benchmarking (`duration_s` = `bench_s`), and the compiles it
# caused are their own `triton` events marked `autotune_of`, so summing durations counts no
# second twice. `wall_s` is what the job waited in all.
_tl = threading.local()


@guarded("triton import hook")
def _on_triton(module: ModuleType) -> None:
    knobs = getattr(module, "knobs", None)
    if knobs is None:
        return
    previous = knobs.compilation.listener

    def listener(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> Any:
        try:
            if not cache_hit:
                total_us = getattr(times, "total", None) or 0
                end = time.time_ns()
                name = getattr(getattr(src, "fn", None), "__name__", None) or getattr(src, "name", "?")
                tuning = getattr(_tl, "autotune", None)
                fields: dict[str, Any] = {}
                if tuning is not None:
                    tuning["jit_ns"] += int(total_us * 1000)
                    tuning["jit_compiles"] += 1
                    fields["autotune_of"] = tuning["kernel"]
                _emit_compile(
                    schema.COMPILE_TRITON,
                    name,
                    end - int(total_us * 1000),
                    end,
                    cache_hit=cache_hit,
                    caller=first_user_frame(1),
                    key=safe_repr(getattr(src, "signature", ""), 2000),
                    **fields,
                )
        except Exception as exc:
            report_error("triton listener", exc)
        if previous:
            return previous(
                src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit
            )

    knobs.compilation.listener = listener


def _autotune_kernel_name(tuner: Any) -> str:
    fn = getattr(tuner, "base_fn", None) or getattr(tuner, "fn", None)
    for _ in range(8):  # Heuristics / nested wrappers hold the JITFunction in .fn
        name = getattr(fn, "__name__", None)
        if isinstance(name, str):
            return name
        fn = getattr(fn, "fn", None)
    return "?"


@guarded("triton autotuner hook")
def _on_triton_autotuner(module: ModuleType) -> None:
    cls = module.Autotuner
    original = cls.run

    @functools.wraps(original)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        tuning: dict[str, Any] | None = None
        previous = None
        try:
            before = len(self.cache)
            previous = getattr(_tl, "autotune", None)
            tuning = {
                "kernel": None,
                "before": before,
                "start": time.time_ns(),
                "bench_ns": 0,
                "bench_time": getattr(self, "bench_time", None),
                "benched": 0,
                "jit_ns": 0,
                "jit_compiles": 0,
                "disk_cache_hit": None,
            }
            _tl.autotune = tuning
            steps.kernel_compile_started(tuning["start"])
        except Exception as exc:
            report_error("triton autotune hook", exc)
        if tuning is None:
            return original(self, *args, **kwargs)
        try:
            tuning["kernel"] = _autotune_kernel_name(self)
        except Exception:
            tuning["kernel"] = "?"
        try:
            return original(self, *args, **kwargs)
        finally:
            _tl.autotune = previous
            try:
                _record_autotune(self, args, kwargs, tuning)
            except Exception as exc:
                report_error("triton autotune hook", exc)

    cls.run = run
    bench = getattr(cls, "_bench", None)
    if bench is not None:

        @functools.wraps(bench)
        def _bench(self: Any, *args: Any, **kwargs: Any) -> Any:
            tuning = getattr(_tl, "autotune", None)
            if tuning is None:
                return bench(self, *args, **kwargs)
            t0 = time.perf_counter_ns()
            try:
                return bench(self, *args, **kwargs)
            finally:
                tuning["bench_ns"] += time.perf_counter_ns() - t0
                tuning["benched"] += 1

        cls._bench = _bench
    check_disk_cache = getattr(cls, "check_disk_cache", None)
    if check_disk_cache is not None:

        @functools.wraps(check_disk_cache)
        def _check_disk_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
            hit = check_disk_cache(self, *args, **kwargs)
            tuning = getattr(_tl, "autotune", None)
            if tuning is not None:
                tuning["disk_cache_hit"] = bool(hit)
            return hit

        cls.check_disk_cache = _check_disk_cache


def _record_autotune(tuner: Any, args: Any, kwargs: Any, tuning: dict[str, Any]) -> None:
    if len(tuner.cache) <= tuning["before"]:
        return  # the key was tuned before: nothing was benchmarked
    bench_time = getattr(tuner, "bench_time", None)
    if (
        not tuning["benched"]
        and bench_time is not tuning["bench_time"]
        and isinstance(bench_time, (int, float))
    ):
        # a subclass with its own _bench: Triton's own measure of this tuning (JIT included)
        tuning["bench_ns"], tuning["benched"] = int(bench_time * 1e9), -1
    if not tuning["benched"] and not tuning["disk_cache_hit"]:
        return  # one config left after pruning: Triton takes it without benchmarking
    end = time.time_ns()
    wall_ns = end - tuning["start"]
    names = list(getattr(tuner, "keys", None) or [])
    all_args = dict(zip(getattr(tuner, "arg_names", None) or [], args))
    all_args.update(kwargs)
    key_fields = {k: safe_repr(all_args.get(k), 100) for k in names if k in all_args}
    # Triton adds the dtype of every argument that has one to the tuning key
    dtypes = {k: str(v.dtype) for k, v in all_args.items() if is_tensor_like(v)}
    jit_ns = min(tuning["jit_ns"], wall_ns)
    if tuning["benched"]:
        bench_ns = max(min(tuning["bench_ns"], wall_ns) - jit_ns, 0)
    else:  # read from Triton's disk cache: the lookup is all it cost
        bench_ns = max(wall_ns - jit_ns, 0)
    best = getattr(tuner, "best_config", None)
    best_kwargs = getattr(best, "all_kwargs", None)
    _emit_compile(
        schema.COMPILE_TRITON_AUTOTUNE,
        tuning["kernel"],
        tuning["start"],
        end,
        duration_s=bench_ns / 1e9,
        bench_s=bench_ns / 1e9,
        jit_s=jit_ns / 1e9,
        jit_compiles=tuning["jit_compiles"],
        wall_s=wall_ns / 1e9,
        caller=first_user_frame(2),
        key_names=names,
        key=safe_repr(tuple(all_args.get(k) for k in names) + tuple(dtypes.values()), 1000),
        key_fields=key_fields,
        key_dtypes=dtypes,
        configs=len(getattr(tuner, "configs", None) or []),
        configs_benchmarked=tuning["benched"] if tuning["benched"] >= 0 else None,
        module=getattr(getattr(tuner, "base_fn", None), "__module__", None),
        cache_results=bool(getattr(tuner, "cache_results", False)),
        disk_cache_hit=bool(tuning["disk_cache_hit"]),
        best_config=safe_repr(best_kwargs(), 300) if callable(best_kwargs) else None,
    )


# -- torch.compile -------------------------------------------------------------------------------
# torch keeps its compilation metrics in a deque of 64: reading it later loses compiles. Every
# entry passes through `torch._dynamo.utils.record_compilation_metrics` as it is made, so the shim
# wraps that function and records each compile then (on the compiling thread, in its step). The
# deque is still read at each step end for entries the wrapper could not see (a thread whose
# metrics context was made before the shim's hook), matched by identity so none is counted twice.
_dynamo: dict[str, Any] = {"utils": None, "frames": {}, "seen": {}, "wrapped": False}
_dynamo_lock = threading.Lock()


@guarded("dynamo utils hook")
def _on_dynamo_utils(module: Any) -> None:
    _dynamo["utils"] = module
    original = getattr(module, "record_compilation_metrics", None)
    if original is None or getattr(original, "_traindx_wrapped", False):
        return

    @functools.wraps(original)
    def record_compilation_metrics(*args: Any, **kwargs: Any) -> Any:
        deque = getattr(module, "_compilation_metrics", None)
        last = deque[-1] if deque else None
        try:
            return original(*args, **kwargs)
        finally:
            try:
                deque = getattr(module, "_compilation_metrics", None)
                if deque and deque[-1] is not last:
                    _record_dynamo(deque[-1])
            except Exception as exc:
                report_error("dynamo metrics hook", exc)

    record_compilation_metrics._traindx_wrapped = True  # type: ignore[attr-defined]
    module.record_compilation_metrics = record_compilation_metrics
    _dynamo["wrapped"] = True


def _record_dynamo(m: Any) -> None:
    """One compile event for one CompilationMetrics entry, once."""
    seen = _dynamo["seen"]  # id -> weak reference: holds nothing alive (entries are unhashable)
    with _dynamo_lock:
        ref = seen.get(id(m))
        if ref is not None and ref() is m:
            return
        key = id(m)
        forget = lambda r, key=key: seen.pop(key, None) if seen.get(key) is r else None
        seen[key] = weakref.ref(m, forget)
    start_us = getattr(m, "start_time_us", None)
    if start_us is None:
        return
    dur_us = getattr(m, "duration_us", None)
    end_us = getattr(m, "end_time_us", None)
    if dur_us is None:
        dur_us = (end_us - start_us) if end_us is not None else 0
    start = int(start_us * 1000)
    cid = str(getattr(m, "compile_id", ""))
    name = getattr(m, "co_name", None)
    reason = getattr(m, "recompile_reason", None)
    caller = {
        "file": getattr(m, "co_filename", None),
        "line": getattr(m, "co_firstlineno", None),
        "function": name,
    }
    graph = "forward"
    if name is None and cid in _dynamo["frames"]:
        # AOTAutograd compiles the backward graph at the first backward: same compile id
        graph = "backward"
        name, caller, reason = _dynamo["frames"][cid]
    elif name is not None:
        _dynamo["frames"][cid] = (name, caller, reason)
    if name is None and getattr(m, "is_runtime", None):
        return  # runtime bookkeeping (e.g. autotuning at run time) of a frame never seen
    kernel = f"{name}" if graph == "forward" else f"{name} (backward graph)"
    _emit_compile(
        schema.COMPILE_DYNAMO,
        kernel,
        start,
        start + int(dur_us * 1000),
        compile_id=cid,
        recompile_reason=reason,
        graph=graph,
        caller=caller,
        key=cid,
        fail_type=getattr(m, "fail_type", None),
    )


def harvest_dynamo() -> None:
    """Entries the wrapper did not see (called at each step end and at exit)."""
    utils = _dynamo["utils"]
    if utils is None:
        return
    try:
        metrics = list(getattr(utils, "_compilation_metrics", None) or ())
    except Exception:
        return
    for m in metrics:
        try:
            _record_dynamo(m)
        except Exception as exc:
            report_error("dynamo metrics harvest", exc)


def _on_step_ended(step: int) -> None:
    harvest_dynamo()


def register() -> None:
    bus.subscribe(schema.STEP_ENDED, _on_step_ended)
    importhooks.on_import("cutlass.base_dsl.compiler", _on_cute_compiler)
    importhooks.on_import("flash_attn.cute.interface", _on_fa4_interface)
    importhooks.on_import("triton", _on_triton)
    importhooks.on_import("triton.runtime.autotuner", _on_triton_autotuner)
    importhooks.on_import("torch._dynamo.utils", _on_dynamo_utils)

    atexit.register(harvest_dynamo)
