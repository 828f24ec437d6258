"""Which py-spy samples are which kind of work: a measured call's library frame owns everything
beneath it (forward, backward, data, io, compile), the optimizer's and torch's training utilities
own theirs, and a sample whose innermost user frame sits under none of them is host work. Read by
the GPU window (core/gpu_window.py) and the host family (host/code.py)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from traindx.analyzers.core import evidence as ev
from traindx.profiler.code_paths import installed_package

if TYPE_CHECKING:  # annotations only
    from traindx.analyzers.core.findings import Finding
    from traindx.profiler.speedscope import Frame


# a frame of a measured call owns everything beneath it (its time is another ledger line);
# (path fragment, function names or None for any), checked on library frames only
OWNING = (
    (
        "torch/nn/modules/module.py",
        {"_call_impl", "_wrapped_call_impl", "Module._call_impl", "Module._wrapped_call_impl"},
        "forward",
    ),
    ("torch/autograd/", None, "backward"),
    ("torch/_tensor.py", {"backward", "Tensor.backward"}, "backward"),
    ("torch/utils/data/dataloader.py", None, "data"),
    ("torch/serialization.py", None, "io"),
    ("torch/distributed/checkpoint/", None, "io"),
    ("torch/_dynamo/", None, "compile"),
    ("torch/_inductor/", None, "compile"),
    ("triton/", None, "compile"),
)


# frames of the optimizer step: they own their own work, not a closure's user code beneath them
OPTIMIZER_PATHS = ("torch/optim/",)


# torch's own training utilities between backward and the step (gradient clipping, zero_grad,
# the LR scheduler): the optimizer's work, not host work a user would move or cache
_TRAINING_MATH = (
    "torch/nn/utils/clip_grad.py",
    "torch/optim/lr_scheduler.py",
    "torch/nn/utils/parametrize.py",
)


_ZERO_GRAD = re.compile(r"(^|\.)zero_grad$")


# -- where the code comes from ------------------------------------------------------------------
def owning_category(frame: Frame) -> str | None:
    path = (frame.file or "").replace("\\", "/")
    for fragment, names, cat in OWNING:
        if fragment in path and (names is None or frame.name in names or frame.name.split(".")[-1] in names):
            return cat
    return None


def classify_stack(stack: Sequence[Frame]) -> Any:
    """("host", user frame, library frame beneath it or None) for a sample of host work, or
    (category, None, None) for a sample inside a measured call, or (None, None, None) for a
    sample with no user frame (the interpreter, a framework between its calls)."""
    owner = None
    user, lib_below = None, None
    for frame in stack:
        library = ev.is_library_path(frame.file)
        if not library:
            if owner in (None, "optimizer", "training_math"):
                owner, user, lib_below = None, frame, None
            continue
        path = (frame.file or "").replace("\\", "/")
        cat = owning_category(frame)
        if cat is not None:
            return cat, None, None
        if any(p in path for p in _TRAINING_MATH) or _ZERO_GRAD.search(frame.name or ""):
            owner = "training_math"
            continue
        if any(p in path for p in OPTIMIZER_PATHS):
            owner = "optimizer"
            continue
        if user is not None and lib_below is None:
            lib_below = frame
    if owner is not None:
        return owner, None, None
    if user is None:
        return None, None, None
    return "host", user, lib_below


def loop_window(stacks: Any) -> Any:
    """(first, last) sample index inside a measured call: the step loop, start-up and teardown
    left out (py-spy keeps sample order)."""
    kinds = [classify_stack(st)[0] for st in stacks]
    idx = [
        i for i, k in enumerate(kinds) if k in ("forward", "backward", "data", "optimizer", "training_math")
    ]
    if not idx:
        # a model so small that py-spy never caught it in a measured call: the training
        # thread's samples outside imports, from its first own line on
        idx = [
            i for i, (k, st) in enumerate(zip(kinds, stacks)) if k is not None and not ev.is_import_sample(st)
        ]
    return (idx[0], idx[-1]) if idx else None


def _at(f: Finding) -> tuple[Any, Any]:
    return ((f.evidence or {}).get("file"), (f.evidence or {}).get("line"))


def hands_work_to(host_line: Finding, gil_holder: Finding, roots: Sequence[Finding] = ()) -> bool:
    """A thread holding the GIL that runs the code of an installed library the training thread's
    line calls (a logger's writer thread: the line queues the records it encodes) does that line's
    work: both are the line's price, the line is what to change. host_line: a host_work finding at
    the job's line (roots: the others at that line, each ending in another call); gil_holder: a
    gil.contention finding (evidence: the thread's hottest frames)."""
    if host_line.id != "host_work.code" or gil_holder.id != "gil.contention":
        return False
    same = [r for r in (host_line, *roots) if r.id == "host_work.code" and _at(r) == _at(host_line)]
    calls = {str((r.evidence or {}).get("call") or "").split(".", 1)[0] for r in same}
    hot = (gil_holder.evidence or {}).get("hottest_frames") or []
    package = installed_package(str(hot[0].get("file") or "")) if hot else None
    return bool(package) and package in calls


def line_it_works_for(gil_holder: Finding, roots: Sequence[Finding]) -> Finding | None:
    """The costliest job's line (of gil_holder's rank) whose work that GIL-holding thread does."""
    fed = [r for r in roots if set(r.ranks) == set(gil_holder.ranks) and hands_work_to(r, gil_holder, roots)]
    return max(fed, key=lambda r: r.seconds_lost_per_step or 0.0, default=None)
