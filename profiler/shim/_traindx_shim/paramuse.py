"""Work nobody uses: which parameters receive gradients and which an optimizer updates, and how
often the optimizer steps per backward.

- `param_use` (once, at the end of step CHECK_STEP, again when an optimizer's param groups
  change): the parameters of the modules the training thread calls outermost (forward.py's
  discovery) that held a gradient at an optimizer step, against those in a param group of an
  optimizer that stepped with a non-zero learning rate. Parameters with a gradient that no such
  group holds (requires_grad left on, a learning rate of 0, in no param group) are grouped by
  the largest module made only of them, each with the line that built it (Module.__init__'s
  caller outside the module's own constructors) and why it is not updated (`lr0`, `none`).
- `grad_accum` (once, at the end of step ACCUM_STEP): backward calls, optimizer steps and
  gradient-clipping calls per step, the scale the loss carried into backward (the root of its
  graph: a division or a multiplication by a Python number) and the job's lines of each call.

Candidate arm of `diagnose --fix` (TRAINDX_RUNTIME_PATCHES=freeze_unused_params): the
parameters found unused are frozen (requires_grad_(False), .grad dropped) right after the check,
so the steps after it measure the job without their backward.

Cost: a flag read per optimizer step and per backward once the checks are done; stack walks only
at model build and in the first steps.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import time
import weakref

from . import bus, emit, guarded, importhooks, report_error, schema
from .forward import _top_modules
from .frames import describe, is_library_file, is_library_path
from .stepstate import _state as _steps

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

FREEZE_PATCH = "freeze_unused_params"
CHECK_STEP = 1  # step 0 finds the outermost modules; step 1's gradients are checked
ACCUM_STEP = 2  # steps 0..2: calls per step
MAX_GROUPS = 20
_built: Any = None  # WeakKeyDictionary: module -> the job's frame that built it
_state: dict[str, Any] = {
    "done": False,
    "with_grad": {},  # id(param) -> param, seen with a gradient at an optimizer step
    "optimizers": {},  # id -> optimizer, seen stepping while checking
    "signature": {},  # id(optimizer) -> (groups, zero-lr groups) when checked
    "accum_done": False,
    "counts": {},  # step -> {"backward": n, "optimizer": n, "clip": n}
    "scales": [],
    "sites": {},  # "backward" | "optimizer" | "clip" -> frame
    "frozen": 0,
    "settings": {},  # "<class>.<attribute>" -> an accumulation setting seen on the stack at backward
}


def _freeze_requested() -> bool:
    return FREEZE_PATCH in {p.strip() for p in os.environ.get("TRAINDX_RUNTIME_PATCHES", "").split(",")}


def _user_frame(frame: Any) -> dict[str, Any] | None:
    """The innermost frame of the job's own files (no installed package, frameworks included)."""
    while frame is not None:
        name = frame.f_code.co_filename
        if not is_library_file(name) and not is_library_path(name):
            return describe(frame)
        frame = frame.f_back
    return None


# -- where a module was built ---------------------------------------------------------------------
def _wrap_module_init(torch: Any) -> None:
    global _built
    _built = weakref.WeakKeyDictionary()
    original = torch.nn.Module.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            if self in _built:
                return
            frame: Any = sys._getframe(1)
            # up through the module's own constructors (super().__init__ chains)
            while (
                frame is not None
                and frame.f_code.co_name == "__init__"
                and frame.f_locals.get("self") is self
            ):
                frame = frame.f_back
            site = _user_frame(frame)
            if site is not None:
                _built[self] = site
        except Exception as exc:
            report_error("module build site", exc)

    torch.nn.Module.__init__ = __init__


# -- gradients against updates --------------------------------------------------------------------
def _lr(group: dict[str, Any]) -> float:
    try:
        return float(group.get("lr", 1.0))
    except (TypeError, ValueError):
        return 1.0


def _signature(optimizer: Any) -> tuple[int, int]:
    groups = optimizer.param_groups
    return len(groups), sum(1 for g in groups if _lr(g) == 0.0)


def _pre_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if not _state["accum_done"]:
        try:
            _count("optimizer")
        except Exception as exc:
            report_error("grad accumulation", exc)
    if _state["done"]:
        sig = _state["signature"].get(id(optimizer))
        if sig is None or sig == _signature(optimizer):
            return
        _state["done"] = False  # its param groups changed: check the next step again
        _state["with_grad"] = {}
        _state["optimizers"] = {}
    if _steps["step"] < CHECK_STEP:
        return
    try:
        _state["optimizers"][id(optimizer)] = optimizer
        seen = _state["with_grad"]
        for ref in list(_top_modules.values()):
            module = ref()
            if module is None:
                continue
            for p in module.parameters():
                if p.grad is not None and p.requires_grad:
                    seen[id(p)] = p
    except Exception as exc:
        report_error("param use", exc)


