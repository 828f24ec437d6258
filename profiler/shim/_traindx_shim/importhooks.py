"""Run a callback right after the job imports a given module (never importing it ourselves)."""

from __future__ import annotations

import importlib.abc
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

_callbacks: dict[str, list[Callable[[ModuleType], object]]] = {}  # module name -> [callback(module)]
_done: set[str] = set()


def on_import(name: str, callback: Callable[..., Any]) -> None:
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__spec__", None) is not None and name not in _finder.pending:
        _run(name, callback, module)
    else:
        _callbacks.setdefault(name, []).append(callback)


def _run(name: str, callback: Callable[..., Any], module: ModuleType) -> None:
    from . import report_error  # the package's __init__ imports this module: no cycle at load

    try:
        callback(module)
    except Exception as exc:
        report_error(f"import hook for {name}", exc)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.pending: set[str] = set()

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name not in _callbacks or name in self.pending:
            return None
        self.pending.add(name)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self.pending.discard(name)
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = _wrapped(loader.exec_module, name)
        try:
            loader.exec_module = exec_module  # type: ignore[method-assign,assignment]
        except Exception:
            return spec
        return spec


# The wrapper around a loader's exec_module is compiled as importlib's own code: when the
# job's module raises while it loads, Python trims importlib's frames from the traceback it
# prints, and so ours, which would otherwise show up in the job's own traceback as the shim's.
_WRAPPER = compile(
    "def wrapped(original, name, after):\n"
    "    def exec_module(module):\n"
    "        original(module)\n"
    "        after(name, module)\n"
    "    return exec_module\n",
    "<frozen importlib._bootstrap_external>",
    "exec",
)
_namespace: dict[str, Any] = {}
exec(_WRAPPER, _namespace)


def _after(name: str, module: ModuleType) -> None:
    for callback in _callbacks.pop(name, []):
        _run(name, callback, module)


def _wrapped(original: Callable[[ModuleType], None], name: str) -> Callable[[ModuleType], None]:
    return _namespace["wrapped"](original, name, _after)


_finder = _Finder()


def install() -> None:
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
