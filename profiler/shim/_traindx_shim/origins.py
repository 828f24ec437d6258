"""Where a tensor `max_seqlen` that reaches FA4 was made (the line to fix is there, not at the
attention call: FACTS.md §8).

Nothing runs until FA4's `_flash_attn_fwd` is called with a 0-dim tensor `max_seqlen_q/k`. Then:
1. a creation tracer is armed on that thread: a `torch.overrides.TorchFunctionMode` that records,
   for every 0-dim integer tensor a torch function or method returns, the first frame of the
   job's own code (file:line), keyed by id with a weakref, and the recorded tensor it came from
   (so `.to(device)` in the model module chains back to `seqlens.max()` in the collator). It only
   looks at metadata (dim, dtype): no device sync, no change of values;
2. at a later FA4 call the tensor passed is looked up: its chain of origins is emitted as one
   `tensor_origin` event and the tracer is removed;
3. when the tensor was made where the tracer cannot see it (a DataLoader worker process, a mode
   stack that is not ours to touch) the job's own source files are searched instead (ast) for
   the assignment that makes it (`x = seqlens.max()`, `"max_seqlen": cu.diff().max()`).

The mode is pushed only when the torch-function mode stack is empty, so the job's own modes,
entered later, nest above it and are popped by their own `with` blocks; it is popped only when it
is on top (else it turns itself off and is popped at a later call).
"""

from __future__ import annotations

import ast
import gc
import inspect
import linecache
import os
import re
import sys
import threading
import weakref

from . import emit, guarded, importhooks, report_error, schema
from .frames import first_user_frame, is_library_file

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

MAX_SEQLEN_ARGS = ("max_seqlen_q", "max_seqlen_k")
GIVE_UP_AFTER_CALLS = 2000  # FA4 calls while armed without seeing a traced tensor
MAX_RECORDS = 20000
MAX_SCAN_FILES = 1500
# ops that copy or move a tensor: a chain that starts with one did not see the tensor being made
MOVES = {
    "to",
    "cuda",
    "cpu",
    "clone",
    "contiguous",
    "detach",
    "pin_memory",
    "__deepcopy__",
    "__reduce_ex__",
    "_to_copy",
}
_state: dict[str, Any] = {"armed": False, "done": False, "mode": None, "thread": None, "calls": 0}
_records: dict[int, tuple[Any, Any, Any]] = {}  # id(tensor) -> (weakref, frame dict, parent record or None)
_SKIP_DIRS = {
    ".git",
    ".hg",
    "__pycache__",
    "node_modules",
    "site-packages",
    "dist-packages",
    ".venv",
    "venv",
    "env",
    ".tox",
    "build",
    "dist",
    "runs",
    ".cache",
}


def _source(where: dict[str, Any] | None) -> str | None:
    if not where or not where.get("file"):
        return None
    return linecache.getline(where["file"], where["line"]).rstrip("\n")[:400] or None


# -- the tracer -------------------------------------------------------------------------------------
def _make_tracer() -> Any:
    # torch is imported here only once the job has imported it: the shim never imports it first
    import torch

    class CreationTracer(torch.overrides.TorchFunctionMode):
        active = True

        def __torch_function__(
            self, func: Callable[..., Any], types: object, args: Any = (), kwargs: Any = None
        ) -> Any:
            result = func(*args, **(kwargs or {}))
            if self.active:
                try:
                    _note(result, args, kwargs, func)
                except Exception as exc:
                    self.active = False
                    report_error("origin tracer", exc)
            return result

    return CreationTracer()


def _is_int_scalar(value: Any) -> bool:
    try:
        # torch is imported here only once the job has imported it: the shim never imports it first
        import torch

        return (
            isinstance(value, torch.Tensor)
            and value.dim() == 0
            and not value.is_floating_point()
            and not value.is_complex()
            and value.dtype != torch.bool
        )
    except Exception:
        return False


def _lookup(value: Any) -> tuple[Any, Any, Any] | None:
    entry = _records.get(id(value))
    if entry is not None and entry[0]() is value:
        return entry
    return None


def _note(result: Any, args: Any, kwargs: Any, func: Callable[..., Any] | None = None) -> None:
    if not _is_int_scalar(result) or len(_records) >= MAX_RECORDS:
        return
    if any(result is a for a in args):  # `.to(same device)`, `.contiguous()`: the same tensor
        return
    parent = None
    for a in list(args) + list((kwargs or {}).values()):
        if _is_int_scalar(a):
            parent = _lookup(a)
            if parent is not None:
                break
    where = first_user_frame(1)
    if where is None:
        return
    where = dict(where, op=getattr(func, "__name__", None))
    key = id(result)
    forget = lambda _r, k=key: _records.pop(k, None)
    _records[key] = (weakref.ref(result, forget), where, parent)


