"""host_work's sources of code: which py-spy samples are host work (a measured call's frame owns
everything beneath it), and the per-line groups of host code from the ledger's host intervals or
from py-spy's samples, with their seconds per steady step."""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers import evidence as ev
from traindx.common import untrusted
from traindx.derive import ledger

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord
    from traindx.profiler.speedscope import Frame

MIN_SAMPLES = 3  # py-spy samples of a line before it is named at all
LOADED_WAIT = 0.10  # of the step waiting for a core: a line needs MIN_SAMPLES that saw
# it run or block (not wait) before it is named

Group = dict[str, Any]  # one line of host code: function, file, line, call, seconds, ...


# a frame of a measured call owns everything beneath it (its time is another ledger line);
# (path fragment, function names or None for any), checked on library frames only
_OWNING = (
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
_OPTIMIZER = ("torch/optim/",)
# torch's own training utilities between backward and the step (gradient clipping, zero_grad,
# the LR scheduler): the optimizer's work, not host work a user would move or cache
_TRAINING_MATH = (
    "torch/nn/utils/clip_grad.py",
    "torch/optim/lr_scheduler.py",
    "torch/nn/utils/parametrize.py",
)
_ZERO_GRAD = re.compile(r"(^|\.)zero_grad$")


# -- where the code comes from ------------------------------------------------------------------
def _lib_category(frame: Frame) -> str | None:
    path = (frame.file or "").replace("\\", "/")
    for fragment, names, cat in _OWNING:
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
        cat = _lib_category(frame)
        if cat is not None:
            return cat, None, None
        if any(p in path for p in _TRAINING_MATH) or _ZERO_GRAD.search(frame.name or ""):
            owner = "training_math"
            continue
        if any(p in path for p in _OPTIMIZER):
            owner = "optimizer"
            continue
        if user is not None and lib_below is None:
            lib_below = frame
    if owner is not None:
        return owner, None, None
    if user is None:
        return None, None, None
    return "host", user, lib_below


def _module_of(path: str | None) -> Any:
    """'numpy.core.fromnumeric' of '/…/site-packages/numpy/core/fromnumeric.py'."""
    path = (path or "").replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/", "/lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            if marker == "/lib/python3":
                path = path.split("/", 1)[1] if "/" in path else path
            break
    path = path[:-3] if path.endswith(".py") else path
    return path.strip("/<>").replace("/", ".").replace("frozen ", "")


def source_line(path: str, line: int, cwd: str | None = None) -> Any:
    """The job's source line (stripped), or None when the file is not readable here."""
    for candidate in (path, os.path.join(cwd or "", path)):
        try:  # this machine's file: never for a folder recorded elsewhere, never a FIFO (untrusted)
            lines = untrusted.local_text(candidate).splitlines()
            return lines[line - 1].strip() if 1 <= line <= len(lines) else None
        except OSError:
            continue
    return None


def _loop_window(stacks: Any) -> Any:
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


def pyspy_host_code(run: RunRecord, rank: str) -> Any:
    """(DataFrame like ledger.host_code for one rank without steps: function, file, line, call,
    lib_file, share, samples) from py-spy, or None without a recording of the training thread."""
    rec_all = run.pyspy.get((rank, "all"))
    if not rec_all:
        return None
    tid = ev.main_thread_id(rec_all, run.pyspy.get((rank, "gil")))
    threads = ev.merge_threads(rec_all)
    if tid not in threads:
        return None
    samples = threads[tid][1]
    window = _loop_window(samples.stacks)
    if window is None:
        return None
    lo, hi = window
    total = 0.0
    groups = defaultdict(lambda: [0.0, 0, 0])  # seconds, samples, runs (bursts in time order)
    previous = None
    for stack, weight in zip(samples.stacks[lo : hi + 1], samples.weights[lo : hi + 1]):
        if ev.is_import_sample(stack):
            continue
        total += weight
        what, user, lib = classify_stack(stack)
        if what != "host":
            previous = None
            continue
        key = (user.name, user.file, user.line, lib.name if lib else None, lib.file if lib else None)
        g = groups[key]
        g[0] += weight
        g[1] += 1
        if previous != (user.name, user.file):  # one execution: consecutive samples of it
            g[2] += 1
        previous = (user.name, user.file)
    if not total:
        return None
    rows = [
        {
            "function": k[0],
            "file": k[1],
            "line": k[2],
            "lib_function": k[3],
            "lib_file": k[4],
            "seconds_sampled": w,
            "samples": n,
            "runs": r,
            "share": w / total,
        }
        for k, (w, n, r) in groups.items()
    ]
    return pd.DataFrame(
        rows,
        columns=[
            "function",
            "file",
            "line",
            "lib_function",
            "lib_file",
            "seconds_sampled",
            "samples",
            "runs",
            "share",
        ],
    ), total


def _ledger_host_code(run: RunRecord) -> Any:
    """traindx.derive.ledger.host_code(run) when the derive layer has it (helper `ledger`), else None."""
    fn = getattr(ledger, "host_code", None)
    if fn is None:
        return None
    try:
        table = fn(run)
    except Exception:
        return None
    if table is None or not len(table):
        return None
    return table


def _host_capacity(led: pd.DataFrame) -> Any:
    """Seconds per steady step the ledger books host work in: `host` once measured, else the
    lines it is folded into today (fwd/bwd is a residual, unexplained the gaps, and a closure
    run by the optimizer step - Lightning's training_step - is inside the optimizer line)."""
    if "host_s" in led:
        return float((led["host_s"] + led["unexplained_s"]).mean())
    return float((led["forward_backward_s"] + led["unexplained_s"] + led["optimizer_s"]).mean())


# -- framework between its own calls -------------------------------------------------------------
def _ancestor_lines(run: RunRecord, rank: str) -> Any:
    """(file, line) of the user frames that lead into the optimizer step or backward from
    above (a framework's fit() call, the script's train() call): code at those lines is the
    framework's loop between its measured calls, not a line of the user's loop body."""
    rec = run.pyspy.get((rank, "all"))
    out = set()
    for _, samples in ev.merge_threads(rec).values():
        for stack in samples.stacks:
            if classify_stack(stack)[0] not in ("optimizer", "backward", "data"):
                continue
            users = [f for f in stack if not ev.is_library_path(f.file)]
            # every user frame above the measured call but the innermost
            for f in users[:-1]:
                out.add((f.file, f.line))
            lib_after = False
            for f in stack:
                if not ev.is_library_path(f.file):
                    lib_after = False
                    last_user = f
                elif _lib_category(f) or any(p in (f.file or "") for p in _OPTIMIZER):
                    break
                else:
                    lib_after = True
            if users and lib_after:
                out.add((last_user.file, last_user.line))  # fit() -> library -> optimizer
    return out


# -- per-line groups of host code --------------------------------------------------------------
def _groups_from_ledger(table: pd.DataFrame, rank: str, led: pd.DataFrame) -> Any:
    """Per line seconds per steady step from ledger.host_code (and per step, for periods)."""
    t = table[table["rank"].astype(str) == str(rank)]
    steps = {int(s) for s in led["step"]}
    t = t[t["step"].isin(steps)]
    if not len(t):
        return []
    n = max(1, len(led))
    out = []
    waits = "runq_s" in t and t["runq_s"].notna().any()
    if "via" not in t:
        t = t.assign(via=None)
    for (fn, file, line, call, via), g in t.groupby(
        ["function", "file", "line", "call", "via"], dropna=False
    ):
        per_step = g.groupby("step")["seconds"].sum()
        out.append(
            {
                "function": fn,
                "file": file,
                "line": int(line),
                "call": call,
                "via": via if isinstance(via, str) else None,
                "lib_file": None,
                "seconds": float(per_step.sum()) / n,
                "runq_s": float(g["runq_s"].fillna(0.0).sum()) / n if waits else None,
                "samples": int(g["samples"].sum()) if "samples" in g else None,
                "per_step": per_step.reindex(sorted(steps), fill_value=0.0),
                "method": "traindx.derive.ledger.host_code: the ledger's host intervals",
            }
        )
    return out


def _own_step_s(run: RunRecord, rank: str, led: pd.DataFrame) -> Any:
    """The steady step less the training thread's run-queue wait (the shim's `cpu` events,
    thread_runq_s), or None where a steady step has no such record: the step as the job's own
    work and blocking calls made it, whatever share of the cores other processes left it."""
    runq = ev.ledger_step_runq_s(run, rank, led["step"])
    if runq is None:
        return None
    wall = led["wall_s"].to_numpy(float)
    own = float((wall - np.minimum(wall, runq)).mean())
    return own if own > 0 else None


def _groups_from_pyspy(run: RunRecord, rank: str, led: pd.DataFrame) -> Any:
    found = pyspy_host_code(run, rank)
    if found is None:
        return []
    table, total = found
    steps = run.rank_steps(rank)
    n_steps = max(1, len(steps))
    # samples per second the recorder really took over the loop (a starved py-spy takes fewer)
    rate = (
        float(table["samples"].sum()) / max(1e-9, float(table["seconds_sampled"].sum()))
        if len(table)
        else 0.0
    )
    mean_step = (
        float(steps["duration_s"].mean())
        if len(steps) and "duration_s" in steps
        else float(led["wall_s"].mean())
    )
    capacity = _host_capacity(led)
    out = []
    for r in table.itertuples():
        seconds = min(r.share * mean_step, capacity)
        sampled = r.share * mean_step  # before the cap: a call booked in another line
        lib_fn = r.lib_function if isinstance(r.lib_function, str) else None
        lib_file = r.lib_file if isinstance(r.lib_file, str) else None
        call = f"{_module_of(lib_file)}.{lib_fn.split('.')[-1]}" if lib_fn else None
        out.append(
            {
                "function": r.function,
                "file": r.file,
                "line": int(r.line),
                "call": call,
                "lib_file": lib_file,
                "seconds": seconds,
                "per_step": None,
                "seconds_sampled": sampled,
                "samples": int(r.samples),
                "share_of_loop_samples": round(float(r.share), 4),
                "runs": int(r.runs),
                "loop_steps": n_steps,
                "sample_rate": rate,
                "few_samples": int(r.samples) < MIN_SAMPLES,
                "method": (
                    "py-spy samples of the training thread outside its measured calls "
                    "(share of the loop's samples x the mean step)"
                ),
            }
        )
    return out


def _without_runqueue_wait(group: Group, own_step: float, step_s: float) -> None:
    """A line's cost with the time its thread waited there for a core left out, and its share
    of the step's own time (the step less all its run-queue wait): on a loaded machine a preempted thread stays at the line its time slice ended in,
    so a line of a few ms of Python can absorb tens of ms of other processes' time in one step
    and none in the next; its share of the thread's own time is what it costs wherever the
    job runs (a blocking call keeps its wall time: the thread sleeps, it does not wait)."""
    wall, waited = group["seconds"], min(group["runq_s"], group["seconds"])
    group["seconds"] = max(0.0, wall - waited)
    group["share"] = group["seconds"] / own_step
    group["runqueue_wait"] = {
        "line_wall_s": round(wall, 5),
        "line_runq_s": round(waited, 5),
        "step_own_s": round(own_step, 5),
        "step_s": round(step_s, 5),
    }
    if group.get("samples") is not None and wall > 0 and own_step < (1 - LOADED_WAIT) * step_s:
        # the samples that saw the thread run or block there, not wait: the evidence of its cost
        # (a loaded machine starves the sampler too: a step may have one or two samples)
        own_samples = group["samples"] * group["seconds"] / wall
        group["runqueue_wait"]["own_samples"] = round(own_samples, 2)
        group["few_samples"] = own_samples < MIN_SAMPLES
