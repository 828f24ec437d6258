"""The job's own code that torch runs inside the model's work: module forward (pre-)hooks,
backward (pre-)hooks, global module hooks and tensor hooks whose function is in the job's own
files (an installed package's hooks - torch's, traindx's, a framework's parameter gathering -
are the model's machinery and stay untouched). Each such hook is wrapped when it is
registered: a call that lasts HOOK_SPAN_MIN_NS or more becomes a `hook` span (site = the hook's
id), so the ledger books it as host work, never as fwd/bwd; each hook is named once in a
`hook_site` event (id, kind, function, file, line of its definition).

Candidate arm of `diagnose --fix` (TRAINDX_RUNTIME_PATCHES=skip_hook@<file>:<line>): the hook
defined at that line is not called (it returns None, as a hook that changes nothing does): the
step's time without it, measured.

Cost per hook call: two clock reads and a compare; a span event only for a call worth one.
"""

from __future__ import annotations

import functools
import os
import threading
import time

from . import emit, guarded, importhooks, report_error, schema
from .frames import is_library_file, is_library_path

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

SKIP_PREFIX = "skip_hook@"
HOOK_SPAN_MIN_NS = int(float(os.environ.get("TRAINDX_HOOK_SPAN_MIN_US") or 20) * 1000)
_now = time.time_ns
_ident = threading.get_ident
_sites: dict[Any, int] = {}  # code object -> site id
_skipped: set[int] = set()  # sites whose skip was announced
_state: dict[str, Any] = {"compiling": None, "skip": None}


def _skips() -> set[tuple[str, int]]:
    if _state["skip"] is None:
        out = set()
        for p in os.environ.get("TRAINDX_RUNTIME_PATCHES", "").split(","):
            p = p.strip()
            if p.startswith(SKIP_PREFIX) and ":" in p:
                path, _, line = p[len(SKIP_PREFIX) :].rpartition(":")
                if line.isdigit():
                    out.add((os.path.realpath(path), int(line)))
        _state["skip"] = out
    skip: set[tuple[str, int]] = _state["skip"]
    return skip


def _code_of(hook: Any) -> Any:
    """The code object a hook runs: a function's, a bound method's, a partial's, a callable object's."""
    target = hook
    for _ in range(4):
        code = getattr(target, "__code__", None)
        if code is not None:
            return code
        inner = getattr(target, "func", None) or getattr(target, "__func__", None)
        if inner is None and not isinstance(target, type):
            inner = vars(type(target)).get("__call__")  # a callable object: its class's method
        if inner is None:
            return None
        target = inner
    return None


def _site(hook: Any, kind: str) -> tuple[int, bool] | None:
    """(site id, skipped) of a hook in the job's own files; None for an installed package's (torch's,
    traindx's, a framework's machinery such as DeepSpeed's parameter gathering: the model's work)."""
    code = _code_of(hook)
    if code is None or is_library_file(code.co_filename) or is_library_path(code.co_filename):
        return None
    got = _sites.get(code)
    if got is None:
        got = _sites[code] = len(_sites)
        emit(
            schema.HOOK_SITE,
            id=got,
            kind=kind,
            function=getattr(code, "co_qualname", code.co_name),
            file=code.co_filename,
            line=code.co_firstlineno,
        )
    skipped = (os.path.realpath(code.co_filename), code.co_firstlineno) in _skips()
    return got, skipped


def _timed(hook: Any, kind: str) -> Any:
    try:
        site = _site(hook, kind)
    except Exception as exc:
        report_error("hook site", exc)
        site = None
    if site is None:
        return hook
    sid, skipped = site
    if skipped:
        if sid not in _skipped:
            _skipped.add(sid)
            emit(
                schema.RUNTIME_PATCH,
                patch=f"{SKIP_PREFIX}site{sid}",
                site=sid,
                kind=kind,
                note="hook not called",
            )

        def skip(*args: Any, **kwargs: Any) -> Any:
            return None

        return skip

    def timed(*args: Any, **kwargs: Any) -> Any:
        check = _state["compiling"]
        if check is not None and check():
            return hook(*args, **kwargs)
        start = _now()
        try:
            return hook(*args, **kwargs)
        finally:
            end = _now()
            if end - start >= HOOK_SPAN_MIN_NS:
                try:
                    emit("span", cat="hook", start=start, t=end, tid=_ident(), site=sid)
                except Exception as exc:
                    report_error("span hook", exc)

    try:
        functools.update_wrapper(timed, hook)
    except Exception:
        pass
    return timed


def _wrap_register(register: Callable[..., Any], kind: str) -> Callable[..., Any]:
    @functools.wraps(register)
    def wrapped(self: Any, hook: Any, *args: Any, **kwargs: Any) -> Any:
        return register(self, _timed(hook, kind), *args, **kwargs)

    return wrapped


def _wrap_global(register: Callable[..., Any], kind: str) -> Callable[..., Any]:
    @functools.wraps(register)
    def wrapped(hook: Any, *args: Any, **kwargs: Any) -> Any:
        return register(_timed(hook, kind), *args, **kwargs)

    return wrapped


MODULE_HOOKS = (
    ("register_forward_pre_hook", "forward pre-hook"),
    ("register_forward_hook", "forward hook"),
    ("register_full_backward_pre_hook", "backward pre-hook"),
    ("register_full_backward_hook", "backward hook"),
    ("register_backward_hook", "backward hook"),
)
GLOBAL_HOOKS = (
    ("register_module_forward_pre_hook", "forward pre-hook"),
    ("register_module_forward_hook", "forward hook"),
    ("register_module_full_backward_pre_hook", "backward pre-hook"),
    ("register_module_full_backward_hook", "backward hook"),
)
TENSOR_HOOKS = (("register_hook", "tensor hook"), ("register_post_accumulate_grad_hook", "tensor hook"))


@guarded("hook timing install")
def _on_torch(torch: Any) -> None:
    compiler = getattr(torch, "compiler", None)
    _state["compiling"] = getattr(compiler, "is_dynamo_compiling", None) or getattr(
        compiler, "is_compiling", None
    )
    module_cls = torch.nn.Module
    for name, kind in MODULE_HOOKS:
        if hasattr(module_cls, name):
            setattr(module_cls, name, _wrap_register(getattr(module_cls, name), kind))
    mod = torch.nn.modules.module
    for name, kind in GLOBAL_HOOKS:
        if hasattr(mod, name):
            setattr(mod, name, _wrap_global(getattr(mod, name), kind))
    for name, kind in TENSOR_HOOKS:
        if hasattr(torch.Tensor, name):
            setattr(torch.Tensor, name, _wrap_register(getattr(torch.Tensor, name), kind))


def register() -> None:
    importhooks.on_import("torch", _on_torch)