def _arm() -> bool:
    # torch is imported here only once the job has imported it: the shim never imports it first
    import torch

    if torch._C._len_torch_function_stack() != 0:
        return False  # the job's own mode is active here: not ours to nest under
    mode = _make_tracer()
    torch._C._push_on_torch_function_stack(mode)
    _state.update(armed=True, mode=mode, thread=threading.get_ident(), calls=0)
    return True


def _disarm() -> None:
    mode = _state["mode"]
    if mode is None:
        return
    mode.active = False
    try:
        # torch is imported here only once the job has imported it: the shim never imports it first
        import torch

        n = torch._C._len_torch_function_stack()
        if n and torch._C._get_function_stack_at(n - 1) is mode:
            torch._C._pop_torch_function_stack()
            _state["mode"] = None
    except Exception as exc:
        report_error("origin tracer disarm", exc)


def _chain(entry: tuple[Any, Any, Any] | None) -> list[dict[str, Any]]:
    out = []
    while entry is not None and len(out) < 8:
        where = dict(entry[1])
        where["source"] = _source(where)
        out.append(where)
        entry = entry[2]
    return out[::-1]  # creation first, the last hop (nearest the call) last


# -- static fallback --------------------------------------------------------------------------------
_ARG_EXPR = re.compile(r"\b(max_seqlen_[qk])\s*=\s*([A-Za-z_][\w.]*(?:\[[^\]]*\])?)")


def _call_names(call_source: str | None) -> set[str]:
    """Names the call passes as max_seqlen (`max_seqlen_q=packed.max_seqlen` -> 'max_seqlen')."""
    names = set()
    for _, expr in _ARG_EXPR.findall(call_source or ""):
        last = re.split(r"[.\[]", expr.rstrip("]"))[-1].strip("'\" ")
        if last:
            names.add(last)
    return names


def _is_max_call(node: ast.AST) -> bool:
    """`x.max()`, `x.diff().max()`, `x.amax()`, `torch.max(x)` — not already int()/.item()."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if not isinstance(func, ast.Attribute) or func.attr not in ("max", "amax"):
        return False
    if isinstance(func.value, ast.Name) and func.value.id == "torch":
        return len(node.args) == 1 and not node.keywords  # torch.max(x)
    return not node.args and not node.keywords  # x.max(), x.diff().max()


def _target_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return [str(node.slice.value)]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for elt in node.elts for n in _target_names(elt)]
    return []


def _matches(name: str, wanted: set[str]) -> bool:
    return name in wanted or "max_seqlen" in name or "max_len" in name


def scan_file(path: str, wanted: set[str]) -> list[tuple[int, str, str]]:
    """[(line, name, source line)] of the places in one file that make a tensor max_seqlen."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    hits = []
    for node in ast.walk(tree):
        pairs = []
        if isinstance(node, ast.Assign):
            pairs = [(n, node.value) for t in node.targets for n in _target_names(t)]
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            pairs = [(n, node.value) for n in _target_names(node.target)]
        elif isinstance(node, ast.Dict):
            pairs = [(str(k.value), v) for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)]
        elif isinstance(node, ast.Call):
            pairs = [(kw.arg, kw.value) for kw in node.keywords if kw.arg]
        for name, value in pairs:
            if _matches(name, wanted) and _is_max_call(value):
                line = value.lineno
                hits.append((line, name, lines[line - 1].rstrip() if line <= len(lines) else ""))
    return sorted(set(hits))


def _roots(call_site: dict[str, Any] | None) -> list[str]:
    roots = []
    if call_site and call_site.get("file"):
        d = os.path.dirname(os.path.abspath(call_site["file"]))
        while os.path.isfile(os.path.join(d, "__init__.py")):
            d = os.path.dirname(d)
        roots.append(d)
    if sys.argv and sys.argv[0].endswith(".py"):
        roots.append(os.path.dirname(os.path.abspath(sys.argv[0])))
    roots.append(os.getcwd())
    return list(dict.fromkeys(roots))


def static_origins(call_site: dict[str, Any] | None, call_source: str | None) -> list[dict[str, Any]]:
    # the parse trees are garbage-free and short-lived: without this, in a job's large heap
    # (torch, a framework, a model) their allocations trigger full collections, 50x the parse
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _static_origins(call_site, call_source)
    finally:
        if enabled:
            gc.enable()