def _step_ended(step: int) -> None:
    if _timing["handles"] and step >= _timing["step"]:
        _timed_forward(step)
    if not _state["done"] and step >= CHECK_STEP and _state["optimizers"]:
        _state["done"] = True
        _check(step)
    if not _state["accum_done"] and step >= ACCUM_STEP:
        _state["accum_done"] = True
        _emit_accum()


def _check(step: int) -> None:
    updated: dict[int, str] = {}  # id(param) -> "updated" | "lr0"
    for opt in _state["optimizers"].values():
        _state["signature"][id(opt)] = _signature(opt)
        for group in opt.param_groups:
            zero = _lr(group) == 0.0
            for p in group.get("params", ()):
                if not zero:
                    updated[id(p)] = "updated"
                else:
                    updated.setdefault(id(p), "lr0")
    with_grad = _state["with_grad"]
    unused = {k for k in with_grad if updated.get(k) != "updated"}
    roots = []
    for ref in list(_top_modules.values()):
        module = ref()
        if module is not None and any(True for _ in module.parameters()):
            roots.append(module)
    groups, total_grad, total_unused = [], 0, 0
    for root in roots:
        g, n_grad, n_unused = _unused_modules(root, with_grad, unused, updated)
        groups += g
        total_grad += n_grad
        total_unused += n_unused
    emit(
        schema.PARAM_USE,
        step=step,
        optimizers=len(_state["optimizers"]),
        grad_numel=total_grad,
        unused_numel=total_unused,
        unused=groups[:MAX_GROUPS],
        frozen=_state["frozen"],
    )
    if total_unused and _freeze_requested():
        _freeze(roots, unused)
    elif total_unused:
        _time_forward(roots, groups, step)
    _state["with_grad"] = {}


def _built_owner(root: Any, name: str) -> dict[str, Any]:
    """Where the job's line that built the module `name` of `root` hands it over: the outermost
    module (root included) built at the same line of the job's files. A module an installed
    package builds inside a model the job creates (a transformers model's encoder) has the job's
    line of the whole model: the freeze is then `<that model>.<built_path>`. `freeze_methods`:
    the owner's own freezing methods (a framework's `freeze_*`), named for the prescription."""
    built = _built or {}
    site = built.get(root.get_submodule(name))
    if not site:
        return {}
    key = (site.get("file"), site.get("line"))
    parts = name.split(".") if name else []
    for depth in range(len(parts) + 1):  # outermost first
        prefix = ".".join(parts[:depth])
        owner = root.get_submodule(prefix)
        other = built.get(owner)
        if other and (other.get("file"), other.get("line")) == key:
            methods = sorted(
                m
                for m in dir(type(owner))
                if m.startswith("freeze") and callable(getattr(type(owner), m, None))
            )
            return {
                "built_path": ".".join(parts[depth:]),
                "built_cls": type(owner).__name__,
                "freeze_methods": methods[:8],
            }
    return {}


# -- what the unused modules' forward costs (their backward is priced from it) ---------------------
_timing: dict[str, Any] = {
    "handles": [],
    "step": None,
    "ns": 0,  # the unused modules' own forward
    "calls": 0,
    "open": {},
    "prefix_ns": 0,  # root call start -> last unused module's end, where nothing trained ran before
    "call": None,  # the running root call: [start, last unused end, a trained module began first]
}


