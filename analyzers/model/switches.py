"""Switches that tax every op: process-wide settings left on that slow every operation or step.

The shim records each one at torch's import and whenever the job changes it (`switch` events with
the job's line: profiler/shim/_traindx_shim/switches.py). A switch on during the steady steps that
costs time on this job (a CUDA variable costs nothing on a CPU-only run) is a finding naming the
line or variable that set it, priced as a share of the ledger lines it slows (its cost is per
op) and measured by `--fix`: an edit of the job's line, else the shim's runtime patch
`switch_off:<name>`."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traindx.analyzers import codefix
from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.declaration import Declaration
from traindx.analyzers.core.findings import Finding, Prescription, SourceEdit
from traindx.derive.sources import source_lines, source_text

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

IDS = (
    "switches.anomaly",
    "switches.deterministic",
    "switches.default_dtype",
    "switches.num_threads",
    "switches.profiler",
    "switches.trace",
    "switches.tracemalloc",
    "switches.memory_history",
    "switches.debug_env",
    "switches.python_dev_mode",
)
DECLARATION = Declaration(
    name="switches",
    order=135,
    ids=IDS,
    explains=("steps.instability", "host_work.code", "gpu_idle.host_starved", "gpu.launch_bound"),
)
OFF_PATCH = "switch_off:"
MODEL_LINES = ("forward_backward", "optimizer")


@dataclass(frozen=True)
class Known:
    """What one switch costs and how it is turned off at its line."""

    title: str
    why: str
    lines: tuple[str, ...]  # the ledger lines it slows
    fraction: float  # the share of those lines it adds (predicted; --fix measures)
    gpu_only: bool = False
    off_edit: tuple[str, str] | None = None  # (regex on the line, replacement); None: delete the line
    cpu_fraction: float | None = None  # the share on a run without a GPU, where it differs
    keywords: tuple[str, ...] = ()  # a framework's argument that turns it on (`Trainer(detect_anomaly=True)`)
    gpu_lines: tuple[str, ...] = ()  # lines it slows besides `lines` on a GPU run (the GPU's own time)


# a line a `with ...:` cannot prefix: a block's head, a return (it parses only in its function)
BLOCK_HEAD = re.compile(r"(with|if|for|while|def|class|try|elif|else|return|yield|async)\b")
KNOWN: dict[str, Known] = {
    "anomaly": Known(
        "autograd anomaly detection left on",
        "every op of the forward records its stack for the backward, and every backward node is "
        "checked for NaN",
        MODEL_LINES,
        # measured on an H200, a GPT-style bf16 step (bench/gpu_switch_cases.sh): 0.80 of the
        # forward/backward and optimizer lines; on CPU scripts the --fix arms saved 39-62 % of the step
        0.75,
        cpu_fraction=0.50,
        off_edit=(r"\bdetect_anomaly\(\s*\)", "set_detect_anomaly(False)"),
        keywords=("detect_anomaly",),
    ),
    "deterministic": Known(
        "deterministic algorithms forced",
        "ops without a deterministic kernel take slower ones (atomics-free scatter, no cuDNN autotune)",
        MODEL_LINES,
        0.35,  # H200, GPT-style bf16 step: 0.39 (bench/gpu_switch_cases.sh)
        gpu_only=True,
        keywords=("deterministic",),
    ),
    "default_dtype": Known(
        "float64 default dtype",
        "every new float tensor and parameter is float64: twice the memory traffic, and on a GPU a "
        "small fraction of its float32 throughput",
        MODEL_LINES,
        # H200, GPT-style step under bf16 autocast: the float64 parameters and elementwise ops
        # made the GPU the bottleneck (its time is the host's sync wait): 0.76 of the lines
        0.75,
        gpu_lines=("sync",),
        # a CPU runs float64 at half its float32 rate at most, and small models are bound by the
        # per-op overhead (on a loaded 2-core machine: minGPT gpt-nano 1.01x, Lightning demo transformer 1.47x)
        cpu_fraction=0.25,
    ),
    "num_threads": Known(
        "intra-op threads far from the cores",
        "torch's intra-op pool has far fewer threads than the cores the process may use",
        MODEL_LINES,
        0.30,
    ),
    "profiler": Known(
        "a profiler the job started itself",
        "every op is recorded (with its shapes and stack where asked) while it is active",
        MODEL_LINES,
        0.20,
    ),
    "trace": Known(
        "a Python tracer or profile function the job set",
        "every Python call (and line, for a tracer) of every thread it covers runs a Python callback",
        ("forward_backward", "optimizer", "host", "data"),
        0.50,
    ),
    "tracemalloc": Known(
        "tracemalloc started by the job",
        "every Python allocation records its traceback",
        ("host", "data", "forward_backward"),
        0.20,
    ),
    "memory_history": Known(
        "CUDA memory history recording",
        "every allocation and free records a stack trace",
        MODEL_LINES,
        0.02,  # H200, GPT-style bf16 step: 0.1 ms of 26 ms (bench/gpu_switch_cases.sh)
        gpu_only=True,
    ),
    "eval_grad": Known(
        "an evaluation that builds an autograd graph",
        "a model in eval mode ran with grad enabled and nothing ran backward through its output: "
        "its forward recorded the graph and kept its activations for nothing",
        ("forward_backward",),
        0.10,
        cpu_fraction=0.01,  # a CPU evaluation's graph: a few % of its forward (measured 0.93-1.0x)
    ),
    "python_dev_mode": Known(
        "Python development mode (-X dev)",
        "debug hooks on every allocation and extra runtime checks",
        ("host", "data", "forward_backward"),
        0.15,
    ),
}
# debug variables: (what it costs, the ledger lines, fraction, gpu only, needs, the value that turns it off)
# needs: "" always, "compile" a torch.compile in the run, "ranks" more than one rank
ENV_COSTS: dict[str, tuple[str, tuple[str, ...], float, bool, str, str | None]] = {
    # GPU fractions measured on an H200, a GPT-style bf16 step (bench/gpu_switch_cases.sh): 0.36, 0.78
    "CUDA_LAUNCH_BLOCKING": ("every kernel launch waits for the kernel", MODEL_LINES, 0.35, True, "", "0"),
    "PYTORCH_NO_CUDA_MEMORY_CACHING": (
        "every allocation is a cudaMalloc and every free a synchronizing cudaFree",
        MODEL_LINES,
        0.70,
        True,
        "",
        None,
    ),
    "TORCH_LOGS": (
        "dynamo and inductor log every graph, guard and recompile",
        ("compile",),
        0.3,
        False,
        "compile",
        None,
    ),
    "TORCHDYNAMO_VERBOSE": ("dynamo logs every frame it traces", ("compile",), 0.2, False, "compile", "0"),
    "TORCH_COMPILE_DEBUG": (
        "every compile writes its debug folder",
        ("compile",),
        0.5,
        False,
        "compile",
        "0",
    ),
    "TORCHINDUCTOR_DEBUG": (
        "every compile writes its debug folder",
        ("compile",),
        0.5,
        False,
        "compile",
        "0",
    ),
    "TORCH_SHOW_CPP_STACKTRACES": (
        "every raised C++ error (and each caught one in dynamo) symbolizes a stack",
        ("compile", "host"),
        0.05,
        False,
        "",
        "0",
    ),
    "TORCH_CPP_LOG_LEVEL": ("C++ info logging", ("collective",), 0.05, False, "ranks", "WARNING"),
    "TORCH_DISTRIBUTED_DEBUG": (
        "every collective is checked against the other ranks' first",
        ("collective", "sync"),
        0.3,
        False,
        "ranks",
        "OFF",
    ),
    "NCCL_DEBUG": ("NCCL logs (TRACE: every collective)", ("collective",), 0.1, False, "ranks", "WARN"),
    "TORCH_NCCL_BLOCKING_WAIT": (
        "every collective blocks the host",
        ("collective", "sync"),
        0.3,
        True,
        "ranks",
        "0",
    ),
    "NCCL_BLOCKING_WAIT": (
        "every collective blocks the host",
        ("collective", "sync"),
        0.3,
        True,
        "ranks",
        "0",
    ),
    "TORCH_NCCL_DESYNC_DEBUG": (
        "collectives tracked for desync reports",
        ("collective",),
        0.1,
        False,
        "ranks",
        "0",
    ),
    "PYTHONTRACEMALLOC": (
        "every Python allocation records its traceback",
        ("host", "data", "forward_backward"),
        0.2,
        False,
        "",
        None,
    ),
    "PYTHONMALLOC": (
        "the debug allocator checks every allocation",
        ("host", "data", "forward_backward"),
        0.2,
        False,
        "",
        None,
    ),
}


def _plain(value: Any) -> Any:
    """A value of the event table as plain Python (numpy scalars do not compare as JSON does)."""
    if isinstance(value, float) and value != value:
        return None
    return value.item() if hasattr(value, "item") and not isinstance(value, (str, bytes)) else value


def _events(run: RunRecord) -> pd.DataFrame:
    table = ev.events_of_type(run, "switch")
    if not len(table) or "name" not in table:
        return pd.DataFrame()
    return table


def _line_seconds(run: RunRecord, rank: str, lines: Sequence[str]) -> tuple[float | None, float | None]:
    """(mean seconds per steady step of these ledger lines, mean steady step) of one rank."""
    led = run.ledger
    if not len(led):
        return None, None
    steady = {int(s) for s in ev.steady_steps(run, rank)["step"]}
    rows = led[(led["rank"] == rank) & led["step"].isin(steady)]
    if not len(rows):
        return None, None
    cols = [f"{c}_s" for c in lines if f"{c}_s" in rows]
    return float(rows[cols].sum(axis=1).mean()), float(rows["wall_s"].mean())


def _dated(run: RunRecord, rank: str, rows: pd.DataFrame) -> pd.DataFrame:
    """The rows with a step each: the one the shim wrote, else (a damaged record: no step, or a
    null one) the step its time falls in, or the next to begin (one past the last after it)."""
    step = rows["step"] if "step" in rows else pd.Series(np.nan, index=rows.index)
    if not step.isna().any() or "t" not in rows:
        return rows.assign(step=step)
    steps = run.rank_steps(rank).dropna(subset=["end_ns"]).sort_values("end_ns", kind="stable")
    ids = np.append(steps["step"].to_numpy(np.int64), int(steps["step"].max()) + 1 if len(steps) else 0)
    at = np.searchsorted(steps["end_ns"].to_numpy(np.int64), rows["t"].to_numpy(np.int64), side="left")
    return rows.assign(step=step.fillna(pd.Series(ids[at], index=rows.index)))


def _on_in_steps(rows: pd.DataFrame, first_steady: int) -> pd.Series | None:
    """The event that shows the switch on in the steady steps (the job's own, not turned off by a
    --fix arm), or None: the last change before the window is on, or one inside it is."""
    rows = rows.sort_values("step", kind="stable")
    on = rows["on"].fillna(False).astype(bool) if "on" in rows else pd.Series(False, index=rows.index)
    if "forced_off" in rows:
        on = on & ~rows["forced_off"].fillna(False).astype(bool)
    before = rows[rows["step"].fillna(-1) < first_steady]
    if len(before) and bool(on.loc[before.index[-1]]):
        return before.iloc[-1]
    inside = rows[(rows["step"].fillna(-1) >= first_steady) & on]
    return inside.iloc[0] if len(inside) else None


def _edit(known: Known | None, caller: dict[str, Any], source: str) -> dict[str, Any] | None:
    """The edit of the job's line that turns the switch off: the context made its off form, a
    `True` made `False`, else the statement deleted."""
    file, line = caller.get("file"), caller.get("line")
    if not file or ev.is_library_path(str(file)) or not source:
        return None
    for keyword in known.keywords if known is not None else ():
        flag = re.compile(r"\b" + re.escape(keyword) + r"(\s*=\s*)True\b")
        if flag.search(source):  # a framework's argument: the job's own line
            return codefix.code_change(file, line, source, flag.sub(keyword + r"\1False", source, count=1))
    if known is not None and known.off_edit and re.search(known.off_edit[0], source):
        return codefix.code_change(file, line, source, re.sub(known.off_edit[0], known.off_edit[1], source))
    if re.search(r"\(\s*(mode\s*=\s*)?True\b", source):
        return codefix.code_change(file, line, source, re.sub(r"\bTrue\b", "False", source, count=1))
    if source.startswith(("with ", "if ", "for ", "while ")) or "=" in source.split("(")[0]:
        return None  # a block's head or an assignment: not a statement to delete
    return codefix.code_change(file, line, source, "", op="delete")


def _no_grad_edit(caller: dict[str, Any], source: str) -> dict[str, Any] | None:
    """The evaluation's call wrapped in no_grad on its own line (`with torch.no_grad(): out =
    model(x)`): a one-line simple statement of a file that imports torch at its top (its name
    for it), else None (a block's head, a statement over several lines)."""
    path, line = caller.get("file"), caller.get("line")
    if not path or not isinstance(line, int) or ev.is_library_path(str(path)):
        return None
    if not source or source.rstrip().endswith((":", "\\", "(", ",")) or BLOCK_HEAD.match(source):
        return None
    text = source_text(str(path))
    if text is None:
        return None
    found = re.search(r"^import torch(?: as (\w+))?\s*$", text, re.M)
    if found is None:
        return None
    return codefix.code_change(
        str(path), line, source, f"with {found.group(1) or 'torch'}.no_grad(): {source}"
    )


def _job_lines(run: RunRecord) -> Iterator[tuple[str, int, str]]:
    """(file, line number, text) of every line of the job's own scripts but comments."""
    for path in ev.job_scripts(run):
        for number, text in enumerate(source_lines(path), 1):
            if not text.lstrip().startswith("#"):
                yield path, number, text


def _framework_argument(run: RunRecord, known: Known | None) -> tuple[dict[str, Any], str] | None:
    """(the job's line, its source) that passes a framework the argument turning the switch on
    (`Trainer(detect_anomaly=True)`): where the setter's caller is the framework's own file, in
    site-packages, the job's argument is the line to change."""
    if known is None or not known.keywords:
        return None
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, known.keywords)) + r")\s*=\s*True\b")
    for path, number, text in _job_lines(run):
        if pattern.search(text):
            return {"file": path, "line": number, "function": None}, text.strip()
    return None


def _set_at(run: RunRecord, known: Known | None, row: pd.Series) -> tuple[dict[str, Any] | None, str]:
    """(the job's line that turned the switch on, its source): the setter's caller, or, where that
    is a framework's file in site-packages, the job's line passing the framework's argument."""
    caller = row.get("caller") if isinstance(row.get("caller"), dict) else None
    source = str(_plain(row.get("source")) or "")
    if caller and ev.is_library_path(str(caller.get("file") or "")):
        found = _framework_argument(run, known)
        if found is not None:
            return found
    return caller, source


def _prescriptions(
    name: str, known: Known | None, caller: dict[str, Any] | None, source: str, gain: float | None
) -> list[Prescription]:
    where = f"{caller.get('file')}:{caller.get('line')}" if caller else None
    out = []
    edit = _edit(known, caller or {}, source) if caller and name != "eval_grad" else None
    if edit:
        after = edit.get("after") or "(line removed)"
        out.append(
            Prescription(
                kind="code",
                summary=f"turn {name} off at {where}: `{source}` → `{after}`",
                change=SourceEdit(code=edit),
                expected_gain_s_per_step=gain,
                automatic=True,
            )
        )
    if name == "eval_grad":
        wrapped = _no_grad_edit(caller or {}, source)
        out.append(
            Prescription(
                kind="code",
                summary=f"run the evaluation at {where or 'its call'} under `with torch.no_grad():` "
                "(or `torch.inference_mode()`, or `@torch.no_grad()` on its function)"
                + (f": `{source}` → `{wrapped['after']}`" if wrapped else ""),
                change=SourceEdit(code=wrapped) if wrapped else {},
                expected_gain_s_per_step=gain,
                automatic=wrapped is not None,
            )
        )
        out.append(
            Prescription(
                kind="runtime",
                summary="measure the job with its evaluations run without grad (the shim turns grad off "
                "around the model's calls in eval mode; keep it with torch.no_grad() there)",
                change={"runtime": {"patch": OFF_PATCH + name}},
                expected_gain_s_per_step=gain,
                automatic=True,
            )
        )
        return out
    if name == "profiler":  # the shim cannot take a profiler away from a job that reads it after
        out.append(
            Prescription(
                kind="code",
                summary=f"profile a few steps only (torch.profiler.schedule(wait=..., warmup=..., "
                f"active=...) with prof.step() per step), or leave the profiler out of the training run "
                f"({where or 'where the job enters it'})",
                expected_gain_s_per_step=gain,
            )
        )
        return out
    out.append(
        Prescription(
            kind="runtime",
            summary=f"measure the job with {name} off (the shim turns it off; keep it with the edit"
            + (f" at {where})" if where else ")"),
            change={"runtime": {"patch": OFF_PATCH + name}},
            expected_gain_s_per_step=gain,
            automatic=True,
        )
    )
    return out


def _severity(name: str, share: float | None, moot: bool) -> str:
    if moot:
        return "info"
    severity = ev.severity_for_share(share) if share is not None else "medium"
    if name in ("anomaly", "trace") and severity in ("info", "low"):
        return "medium"  # a debugging switch with no benefit to training: worth turning off
    if name == "eval_grad" and severity == "info":
        return "low"  # memory and work for nothing, whatever its time: at least worth saying
    return severity


def _env_line(run: RunRecord, var: str) -> tuple[dict[str, Any], str] | None:
    """The job's own line that sets the variable (`os.environ["NCCL_DEBUG"] = "INFO"`)."""
    pattern = re.compile(r"[\"']" + re.escape(var) + r"[\"']")
    for path, number, text in _job_lines(run):
        if pattern.search(text) and "=" in text:
            return {"file": path, "line": number, "function": None}, text.strip()
    return None


def _env_prescriptions(var: str, why: str, off_value: str | None, gain: float | None) -> list[Prescription]:
    out = []
    if off_value is not None:
        out.append(
            Prescription(
                kind="env",
                summary=f"{var}={off_value} (or unset it): {why.split(':')[0]} no more",
                change={"env": {var: off_value}},
                expected_gain_s_per_step=gain,
                automatic=True,
            )
        )
    out.append(
        Prescription(
            kind="runtime",
            summary=f"measure the job with {var} unset (the shim unsets it; keep it with `unset {var}`)",
            change={"runtime": {"patch": f"{OFF_PATCH}env:{var}"}},
            expected_gain_s_per_step=gain,
            automatic=True,
        )
    )
    return out


def _cost(
    run: RunRecord, rank: str, lines: Sequence[str], fraction: float
) -> tuple[float | None, float | None]:
    """(predicted seconds per step, its share of the step)."""
    seconds, step = _line_seconds(run, rank, lines)
    if seconds is None or not step:
        return None, None
    gain = seconds * fraction
    return gain, gain / step


def _finding(
    run: RunRecord, rank: str, name: str, row: pd.Series, first_steady: int, context: dict[str, bool]
) -> Finding | None:
    env = name.startswith("env:")
    var = name[4:] if env else ""
    known = None if env else KNOWN.get(name)
    moot = False  # nothing on this run it could slow (a CUDA variable without a GPU)
    if env:
        if var not in ENV_COSTS:
            return None
        why, lines, fraction, gpu_only, needs, off_value = ENV_COSTS[var]
        moot = bool(needs and not context.get(needs))
        title = f"debug variable {var}={row.get('value')} left on"
    elif known is not None:
        why, lines, fraction, gpu_only, title = (
            known.why,
            known.lines,
            known.fraction,
            known.gpu_only,
            known.title,
        )
        off_value = None
        if known.cpu_fraction is not None and not context.get("gpu", False):
            fraction = known.cpu_fraction
        if known.gpu_lines and context.get("gpu", False):
            lines = tuple(lines) + known.gpu_lines
    else:
        return None
    moot = moot or (gpu_only and not context.get("gpu", False))
    gain, share = _cost(run, rank, lines, fraction)
    severity = _severity(name, share, moot)
    title += " (costs nothing on this run)" if moot else ""
    caller, source = _set_at(run, known, row)
    where = f"{caller['file']}:{caller['line']}" if caller else None
    if env:
        if row.get("set_by") == "job":
            caller, source = _env_line(run, var) or (None, "")
            where = f"{caller['file']}:{caller['line']}" if caller else None
        set_by = f"the job's own code at {where}" if where else "the job's environment"
        if row.get("set_by") == "job" and not where:
            set_by = "the job's own code, before torch's import"
        summary = f"{var}={row.get('value')} (set by {set_by}): {why}"
        prescriptions = _env_prescriptions(var, why, off_value, gain)
    else:
        value = _plain(row.get("value"))
        summary = (
            f"{title} ({name} = {value}" + (f", set at {where}: `{source}`" if where else "") + f"): {why}"
        )
        prescriptions = _prescriptions(name, known, caller, source, gain)
    if share is not None and gain is not None:
        summary += f"; predicted {gain * 1000:.1f} ms a step ({share:.0%}) until --fix measures it"
    return Finding(
        id="switches.debug_env" if env else f"switches.{name}",
        title=title + (f" at {where}" if where else ""),
        severity=severity,
        analyzer="switches",
        summary=summary,
        seconds_lost_per_step=gain,
        share_of_step=share,
        evidence={
            "switch": name,
            "value": _plain(row.get("value")),
            "set_at": caller,
            "source": source or None,
            "setter_called_at": row.get("caller") if isinstance(row.get("caller"), dict) else None,
            "set_by": _plain(row.get("set_by")) or ("job" if caller else None),
            "step": None if pd.isna(row.get("step")) else int(row["step"]),
            "changes": int(_plain(row.get("changes")) or 1),
            "cost_lines": list(lines),
            "cost_fraction_predicted": fraction,
            # an evaluation runs now and then: the median step is one without it (--fix: the mean)
            **({"occasional": True} if name == "eval_grad" else {}),
        },
        prescriptions=tuple(prescriptions),
        ranks=(rank,),
        removes={"categories": list(lines), "fraction": fraction},
    )


def _context(run: RunRecord) -> dict[str, bool]:
    compiles = run.compiles
    dynamo = bool(len(compiles)) and "kind" in compiles and bool((compiles["kind"] == "dynamo").any())
    return {"gpu": bool(len(run.gpu)), "compile": dynamo, "ranks": len(run.ranks) > 1}


def analyze(run: RunRecord) -> list[Finding]:
    events = _events(run)
    if not len(events):
        return []
    context = _context(run)
    out: list[Finding] = []
    for rank in sorted({str(r) for r in events["rank"].dropna()}):
        steady = ev.steady_steps(run, rank)
        if not len(steady):
            continue
        first_steady = int(steady["step"].min())
        mine = events[events["rank"].astype(str) == rank]
        for name, rows in mine.groupby("name", sort=True):
            row = _on_in_steps(_dated(run, rank, rows), first_steady)
            if row is None:
                continue
            finding = _finding(run, rank, str(name), row, first_steady, context)
            if finding is not None:
                out.append(finding)
        if out:
            break  # one rank tells it: every rank runs the same code (the first rank's lines)
    return out
