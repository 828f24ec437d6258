"""host_work's reading of a line (the kind of work it ends in, its call) and the generic fixes that
fit it, with a concrete edit (the line run on a background thread) where one exists."""

from __future__ import annotations

import ast
import math
import os
import re
from typing import Any

from traindx.analyzers.codefix import params as codefix_params
from traindx.analyzers.codefix import source_tree
from traindx.analyzers.core.findings import Prescription
from traindx.analyzers.host.code import Group, module_of
from traindx.common.units import ordinal

# the kind of work a line ends in -> how it reads
_KINDS = (
    ("sleep", re.compile(r"(^|\.)sleep\b|time\.sleep")),
    (
        "wait",
        re.compile(
            r"\b(wait|join|acquire|select|poll|recv|accept)\b|threading|queue\.py|"
            r"socket|subprocess|urllib|requests|http"
        ),
    ),
    (
        "image",
        re.compile(
            r"\bPIL\b|PIL/|cv2|imageio|torchvision/io|\.save\(.*\.(png|jpe?g)|"
            r"Image\.|encode|decode"
        ),
    ),
    (
        "file",
        re.compile(
            r"\bopen\s*\(|\.read\w*\s*\(|\.write\w*\s*\(|np\.load|json\.(load|dump)|"
            r"pickle|shutil|os\.(listdir|walk|stat)|glob|\bio\.|h5py|pandas/io"
        ),
    ),
    ("numpy", re.compile(r"\bnumpy\b|numpy/|\bnp\.")),
    ("logging", re.compile(r"\bprint\s*\(|logging/|\blog(ger)?\.|tqdm|rich/|wandb|tensorboard")),
    ("tensor", re.compile(r"\btorch\b|torch/")),
)


def call_name(lib: Any, src: str | None) -> Any:
    if lib is not None:
        name = lib.name.split(".")[-1]
        return f"{module_of(lib.file)}.{name}"
    if src:
        m = re.search(r"([A-Za-z_][\w.]*)\s*\(", src)
        if m:
            return m.group(1)
        return src[:60]
    return None


def call_of_kind(src: str | None, kind: str) -> Any:
    """The call of a source line that gives it its kind (`time.sleep` in `x = f.read(); time.
    sleep(1)` for "sleep"), else its first call."""
    calls = re.findall(r"([A-Za-z_][\w.]*)\s*\(", src or "")
    rx = dict(_KINDS).get(kind)
    for name in calls:
        if rx is not None and rx.search(name + "("):
            return name
    return calls[0] if calls else (src[:60] if src else None)


def kind_of(call: Any, src: str | None, lib_file: Any = None) -> Any:
    text = " ".join(t for t in (call, src, lib_file) if isinstance(t, str) and t)  # NaN: none
    for kind, rx in _KINDS:
        if rx.search(text):
            return kind
    return "python"


# -- prescriptions -----------------------------------------------------------------------------
def async_edit(src: str | None, path: str, line: int, cwd: str | None, daemon: Any = True) -> Any:
    """A concrete edit that runs the line's work on a background thread, or None when the line
    is not such work. The line is statements joined by `;`: assignments to names, then bare
    calls. The calls after the last assignment run on the thread, in order; the assignments stay
    where they are, so every name the line bound is still bound when the next line runs (a
    patch never unbinds a name: fix_source.check_bindings). A write (a file, a log) runs on a
    non-daemon thread, so the run's end waits for it and nothing written is lost; a wait may
    never end, so its thread is a daemon."""
    if not src or src.endswith((":", "\\", ",", "(")):
        return None
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return None
    kept = 0  # the statements up to the last assignment stay on the training thread
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            kept = i + 1
        elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
            return None
    work = [node.value for node in tree.body[kept:] if isinstance(node, ast.Expr)]
    real = next((c for c in (path, os.path.join(cwd or "", path)) if os.path.isfile(c)), None)
    lines = source_tree(real)[1] if real else []
    if not work or not 0 < line <= len(lines):
        return None
    raw = lines[line - 1]
    indent = raw[: len(raw) - len(raw.lstrip())]
    stay = "".join((ast.get_source_segment(src, node) or "") + "; " for node in tree.body[:kept])
    parts = [ast.get_source_segment(src, value) or "" for value in work]
    target = parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"
    thread = f"__import__('threading').Thread(target=lambda: {target}, daemon={bool(daemon)}).start()"
    return {"file": path, "line": line, "before": raw, "after": indent + stay + thread, "op": "replace"}