def _time_forward(roots: list[Any], groups: list[dict[str, Any]], step: int) -> None:
    """Time the forward of the unused modules over the next step (hooks taken off after it), and,
    where they run first in the root's forward (no trained module before them: a frozen body
    under a trained head), the forward from the root call's start to their end: backward never
    has to reach that part once they are frozen."""
    by_root = {type(r).__name__: r for r in roots}
    now = time.perf_counter_ns
    unused_ids = set()

    def pre(module: Any, args: Any) -> None:
        _timing["open"][id(module)] = now()

    def post(module: Any, args: Any, output: Any) -> None:
        start = _timing["open"].pop(id(module), None)
        end = now()
        if start is not None:
            _timing["ns"] += end - start
            _timing["calls"] += 1
        call = _timing["call"]
        if call is not None and not call[2]:
            call[1] = end

    def trained(module: Any, args: Any) -> None:
        call = _timing["call"]
        if call is not None and call[1] is None:
            call[2] = True  # a trained module ran before any unused one ended

    def root_pre(module: Any, args: Any) -> None:
        if _timing["call"] is None:
            _timing["call"] = [now(), None, False]

    def root_post(module: Any, args: Any, output: Any) -> None:
        call, _timing["call"] = _timing["call"], None
        if call is not None and call[1] is not None and not call[2]:
            _timing["prefix_ns"] += call[1] - call[0]

    for g in groups:
        root = by_root.get(g["root"])
        module = root.get_submodule(g["module"]) if root is not None else None
        if module is not None:
            unused_ids.update(id(m) for m in module.modules())
            _timing["handles"] += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    for root in roots:
        _timing["handles"] += [
            root.register_forward_pre_hook(root_pre),
            root.register_forward_hook(root_post),
        ]
        for m in root.modules():
            if id(m) not in unused_ids and any(True for _ in m.parameters(recurse=False)):
                _timing["handles"].append(m.register_forward_pre_hook(trained))
    _timing["step"] = step + 1


def _timed_forward(step: int) -> None:
    for handle in _timing["handles"]:
        handle.remove()
    _timing["handles"] = []
    emit(
        schema.PARAM_USE,
        step=step,
        unused_forward_s=_timing["ns"] / 1e9,
        unused_prefix_s=_timing["prefix_ns"] / 1e9,
        forward_calls=_timing["calls"],
    )


def _unused_modules(
    root: Any, with_grad: dict[int, Any], unused: set[int], updated: dict[int, str]
) -> tuple[list[dict[str, Any]], int, int]:
    """The largest modules of `root` whose every parameter is unused, and the numel totals."""
    groups: list[dict[str, Any]] = []
    taken: list[str] = []
    n_grad = sum(p.numel() for p in root.parameters() if id(p) in with_grad)
    n_unused = sum(p.numel() for p in root.parameters() if id(p) in unused)
    if not n_unused:
        return groups, n_grad, 0
    for name, module in root.named_modules():
        if any(name == t or name.startswith(t + ".") for t in taken if t) or (name and "" in taken):
            continue
        params = list(module.parameters())
        if not params or not all(id(p) in unused for p in params):
            continue
        taken.append(name)
        reasons = sorted({updated.get(id(p), "none") for p in params})
        groups.append(
            {
                "module": name,
                "root": type(root).__name__,
                "cls": type(module).__name__,
                "numel": sum(p.numel() for p in params),
                "reason": ",".join(reasons),
                "built": (_built or {}).get(module),
                **_built_owner(root, name),
            }
        )
    return groups, n_grad, n_unused


def _freeze(roots: list[Any], unused: set[int]) -> None:
    n = 0
    for root in roots:
        for p in root.parameters():
            if id(p) in unused and p.requires_grad:
                p.requires_grad_(False)
                p.grad = None
                n += 1
    _state["frozen"] += n
    emit(schema.RUNTIME_PATCH, patch=FREEZE_PATCH, params=n, note="unused parameters frozen after the check")


# -- optimizer steps and clipping per backward ----------------------------------------------------
def _count(kind: str) -> None:
    step = _steps["step"]
    counts = _state["counts"].setdefault(step, {"backward": 0, "optimizer": 0, "clip": 0})
    counts[kind] += 1
    if kind not in _state["sites"]:
        _state["sites"][kind] = _user_frame(sys._getframe(1))


def _loss_scale(tensor: Any) -> float | None:
    """The number the loss was divided (or multiplied) by at the root of its graph: Python
    numbers (wrapped CPU scalars, read without a device sync), multiplied down a chain of them
    (the job's `loss / 4` under a framework's own `/ accumulate_grad_batches` of 1)."""
    fn = getattr(tensor, "grad_fn", None)
    total, found = 1.0, False
    for _ in range(4):
        scale = _node_scale(fn)
        if scale is None:
            break
        total, found = total * scale, True
        nxt = getattr(fn, "next_functions", ())
        fn = nxt[0][0] if nxt else None
    return total if found else None


def _node_scale(fn: Any) -> float | None:
    name = type(fn).__name__ if fn is not None else ""
    if not name.startswith(("DivBackward", "MulBackward")):
        return None
    other: Any = getattr(fn, "_saved_other", None)
    if hasattr(other, "dim"):
        if other.dim() != 0 or other.device.type != "cpu":
            return None
        other = other.item()
    if not isinstance(other, (int, float)) or other == 0:
        return None
    return float(other) if name.startswith("Div") else 1.0 / float(other)


