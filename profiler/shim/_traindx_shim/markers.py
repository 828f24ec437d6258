"""The step marker's installation: a job that imports traindx marks its own steps with
traindx.step(); `diagnose --step-marker module:function` (TRAINDX_STEP_MARKER) wraps that function
so that each of its returns ends a step (steps.marker). The shared state is stepstate's."""

from __future__ import annotations

import atexit
import functools
import os
import sys

from . import emit, report_error
from .stepstate import MARKER_SPEC, _state

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType
    from typing import Any

# steps.marker, handed over by steps when it installs: this module cannot import steps (steps
# imports it), and a wrapped --step-marker function ends a step through it
_end_step: list[Callable[[str], None]] = []


def set_step_end(end_step: Callable[[str], None]) -> None:
    _end_step[:] = [end_step]


def _on_traindx(module: ModuleType) -> None:
    # a job that imports traindx marks its own steps with traindx.step(): from now on only
    # markers end steps (deciding at the first call would be too late: the optimizer steps of
    # that first iteration would already be steps of their own)
    if _state["mode"] != "marker":
        _state["mode"] = "marker"
        emit("step_marker", source="traindx.step", step=_state["step"])

        atexit.register(_marker_never_called)


def _marker_never_called() -> None:
    if not _state["marker_calls"]:
        report_error(
            "traindx.step",
            LookupError("the job imported traindx but never called traindx.step(): no steps were marked"),
        )


def _marker_target() -> tuple[str, str]:
    module_name, _, qualname = MARKER_SPEC.partition(":")
    return module_name, qualname


def _install_marker(module: ModuleType) -> bool:
    """Wrap `qualname` in `module`: each return of it ends a step."""
    if _state["marker_installed"]:
        return True
    _, qualname = _marker_target()
    owner: Any = module
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

    if not _end_step:
        return False
    end_step = _end_step[0]

    @functools.wraps(fn)
    def marked(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        end_step("--step-marker")
        return out

    setattr(owner, name, kind(marked) if kind else marked)
    _state["marker_installed"] = True
    emit("step_marker_installed", target=MARKER_SPEC)
    return True


def _marker_in_main() -> bool:
    """Whether --step-marker names a function of the script itself (`__main__` or its name)."""
    module_name, _ = _marker_target()
    stem = os.path.splitext(os.path.basename(sys.argv[0] if sys.argv else ""))[0]
    return module_name in ("__main__", stem)


def _install_marker_in_main() -> None:
    # the script's functions exist only once its top level has run: retried at each activity
    main = sys.modules.get("__main__")
    if main is not None and _state["marker_in_main"]:
        _install_marker(main)


def _on_marker_module(module: ModuleType) -> None:
    if not _install_marker(module):
        report_error("--step-marker", LookupError(f"{MARKER_SPEC}: no such function in that module"))


def _marker_never_found() -> None:
    if MARKER_SPEC and not _state["marker_installed"]:
        report_error(
            "--step-marker",
            LookupError(f"{MARKER_SPEC}: the job never defined that function; no step was marked by it"),
        )