def line_prescriptions(
    kind: str,
    where: Any,
    src: str | None,
    path: str,
    line: int,
    seconds: float,
    has_gpu: bool,
    cwd: str | None,
    period: int | None = None,
) -> Any:
    out = []
    if period:
        out.append(
            Prescription(
                kind="code",
                summary=(
                    f"It runs on every {ordinal(period)} step only: do it less often "
                    f"still, or off the training thread ({where})"
                ),
                expected_gain_s_per_step=seconds,
            )
        )
    edit = (
        async_edit(src, path, line, cwd, daemon=kind in ("sleep", "wait"))
        if kind in ("sleep", "wait", "file", "logging", "image", "python")
        else None
    )
    if edit:
        out.append(
            Prescription(
                kind="code",
                summary=f"Run it asynchronously, off the training thread: {where}",
                change={"code": edit},
                expected_gain_s_per_step=seconds,
                command=f"- {edit['before'].strip()}\n+ {edit['after'].strip()}",
            )
        )
    if kind in ("file", "image", "numpy", "python", "tensor", "sleep", "wait"):
        out.append(
            Prescription(
                kind="code",
                summary=(
                    "If it prepares the batch, move it into the Dataset's "
                    "__getitem__ (or a collate_fn) and set DataLoader(num_workers=N,"
                    " persistent_workers=True): it then runs beside the step"
                ),
                expected_gain_s_per_step=seconds,
            )
        )
    if kind in ("file", "image", "sleep", "wait", "logging"):
        out.append(
            Prescription(
                kind="code",
                summary=(
                    "Do it less often (every N steps) or asynchronously (a background thread or process)"
                ),
                expected_gain_s_per_step=seconds,
            )
        )
    if kind in ("file", "numpy", "tensor", "python", "image"):
        out.append(
            Prescription(
                kind="code",
                summary="If its result repeats from step to step, compute it once and "
                "cache it (before the loop, or functools.lru_cache)",
                expected_gain_s_per_step=seconds,
            )
        )
    if kind in ("numpy", "tensor") and has_gpu:
        out.append(
            Prescription(
                kind="code",
                summary="Move it to the GPU (torch ops on the device tensors instead of numpy / CPU tensors)",
                expected_gain_s_per_step=seconds,
            )
        )
    return out


# a framework's callback or event dispatch (whatever the framework: Lightning's _call_callback_hooks,
# HF's CallbackHandler.call_event, Ignite's Engine._fire_event, Keras' CallbackList, skorch's notify)
_DISPATCH = re.compile(r"callback|event|notify|fire|dispatch|handler", re.IGNORECASE)


def callback_dispatch(g: Group) -> str | None:
    """The framework function that calls this host line's function back on every step, when it
    dispatches callbacks or events (or the function is an `on_*` callback method)."""
    via = g.get("via")
    if not isinstance(via, str) or not via:
        return None
    own = str(g.get("function") or "").rsplit(".", 1)[-1]
    if _DISPATCH.search(via.rsplit(".", 1)[-1]) or own.startswith("on_"):
        return via
    return None


def callback_prescription(g: Group, where: str, via: str, seconds: float, share: float) -> list[Prescription]:
    """Its own fixes: the edit that runs it on every n-th call only (n puts it under 2 % of the
    step), which --fix measures, then the words."""
    out = []
    n = max(2, min(100, math.ceil(share / 0.02)))
    edit = codefix_params.every_nth_call_edit(str(g["file"]), int(g["line"]), n) if g.get("file") else None
    if edit:
        out.append(
            Prescription(
                kind="code",
                summary=f"run the callback {edit['callback']}() at {where} on every {n}th call only "
                "(a call counter and an early return at its top)",
                change={"code": edit},
                expected_gain_s_per_step=seconds * (1 - 1 / n),
                automatic=True,
            )
        )
    out.append(
        Prescription(
            kind="code",
            summary=(
                f"run the callback at {where} less often (the framework's interval or event filter, "
                "e.g. every N iterations / on epoch end), or update its metric incrementally instead "
                "of recomputing it over everything seen so far on every batch"
            ),
            expected_gain_s_per_step=seconds,
        )
    )
    return out


def host_code_summary(
    g: Group, src: str | None, where: str, what: str, share: float, period: dict[str, Any] | None
) -> str:
    """A host line's summary: its seconds and share, its code, what it ends in, the machine's
    load where the thread waited for a core, its period."""
    seconds = g["seconds"]
    summary = (
        f"The training thread spends {seconds:.3f} s a step ({share:.0%} of the "
        f"step) at {where} in {g['function']}()"
        + (f": `{src}`" if src else "")
        + f", ending in {what}. No other line of "
        "the ledger covers it: the step waits for it."
    )
    waited = g.get("runqueue_wait")
    if waited and waited["step_s"] - waited["step_own_s"] > 0.001:
        summary += (
            f" The machine was loaded: the thread waited "
            f"{(waited['step_s'] - waited['step_own_s']) * 1e3:.0f} ms of each "
            f"{waited['step_s'] * 1e3:.0f} ms step for a core "
            f"({waited['line_runq_s'] * 1e3:.0f} ms of it at this line); the share "
            f"is of the {waited['step_own_s'] * 1e3:.0f} ms it ran or blocked."
        )
    if period:
        summary += (
            f" It differs from step to step: every {ordinal(period['period'])} step "
            f"(steps ≡ {period['residue']} mod {period['period']}) the "
            f"{period['label']} line is {period['excess_s'] * 1e3:.0f} ms longer."
        )
    return summary
