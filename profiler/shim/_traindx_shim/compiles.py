"""Compile events: CuTe DSL (and FA4's compile keys), Triton JIT and autotuning, torch.compile.

Each event says which kernel, how long, on which thread, in which step, and the first frame of
the job's own code on that thread. For FA4 it also keeps the compile key with its field names
and the call's arguments, so a recompile can be explained and replayed (`kernel-cache warm`).
"""
import ast
import inspect
import linecache
import re
import sys
import textwrap
import threading
import time

from . import emit, guarded, importhooks, report_error
from .frames import first_user_frame
from . import steps

FA4_INTERFACE = "flash_attn" + ("\\" if sys.platform == "win32" else "/") + "cute"
FA4_CALL_SAMPLES = 8  # stack walks per (function, argument-type signature); later calls are counted
_key_names_cache = {}
_fa4_calls = {}
_main_ident = threading.main_thread().ident


def _thread_fields():
    th = threading.current_thread()
    return {"thread": th.name, "thread_id": th.ident, "is_main_thread": th.ident == _main_ident}


def _emit_compile(kind, kernel, start_ns, end_ns, **fields):
    begin = steps.in_step_since()
    emit("compile", kind=kind, kernel=kernel, start=start_ns, t=end_ns,
         duration_s=(end_ns - start_ns) / 1e9, step=steps.current_step(),
         in_step=begin is not None and start_ns >= begin, **_thread_fields(), **fields)


# -- values -> JSON-able descriptions ------------------------------------------------------------
def describe_value(value):
    """Shapes and dtypes for tensors (never their data: that could sync or fail in fake mode)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    type_name = type(value).__name__
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return {"tensor": True, "type": type_name, "shape": list(shape), "dtype": str(value.dtype),
                "device": str(getattr(value, "device", ""))}
    if isinstance(value, (tuple, list)):
        return [describe_value(v) for v in value]
    if callable(value):
        return {"callable": getattr(value, "__qualname__", type_name)}
    return {"type": type_name, "repr": repr(value)[:200]}


# FA4 builds some key elements from expressions; these are their names in newer releases
_KEY_EXPRESSION_NAMES = (
    (re.compile(r"^\(?seqlen_q\w*\s*//\s*\w+\s*==\s*1\)?$"), "single_q_block"),
    (re.compile(r"^\(?seqlen_k\w*\s*//\s*\w+\s*==\s*1\)?$"), "single_k_block"),
)


def _canonical_key_name(expression):
    for pattern, name in _KEY_EXPRESSION_NAMES:
        if pattern.match(expression):
            return name
    return expression


def _key_field_names(func_code, lineno, length):
    """Names of the elements of the `compile_key = (...)` tuple built before `lineno` in FA4's
    source, parsed once per function: FA4 builds its keys from named locals. A function may build
    its key in several branches (per architecture): the nearest one of the right length wins."""
    cache_key = (func_code, lineno, length)
    if cache_key in _key_names_cache:
        return _key_names_cache[cache_key]
    names = None
    try:
        lines, first = inspect.getsourcelines(func_code)
        source = "".join(lines)
        if lines[0].startswith((" ", "\t")):
            source = textwrap.dedent(source)
        best = None
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple)
                    and len(node.value.elts) == length
                    and any(isinstance(t, ast.Name) and t.id == "compile_key" for t in node.targets)):
                abs_line = first + node.lineno - 1
                if abs_line <= lineno and (best is None or abs_line > best[0]):
                    best = (abs_line, node)
        if best is not None:
            names = [_canonical_key_name(ast.unparse(elt)) for elt in best[1].value.elts]
            if len(set(names)) != len(names):  # two identical expressions: keep them apart
                names = [f"{n}#{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]
    except Exception:
        names = None
    _key_names_cache[cache_key] = names
    return names


def _type_label(value):
    """'Tensor' for any torch tensor (FakeTensor, Parameter, ...): the analyzer's word for it."""
    if hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "device"):
        return "Tensor"
    return type(value).__name__


