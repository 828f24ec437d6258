"""host_work's sources of code: the per-line groups of host code from the ledger's host intervals
or from py-spy's samples (core/stacks.py says which samples are host work), with their seconds per
steady step, and the job's source line a group names."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.stacks import OPTIMIZER_PATHS, classify_stack, loop_window, owning_category
from traindx.derive import ledger
from traindx.derive.sources import source_line as job_source_line

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

MIN_SAMPLES = 3  # py-spy samples of a line before it is named at all
LOADED_WAIT = 0.10  # of the step waiting for a core: a line needs MIN_SAMPLES that saw
# it run or block (not wait) before it is named

Group = dict[str, Any]  # one line of host code: function, file, line, call, seconds, ...

# calls whose time the shim books into another ledger line (its analyzer names them)
MEASURED_ELSEWHERE = (
    (re.compile(r"gc\.collect\s*\("), "gc"),
    (re.compile(r"\.(item|tolist|cpu)\s*\(\s*\)|\bsynchronize\s*\("), "sync"),
    (re.compile(r"\b(torch\.save|save_checkpoint)\s*\("), "io"),
)


def module_of(path: str | None) -> Any:
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
    text = job_source_line(path, line, cwd)
    return text.strip() if text is not None else None


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
    window = loop_window(samples.stacks)
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


def ledger_host_code(run: RunRecord) -> Any:
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


def host_capacity(led: pd.DataFrame) -> Any:
    """Seconds per steady step the ledger books host work in: `host` once measured, else the
    lines it is folded into today (fwd/bwd is a residual, unexplained the gaps, and a closure
    run by the optimizer step - Lightning's training_step - is inside the optimizer line)."""
    if "host_s" in led:
        return float((led["host_s"] + led["unexplained_s"]).mean())
    return float((led["forward_backward_s"] + led["unexplained_s"] + led["optimizer_s"]).mean())


# -- framework between its own calls -------------------------------------------------------------
# a line leads into the framework's measured calls in at least this many samples, and in this
# share of the samples where it runs work of its own (a torn sample is one in ~70 there)
ANCESTOR_MIN_SAMPLES = 2
ANCESTOR_MIN_SHARE = 0.05


def ancestor_lines(run: RunRecord, rank: str) -> Any:
    """(file, line) of the user frames that lead into the optimizer step or backward from
    above (a framework's fit() call, the script's train() call): code at those lines is the
    framework's loop between its measured calls, not a line of the user's loop body. A line
    counts only where its samples say so more than by chance: py-spy reads a running stack
    without stopping it, and a sample taken as a call returns can show the caller already on
    its next line above the callee's frames (one such sample made a 150 ms blocking read the
    line after `optimizer.step()` look like a framework's loop)."""
    rec = run.pyspy.get((rank, "all"))
    leads: Counter[tuple[str, int]] = Counter()  # samples where the line leads into a measured call
    own: Counter[tuple[str, int]] = Counter()  # samples where it is the innermost user line
    for _, samples in ev.merge_threads(rec).values():
        for stack in samples.stacks:
            users = [f for f in stack if not ev.is_library_path(f.file)]
            if users:
                own[(users[-1].file, users[-1].line)] += 1
            if classify_stack(stack)[0] not in ("optimizer", "backward", "data"):
                continue
            # every user frame above the measured call but the innermost
            for f in users[:-1]:
                leads[(f.file, f.line)] += 1
            lib_after = False
            for f in stack:
                if not ev.is_library_path(f.file):
                    lib_after = False
                    last_user = f
                elif owning_category(f) or any(p in (f.file or "") for p in OPTIMIZER_PATHS):
                    break
                else:
                    lib_after = True
            if users and lib_after:
                leads[(last_user.file, last_user.line)] += 1  # fit() -> library -> optimizer
    return {
        line
        for line, n in leads.items()
        if n >= ANCESTOR_MIN_SAMPLES and n >= ANCESTOR_MIN_SHARE * (own[line] - n)
    }


# -- per-line groups of host code --------------------------------------------------------------
def groups_from_ledger(table: pd.DataFrame, rank: str, led: pd.DataFrame) -> Any:
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
        if pd.isna(
            line
        ):  # a sample at an instruction of no line (Python 3.11), recorded before the shim's fix
            continue
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


def own_step_s(run: RunRecord, rank: str, led: pd.DataFrame) -> Any:
    """The steady step less the training thread's run-queue wait (the shim's `cpu` events,
    thread_runq_s), or None where a steady step has no such record: the step as the job's own
    work and blocking calls made it, whatever share of the cores other processes left it."""
    runq = ev.ledger_step_runq_s(run, rank, led["step"])
    if runq is None:
        return None
    wall = led["wall_s"].to_numpy(float)
    own = float((wall - np.minimum(wall, runq)).mean())
    return own if own > 0 else None


def groups_from_pyspy(run: RunRecord, rank: str, led: pd.DataFrame) -> Any:
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
    capacity = host_capacity(led)
    out = []
    for r in table.itertuples():
        seconds = min(r.share * mean_step, capacity)
        sampled = r.share * mean_step  # before the cap: a call booked in another line
        lib_fn = r.lib_function if isinstance(r.lib_function, str) else None
        lib_file = r.lib_file if isinstance(r.lib_file, str) else None
        call = f"{module_of(lib_file)}.{lib_fn.split('.')[-1]}" if lib_fn else None
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


def without_runqueue_wait(group: Group, own_step: float, step_s: float) -> None:
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


def claimed_line(src: str | None, led: pd.DataFrame) -> Any:
    """The ledger line a call of this source line is booked in, when that line is non-zero."""
    for rx, cat in MEASURED_ELSEWHERE:
        if src and rx.search(src) and f"{cat}_s" in led and float(led[f"{cat}_s"].sum()) > 0:
            return cat
    return None


def display_path(path: str, cwd: str | None) -> Any:
    """A file as the user names it: relative to the job's working folder when it lies inside it."""
    if cwd and path and path.startswith(cwd.rstrip("/") + "/"):
        return path[len(cwd.rstrip("/")) + 1 :]
    return path
