"""Runtime patches for known library-boundary bugs, applied only when `diagnose --fix` asks for
them in a candidate run (env TRAINDX_RUNTIME_PATCHES, a comma list); never in a plain run.

- `fa4_int_max_seqlen`: flash-attn-4 < 4.0.0b26 puts values derived from a tensor `max_seqlen_q/k`
  into its compile keys (FACTS.md §1), so every call compiles again. The patch turns a tensor
  `max_seqlen_q/k` into a Python int at FA4's private `_flash_attn_fwd/_flash_attn_bwd`, which
  every public entry point (flash_attn_func, flash_attn_varlen_func, their autograd Functions)
  calls by module-global name. One read per tensor object (the value is kept per object, so the
  layers of one batch share one read), the value the framework meant: numerics do not change.

Also registers the origin tracer (origins.py), which only acts once a tensor max_seqlen is seen,
and notes which flash_attn the job imported (an overlay upgrade is proved by that event).
"""

from __future__ import annotations

import inspect
import os
import weakref

from . import emit, guarded, importhooks, origins, report_error, schema

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType
    from typing import Any

PATCH_VAR = "TRAINDX_RUNTIME_PATCHES"
FA4_INT_MAX_SEQLEN = "fa4_int_max_seqlen"
FA4_PRIVATE = ("_flash_attn_fwd", "_flash_attn_bwd")
MAX_SEQLEN_ARGS = ("max_seqlen_q", "max_seqlen_k")
_state: dict[str, Any] = {"coerced": 0, "reads": 0, "reported": False}
_values: dict[int, tuple[Any, int]] = {}  # id(tensor) -> (weakref, int): one host read per tensor object


def requested() -> set[str]:
    return {p.strip() for p in os.environ.get(PATCH_VAR, "").split(",") if p.strip()}


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "dim") and hasattr(value, "dtype") and hasattr(value, "shape")


def _as_int(tensor: Any) -> Any:
    entry = _values.get(id(tensor))
    if entry is not None and entry[0]() is tensor:
        return entry[1]
    try:
        value = int(tensor.item())
    except Exception:
        # called inside the job's own dispatch mode (e.g. FakeTensorMode on a real host tensor):
        # read the value outside it, as FA4 would see it on the device
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            value = int(tensor.item())
    _state["reads"] += 1
    try:
        forget = lambda _r, k=id(tensor): _values.pop(k, None)
        _values[id(tensor)] = (weakref.ref(tensor, forget), value)
    except TypeError:
        pass
    return value


def _coercing(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    try:
        params = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        params = []
    positions = {arg: params.index(arg) for arg in MAX_SEQLEN_ARGS if arg in params}

    def patched(*args: Any, **kwargs: Any) -> Any:
        try:
            changed = []
            for arg in MAX_SEQLEN_ARGS:
                if arg in kwargs and _is_tensor(kwargs[arg]) and kwargs[arg].dim() == 0:
                    kwargs[arg] = _as_int(kwargs[arg])
                    changed.append(arg)
                elif arg in positions and positions[arg] < len(args):
                    value = args[positions[arg]]
                    if _is_tensor(value) and value.dim() == 0:
                        as_list = list(args)
                        as_list[positions[arg]] = _as_int(value)
                        args = tuple(as_list)
                        changed.append(arg)
            if changed:
                _state["coerced"] += 1
                if not _state["reported"]:
                    _state["reported"] = True
                    emit(
                        schema.RUNTIME_PATCH,
                        patch=FA4_INT_MAX_SEQLEN,
                        function=name,
                        args=changed,
                        note="tensor max_seqlen turned into a Python int at FA4's boundary",
                    )
        except Exception as exc:  # never in the job's way: call FA4 as the job asked
            report_error("fa4 runtime patch", exc)
        return original(*args, **kwargs)

    # FA4 keeps its compile caches as attributes of these functions, read through the module
    # global name (`_flash_attn_fwd.compile_cache`): the wrapper shares the original's __dict__
    patched.__dict__ = original.__dict__
    patched.__name__ = name
    patched.__qualname__ = getattr(original, "__qualname__", name)
    return patched


@guarded("fa4 runtime patch install")
def _patch_fa4(module: ModuleType) -> None:
    done = []
    for name in FA4_PRIVATE:
        original = getattr(module, name, None)
        if original is None or getattr(original, "_traindx_coerces", False):
            continue
        patched = _coercing(name, original)
        setattr(module, name, patched)
        original._traindx_coerces = True  # shared __dict__: the wrapper says so too
        done.append(name)
    emit(
        schema.RUNTIME_PATCH_INSTALLED,
        patch=FA4_INT_MAX_SEQLEN,
        functions=done,
        module=getattr(module, "__file__", None),
    )


@guarded("package note")
def _note_flash_attn(module: Any) -> None:
    """Which flash_attn the job imported and its release: proves an overlay took effect."""
    version = None
    try:  # importlib.metadata costs ~10 ms: only when the job imports flash_attn
        from importlib import metadata

        path = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(module.__file__))))
        for dist in metadata.distributions(path=[path]):
            name = dist.metadata.get("Name")  # type: ignore[attr-defined]  # an email Message
            if (name or "").lower().replace("_", "-") == "flash-attn-4":
                version = dist.version
                break
    except Exception:
        version = None
    emit(
        schema.PACKAGE_LOADED,
        package="flash-attn-4",
        module=module.__name__,
        file=getattr(module, "__file__", None),
        version=version,
    )


def register() -> None:
    importhooks.on_import("flash_attn.cute.interface", _note_flash_attn)
    if FA4_INT_MAX_SEQLEN in requested():
        importhooks.on_import("flash_attn.cute.interface", _patch_fa4)
        return  # the candidate of a --fix: the origin is already known
    origins.register()


def atexit_summary() -> None:
    if _state["coerced"]:
        emit(
            schema.RUNTIME_PATCH_SUMMARY,
            patch=FA4_INT_MAX_SEQLEN,
            calls=_state["coerced"],
            host_reads=_state["reads"],
        )


try:
    import atexit

    atexit.register(atexit_summary)
except Exception:  # pragma: no cover
    pass