def _fa4_context():
    """The FA4 interface frame that asked for this compile: function, key fields, arguments."""
    f = sys._getframe(3)
    while f is not None:
        code = f.f_code
        if code.co_filename.endswith("interface.py") and FA4_INTERFACE in code.co_filename \
                and "compile_key" in f.f_locals:
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
        fields = {label: repr(v)[:300] for label, v in zip(labels, key)}
        types = {label: _type_label(v) for label, v in zip(labels, key)}
    code = f.f_code
    argnames = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    args = {name: describe_value(local.get(name)) for name in argnames if name in local}
    max_seqlen = {name: {"type": _type_label(local[name]),
                         "value": local[name] if isinstance(local[name], int) else None}
                  for name in ("max_seqlen_q", "max_seqlen_k") if name in argnames and name in local}
    return {"function": code.co_name, "line": f.f_lineno, "key": repr(key)[:4000],
            "key_fields": fields, "key_types": types, "args": args, "max_seqlen": max_seqlen}


# -- CuTe DSL ------------------------------------------------------------------------------------
@guarded("cutlass import hook")
def _on_cute_compiler(module):
    cls = module.CompileCallable
    original = cls._compile

    def _compile(self, func, *args, **kwargs):
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


def _kernel_name(func):
    bound = getattr(func, "__self__", None)
    if bound is not None:
        return f"{type(bound).__qualname__}.{getattr(func, '__name__', '?')}"
    if inspect.isfunction(func):
        return func.__qualname__
    return type(func).__qualname__


def _record_cute(func, start, end, ok):
    fa4 = _fa4_context()
    kernel = _kernel_name(func)
    module = getattr(type(getattr(func, "__self__", None) or func), "__module__", "")
    fields = {"ok": ok, "caller": first_user_frame(2), "module": module}
    if fa4 is not None:
        fields.update(key=fa4.pop("key"), key_fields=fa4.pop("key_fields"),
                      key_types=fa4.pop("key_types"), fa4=fa4,
                      fa4_call_site=_last_fa4_site.get("site"))
        kernel = f"{fa4['function']}:{kernel}"
    _emit_compile("cute_dsl", kernel, start, end, **fields)


# -- FA4 call sites (the forward call is where a framework passes max_seqlen) --------------------
_last_fa4_site = {}


def _fa4_signature(kwargs):
    return tuple(sorted((k, _type_label(v)) for k, v in kwargs.items()
                        if k.startswith("max_seqlen") or k.startswith("cu_seqlens")))


@guarded("flash_attn import hook")
def _on_fa4_interface(module):
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


def _wrap_package_names(package, interface):
    for name in ("flash_attn_varlen_func", "flash_attn_func"):
        wrapped = getattr(interface, name, None)
        current = getattr(package, name, None)
        if wrapped is not None and current is getattr(wrapped, "__wrapped__", None):
            setattr(package, name, wrapped)


def _wrap_fa4_entry(name, original):
    def entry(*args, **kwargs):
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

    entry.__wrapped__ = original
    entry.__name__ = name
    return entry


def _emit_fa4_call(name, kwargs, sample, ok):
    try:
        seen, sig, caller, start = sample
        end = time.time_ns()
        max_seqlen = {k: {"type": _type_label(v), "value": v if isinstance(v, int) else None}
                      for k, v in kwargs.items() if k.startswith("max_seqlen")}
        emit("fa4_call", function=name, caller=caller, source=_source_line(caller),
             call_index=seen, arg_types=dict(sig[1]), max_seqlen=max_seqlen, start=start, t=end, duration_s=(end - start) / 1e9,
             step=steps.current_step(), ok=ok, **_thread_fields())
    except Exception as exc:
        report_error("fa4 call hook", exc)


def _source_line(where):
    if not where:
        return None
    return linecache.getline(where["file"], where["line"]).strip()[:300] or None