_ACCUM_NAME = re.compile(r"accum", re.IGNORECASE)  # how frameworks and scripts name the setting
_PLAIN = (int, float, str, bytes, bool, type(None), list, tuple, dict, set)


def _accum_value(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 4096 else None


def _settings_of(value: Any) -> list[tuple[str, int]]:
    """(attribute, value) of an object's accumulation settings: its own attributes and its
    class's properties whose name says accumulation, with a whole number (a framework's
    `gradient_accumulation_steps`, `accumulate_grad_batches`, a config's)."""
    found = []
    for name, v in list(getattr(value, "__dict__", {}).items())[:400]:
        if _ACCUM_NAME.search(name) and _accum_value(v) is not None:
            found.append((name, int(v)))
    for klass in type(value).__mro__[:-1]:
        for name, attr in list(vars(klass).items()):
            if isinstance(attr, property) and _ACCUM_NAME.search(name):
                try:
                    v = getattr(value, name)
                except Exception:  # a property that needs state the object lacks
                    continue
                if _accum_value(v) is not None:
                    found.append((name, int(v)))
    return found


def _scan_settings(frame: Any) -> None:
    """The accumulation settings of the objects the frames calling backward hold (the job's
    `args`, a framework's Trainer, Accelerator or its arguments): the setting the loss is scaled
    for wherever a framework or the code sets it, with the job's local name that reaches it."""
    seen = _state["settings"]
    depth = 0
    while frame is not None and depth < 40 and len(seen) < 16:
        user = not is_library_file(frame.f_code.co_filename) and not is_library_path(frame.f_code.co_filename)
        for local, value in list(frame.f_locals.items())[:200]:
            if isinstance(value, (*_PLAIN, type)):
                continue
            for name, v in _settings_of(value):
                key = f"{type(value).__name__}.{name}"
                entry = seen.setdefault(
                    key,
                    {
                        "owner": type(value).__name__,
                        "module": type(value).__module__,
                        "name": name,
                        "value": v,
                    },
                )
                if user and "expr" not in entry:
                    entry["expr"] = f"{local}.{name}"
                    entry["site"] = describe(frame)
                    entry["mechanisms"] = sorted(
                        m
                        for m in dir(type(value))
                        if _ACCUM_NAME.search(m) and callable(getattr(type(value), m, None))
                    )[:4]
        frame = frame.f_back
        depth += 1


def _wrap_backward(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _state["accum_done"]:
            try:
                _count("backward")
                if len(_state["scales"]) < 8:
                    _state["scales"].append(_loss_scale(self))
                if len(_state["scales"]) <= 2:
                    _scan_settings(sys._getframe(1))
            except Exception as exc:
                report_error("grad accumulation", exc)
        return fn(self, *args, **kwargs)

    return backward


def _wrap_clip(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def clip(*args: Any, **kwargs: Any) -> Any:
        if _state["accum_done"] or _clipping[0]:
            return fn(*args, **kwargs)
        try:
            _count("clip")
        except Exception as exc:
            report_error("grad accumulation", exc)
        _clipping[0] = True  # one count per clipping call (clip_grad_norm_ may call the others)
        try:
            return fn(*args, **kwargs)
        finally:
            _clipping[0] = False

    return clip


_clipping = [False]


def _emit_accum() -> None:
    steps = sorted(s for s in _state["counts"] if 0 <= s <= ACCUM_STEP)
    per = [_state["counts"][s] for s in steps]
    scales = [s for s in _state["scales"] if s is not None]
    emit(
        schema.GRAD_ACCUM,
        steps=len(per),
        backward=[c["backward"] for c in per],
        optimizer=[c["optimizer"] for c in per],
        clip=[c["clip"] for c in per],
        loss_scale=scales[0] if scales and all(abs(s - scales[0]) < 1e-9 for s in scales) else None,
        sites=_state["sites"],
        settings=list(_state["settings"].values()),
    )


@guarded("param use hooks")
def _on_torch(torch: Any) -> None:
    # imported only once the job imported torch (the shim never imports it itself)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _wrap_module_init(torch)
    register_optimizer_step_pre_hook(_pre_step)
    torch.Tensor.backward = _wrap_backward(torch.Tensor.backward)
    utils = torch.nn.utils
    # clip_grads_with_norm_: the clipping of frameworks that compute the norm themselves (Accelerate)
    for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_"):
        if hasattr(utils, name):
            setattr(utils, name, _wrap_clip(getattr(utils, name)))
    bus.subscribe(schema.STEP_ENDED, _step_ended)


def register() -> None:
    importhooks.on_import("torch", _on_torch)