def _static_origins(call_site: dict[str, Any] | None, call_source: str | None) -> list[dict[str, Any]]:
    wanted = _call_names(call_source)
    hits, seen = [], 0
    for root in _roots(call_site):
        for folder, dirs, files in os.walk(root):
            dirs[:] = [
                d
                for d in dirs
                if d not in _SKIP_DIRS and not d.startswith(".") and not d.endswith(".egg-info")
            ]
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                if is_library_file(path):
                    continue
                seen += 1
                if seen > MAX_SCAN_FILES:
                    return hits
                for line, var, source in scan_file(path, wanted):
                    hit = {"file": path, "line": line, "name": var, "source": source}
                    if hit not in hits:
                        hits.append(hit)
        if hits:
            return hits
    return hits


# -- FA4's entry ------------------------------------------------------------------------------------
def _tensor_arg(args: Any, kwargs: Any, positions: dict[str, int]) -> tuple[Any, Any]:
    for arg in MAX_SEQLEN_ARGS:
        value = kwargs.get(arg)
        if value is None and arg in positions and positions[arg] < len(args):
            value = args[positions[arg]]
        if value is not None and hasattr(value, "dim") and value.dim() == 0:
            return arg, value
    return None, None


def _argument_lines(call_site: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The lines of the call statement at call_site that pass max_seqlen (a call often spans
    several lines; the cast belongs on the one that names the argument)."""
    if not call_site or not call_site.get("file"):
        return []
    try:
        with open(call_site["file"], encoding="utf-8") as f:
            text = f.read()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and node.lineno == call_site["line"]:
                return [
                    {"line": i, "source": lines[i - 1]}
                    for i in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                    if "max_seqlen_" in lines[i - 1]
                ]
    except (OSError, SyntaxError, ValueError):
        pass
    return []


def _finish(
    arg: Any,
    value: Any,
    call_site: dict[str, Any] | None,
    method: str,
    chain: list[dict[str, Any]] | None = None,
    candidates: list[dict[str, Any]] | None = None,
) -> None:
    _state["done"] = True
    _disarm()
    call = dict(call_site or {})
    call["source"] = _source(call_site)
    call["argument_lines"] = _argument_lines(call_site)
    found = chain if method == "traced" else candidates
    origin = found[0] if found else None
    emit(
        schema.TENSOR_ORIGIN,
        arg=arg,
        method=method,
        call_site=call,
        origin=origin,
        chain=chain or [],
        candidates=candidates or [],
        dtype=str(getattr(value, "dtype", "")),
        device=str(getattr(value, "device", "")),
    )


def _on_fa4_call(args: Any, kwargs: Any, positions: dict[str, int]) -> None:
    if _state["done"]:
        return
    arg, value = _tensor_arg(args, kwargs, positions)
    if value is None:
        return
    call_site = first_user_frame(2)
    entry = _lookup(value) if _state["armed"] else None
    if entry is not None:
        chain = _chain(entry)
        if chain[0].get("op") in MOVES:
            # the first op seen only moved a tensor made elsewhere (a DataLoader worker process):
            # the line that made it is in the job's source
            _finish(
                arg,
                value,
                call_site,
                "static",
                chain=chain,
                candidates=static_origins(call_site, _source(call_site)),
            )
        else:
            _finish(arg, value, call_site, "traced", chain=chain)
        return
    if not _state["armed"]:
        if _arm():
            return
    elif threading.get_ident() == _state["thread"]:
        _state["calls"] += 1
        if _state["calls"] < GIVE_UP_AFTER_CALLS:
            return
    else:
        return
    # not traceable here: made in another process (DataLoader worker) or under the job's modes
    _finish(arg, value, call_site, "static", candidates=static_origins(call_site, _source(call_site)))


@guarded("origin tracer install")
def _install(module: Any) -> None:
    original = getattr(module, "_flash_attn_fwd", None)
    if original is None:
        return
    try:
        params = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        params = []
    positions = {a: params.index(a) for a in MAX_SEQLEN_ARGS if a in params}

    def traced(*args: Any, **kwargs: Any) -> Any:
        try:
            _on_fa4_call(args, kwargs, positions)
        except Exception as exc:
            _state["done"] = True
            report_error("origin tracer", exc)
        return original(*args, **kwargs)

    # FA4 keeps its compile cache as an attribute of the function, read through the module
    # global name: the wrapper shares the original's __dict__
    traced.__dict__ = original.__dict__
    traced.__name__ = getattr(original, "__name__", "_flash_attn_fwd")
    module._flash_attn_fwd = traced


def register() -> None:
    if os.environ.get("TRAINDX_ORIGINS", "1") == "0":
        return
    importhooks.on_import("flash_attn.cute.interface", _install)