# -- Triton --------------------------------------------------------------------------------------
@guarded("triton import hook")
def _on_triton(module):
    knobs = getattr(module, "knobs", None)
    if knobs is None:
        return
    previous = knobs.compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        try:
            total_us = getattr(times, "total", None) or 0
            end = time.time_ns()
            name = getattr(getattr(src, "fn", None), "__name__", None) or getattr(src, "name", "?")
            if not cache_hit:
                _emit_compile("triton", name, end - int(total_us * 1000), end, cache_hit=cache_hit,
                              caller=first_user_frame(1),
                              key=repr(getattr(src, "signature", ""))[:2000])
        except Exception as exc:
            report_error("triton listener", exc)
        if previous:
            return previous(src=src, metadata=metadata, metadata_group=metadata_group,
                            times=times, cache_hit=cache_hit)

    knobs.compilation.listener = listener


@guarded("triton autotuner hook")
def _on_triton_autotuner(module):
    cls = module.Autotuner
    original = cls.run

    def run(self, *args, **kwargs):
        before = len(self.cache)
        start = time.time_ns()
        result = original(self, *args, **kwargs)
        if len(self.cache) > before:
            try:
                end = time.time_ns()
                all_args = dict(zip(self.arg_names, args), **kwargs)
                key = {k: repr(all_args.get(k))[:100] for k in getattr(self, "keys", [])}
                name = getattr(getattr(self, "fn", None), "__name__", "?")
                _emit_compile("triton_autotune", name, start, end, caller=first_user_frame(1),
                              key=repr(key), key_fields=key, configs=len(self.configs),
                              bench_time_s=getattr(self, "bench_time", None))
            except Exception as exc:
                report_error("triton autotune hook", exc)
        return result

    cls.run = run


# -- torch.compile -------------------------------------------------------------------------------
_dynamo = {"seen": 0, "utils": None, "starts": {}, "frames": {}}


@guarded("dynamo import hook")
def _on_dynamo_callback(module):
    def on_start(cb_args):
        _dynamo["starts"][str(cb_args.compile_id)] = (time.time_ns(), first_user_frame(1))

    module.on_compile_start(on_start)


@guarded("dynamo utils hook")
def _on_dynamo_utils(module):
    _dynamo["utils"] = module


def harvest_dynamo():
    """Emit one compile event per new torch.compile entry (called at each step end and exit)."""
    utils = _dynamo["utils"]
    if utils is None:
        return
    try:
        metrics = utils.get_compilation_metrics()
    except Exception:
        return
    for m in metrics[_dynamo["seen"]:]:
        start_us = getattr(m, "start_time_us", None)
        dur_us = getattr(m, "duration_us", None) or 0
        if start_us is None:
            continue
        start = int(start_us * 1000)
        cid = str(getattr(m, "compile_id", ""))
        _dynamo["starts"].pop(cid, None)
        name = getattr(m, "co_name", None)
        reason = getattr(m, "recompile_reason", None)
        caller = {"file": getattr(m, "co_filename", None),
                  "line": getattr(m, "co_firstlineno", None), "function": name}
        graph = "forward"
        if name is None and cid in _dynamo["frames"]:
            # AOTAutograd compiles the backward graph at the first backward: same compile id
            graph = "backward"
            name, caller, reason = _dynamo["frames"][cid]
        elif name is not None:
            _dynamo["frames"][cid] = (name, caller, reason)
        kernel = f"{name}" if graph == "forward" else f"{name} (backward graph)"
        _emit_compile("dynamo", kernel, start, start + int(dur_us * 1000), compile_id=cid,
                      recompile_reason=reason, graph=graph, caller=caller, key=cid,
                      fail_type=getattr(m, "fail_type", None))
    _dynamo["seen"] = len(metrics)


def register():
    importhooks.on_import("cutlass.base_dsl.compiler", _on_cute_compiler)
    importhooks.on_import("flash_attn.cute.interface", _on_fa4_interface)
    importhooks.on_import("triton", _on_triton)
    importhooks.on_import("triton.runtime.autotuner", _on_triton_autotuner)
    importhooks.on_import("torch._dynamo.callback", _on_dynamo_callback)
    importhooks.on_import("torch._dynamo.utils", _on_dynamo_utils)
    import atexit
    atexit.register(harvest_dynamo)
