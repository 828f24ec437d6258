"""Values as JSON-able descriptions for the compile events (traindx's shim, compiles.py): a
bounded, side-effect-free repr of any value, the description of a call's arguments, and the
names of a compile key's fields read from the source that built it.

Standard library only: this module runs inside the job.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import re
import sys
import textwrap

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from types import CodeType
    from typing import Any

_key_names_cache: dict[Any, Any] = {}


# -- values -> JSON-able descriptions ------------------------------------------------------------
# Never call an unvetted repr() here: a tensor's repr reads its data (a device sync on CUDA, an
# error in fake mode), and an object's own __repr__ may print the tensors it holds. Only the
# reprs below are called; anything else is described by its type (and dataclass fields).
_SAFE_REPR_TYPES = (bool, int, float, complex, str, bytes, type(None), type(Ellipsis))
_TORCH_SAFE_TYPES = frozenset({"dtype", "device", "layout", "memory_format", "qscheme"})
_MAX_ITEMS = 64


def is_tensor_like(value: Any) -> bool:
    """A torch tensor (FakeTensor, Parameter, subclasses) or an array: has shape and dtype.
    Looked up on the type, so a tensor subclass's __getattr__ never runs."""
    cls = type(value)
    return hasattr(cls, "shape") and hasattr(cls, "dtype") and not isinstance(value, type)


def _tensor_text(value: Any) -> str:
    """'Tensor(shape=[], dtype=torch.int32, device=cuda:0)': metadata only, no data."""
    try:
        shape: list[Any] | str = list(value.shape)
    except Exception:
        shape = "?"
    try:
        dtype = str(value.dtype)
    except Exception:
        dtype = "?"
    try:
        device = str(value.device)
    except Exception:
        device = "?"
    name = "Tensor" if _is_torch_tensor(value) else type(value).__name__
    return f"{name}(shape={shape}, dtype={dtype}, device={device})"


def _is_torch_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _is_numpy_scalar(value: Any) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.generic)


def _has_vetted_repr(value: Any) -> bool:
    cls = type(value)
    if cls in _SAFE_REPR_TYPES or _is_numpy_scalar(value):
        return True
    if cls.__module__ == "torch" and cls.__name__ in _TORCH_SAFE_TYPES:
        return True
    enum = sys.modules.get("enum")
    if enum is not None and isinstance(value, enum.Enum) and cls.__repr__ is enum.Enum.__repr__:
        return True
    return inspect.isfunction(value) or inspect.isbuiltin(value) or inspect.ismethod(value)


def safe_repr(value: Any, limit: int = 300, _depth: int = 0) -> str:
    """Text for a compile-key element that two compiles can be compared by, built without ever
    reading a tensor's data or running an object's own __repr__."""
    try:
        text = _safe_repr(value, _depth)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _safe_repr(value: Any, depth: int) -> str:
    if is_tensor_like(value) and not _is_numpy_scalar(value):
        return _tensor_text(value)
    if isinstance(value, type):
        return f"<class {getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}>"
    if _has_vetted_repr(value):
        return repr(value)
    if depth > 4:
        return f"<{type(value).__name__}>"
    if isinstance(value, (tuple, list)):
        items = [_safe_repr(v, depth + 1) for v in list(value)[:_MAX_ITEMS]]
        if len(value) > _MAX_ITEMS:
            items.append("…")
        if isinstance(value, list):
            return "[" + ", ".join(items) + "]"
        prefix = "" if type(value) is tuple else type(value).__name__
        return prefix + "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(value, dict):
        items = [
            f"{_safe_repr(k, depth + 1)}: {_safe_repr(v, depth + 1)}"
            for k, v in list(value.items())[:_MAX_ITEMS]
        ]
        return "{" + ", ".join(items) + "}"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_safe_repr(v, depth + 1) for v in list(value)[:_MAX_ITEMS])) + "}"
    fields = getattr(type(value), "__dataclass_fields__", None)
    if isinstance(fields, dict):
        parts = [f"{n}={_safe_repr(getattr(value, n, None), depth + 1)}" for n in list(fields)[:_MAX_ITEMS]]
        return f"{type(value).__name__}(" + ", ".join(parts) + ")"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def describe_value(value: Any, depth: int = 0) -> Any:
    """Shapes and dtypes for tensors (never their data: that could sync or fail in fake mode).
    Enum members and dataclass instances (FA4's resolved FwdConfig/BwdConfig, its PackGQA mode)
    keep their class and fields, so `kernel-cache warm` can build them again."""
    if type(value) in (type(None), bool, int, float, str):
        return value
    type_name = type(value).__name__
    if is_tensor_like(value):
        return {
            "tensor": True,
            "type": type_name,
            "shape": _shape_list(value),
            "dtype": str(getattr(value, "dtype", "?")),
            "device": str(getattr(value, "device", "")),
        }
    if isinstance(value, (tuple, list)):
        return [describe_value(v, depth + 1) for v in list(value)[:_MAX_ITEMS]]
    if isinstance(value, enum.Enum):
        return {"type": type_name, "class": _class_path(type(value)), "enum": value.name}
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and depth < 4:
        return {
            "type": type_name,
            "class": _class_path(type(value)),
            "fields": {
                f.name: describe_value(getattr(value, f.name, None), depth + 1)
                for f in dataclasses.fields(value)
                if f.init
            },
        }
    if callable(value):  # a function, or a class such as cutlass.BFloat16 (kernel-cache replays it)
        return {"callable": getattr(value, "__qualname__", type_name)}
    return {"type": type_name, "repr": safe_repr(value, 200)}


def _class_path(cls: type) -> str:
    return f"{getattr(cls, '__module__', '?')}:{getattr(cls, '__qualname__', cls.__name__)}"


def _shape_list(value: Any) -> list[Any] | None:
    try:
        return list(value.shape)
    except Exception:
        return None


# FA4 builds some key elements from expressions; these are their names in newer releases
_KEY_EXPRESSION_NAMES = (
    (re.compile(r"^\(?seqlen_q\w*\s*//\s*\w+\s*==\s*1\)?$"), "single_q_block"),
    (re.compile(r"^\(?seqlen_k\w*\s*//\s*\w+\s*==\s*1\)?$"), "single_k_block"),
)


def _canonical_key_name(expression: str) -> str:
    for pattern, name in _KEY_EXPRESSION_NAMES:
        if pattern.match(expression):
            return name
    return expression


def _key_field_names(func_code: CodeType, lineno: int, length: int) -> list[str] | None:
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
        best: tuple[int, Any] | None = None
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Tuple)
                and len(node.value.elts) == length
                and any(isinstance(t, ast.Name) and t.id == "compile_key" for t in node.targets)
            ):
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


def _type_label(value: Any) -> str:
    """'Tensor' for any torch tensor (FakeTensor, Parameter, ...): the analyzer's word for it."""
    if is_tensor_like(value) and hasattr(type(value), "device"):
        return "Tensor"
    return type(value).__name__
