"""A cause for any slow line: code the training thread runs between its measured calls.

Whatever the loop does outside the model's forward/backward, the optimizer step, the data wait
and the other measured calls is host work; no specialised analyzer knows it (a blocking read,
CPU work every other step, an image encoded per step, a numpy transform of each batch). Each
code line of it that costs >= MIN_SHARE of the steady step becomes a finding of its own: the
function, the user's file:line leading into it, the library call it ends in, its seconds per
step, and the generic fixes that fit (DataLoader workers, less often or asynchronously, cache,
the GPU), with a concrete edit where one exists.

Where the code comes from:
  1. `traindx.derive.ledger.host_code(run)` (rank, step, function, file, line, call, seconds): what ran
     inside the ledger's `host` intervals, per step (the derive layer; preferred when present);
  2. else py-spy's recording of the training thread: a sample belongs to a measured call when a
     frame of one is on its stack (a module call, backward, the DataLoader's __next__, a save, a
     compile; the optimizer step owns its own frames only, so a closure's user code under it -
     Lightning's training_step - is the job's code again); the rest is host work, grouped by its
     innermost user frame. Its seconds per step are its share of the loop's samples (between the
     first and the last sample in a measured call) times the mean step, capped by the ledger
     lines host work is booked in until the ledger measures it (fwd/bwd, unexplained).

Steps that differ from each other are compared line by line (stability.line_periods): a host
line that is dear every k-th step (k = 2 included) is named with its period.
"""

import ast
import os
import re
from collections import defaultdict

import numpy as np
import pandas as pd

from traindx.analyzers import evidence as ev
from traindx.analyzers.codefix import _innermost, _tree
from traindx.analyzers.declaration import Declaration
from traindx.analyzers.findings import Finding, Prescription
from traindx.common.units import ordinal

DECLARATION = Declaration(
    name="host_work",
    order=120,
    ids=("host_work.call_site", "host_work.code", "host_work.framework_loop", "host_work.periodic_line"),
    live_categories=("io", "other"),
    explains=("ranks.straggler", "ranks.pipeline_bubble", "gpu_idle.host_starved", "host_work.code"),
    straggler_lines={"host": "host_work.code"},
    generic_at_line=("host_work.code",),
)

MIN_SHARE = 0.03  # of the steady step: a line below this is not worth a finding
MIN_SECONDS = 0.001  # ...nor one under a millisecond a step (nothing measurable to gain)
MIN_SAMPLES = 3  # py-spy samples of a line before it is named at all
LOADED_WAIT = 0.10  # of the step waiting for a core: a line needs MIN_SAMPLES that saw
# it run or block (not wait) before it is named
ANALYZER = "host_work"

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
# calls whose time the shim books into another ledger line (its analyzer names them)
MEASURED_ELSEWHERE = (
    (re.compile(r"gc\.collect\s*\("), "gc"),
    (re.compile(r"\.(item|tolist|cpu)\s*\(\s*\)|\bsynchronize\s*\("), "sync"),
    (re.compile(r"\b(torch\.save|save_checkpoint)\s*\("), "io"),
)

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
KIND_TEXT = {
    "sleep": "a blocking sleep",
    "wait": "a blocking wait",
    "image": "image encoding",
    "file": "a file read/write",
    "numpy": "numpy",
    "logging": "logging",
    "tensor": "a tensor op on the CPU",
    "python": "Python code",
}


# -- where the code comes from ------------------------------------------------------------------
def _lib_category(frame) -> str | None:
    path = (frame.file or "").replace("\\", "/")
    for fragment, names, cat in _OWNING:
        if fragment in path and (names is None or frame.name in names or frame.name.split(".")[-1] in names):
            return cat
    return None


def classify_stack(stack):
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


def _module_of(path):
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


def source_line(path, line, cwd=None):
    """The job's source line (stripped), or None when the file is not readable here."""
    for candidate in (path, os.path.join(cwd or "", path)):
        try:
            with open(candidate, encoding="utf-8", errors="replace") as f:
                for n, text in enumerate(f, 1):
                    if n == line:
                        return text.strip()
        except OSError:
            continue
    return None


def _call_name(lib, src):
    if lib is not None:
        name = lib.name.split(".")[-1]
        return f"{_module_of(lib.file)}.{name}"
    if src:
        m = re.search(r"([A-Za-z_][\w.]*)\s*\(", src)
        if m:
            return m.group(1)
        return src[:60]
    return None


def _call_of_kind(src, kind):
    """The call of a source line that gives it its kind (`time.sleep` in `x = f.read(); time.
    sleep(1)` for "sleep"), else its first call."""
    calls = re.findall(r"([A-Za-z_][\w.]*)\s*\(", src or "")
    rx = dict(_KINDS).get(kind)
    for name in calls:
        if rx is not None and rx.search(name + "("):
            return name
    return calls[0] if calls else (src[:60] if src else None)


def kind_of(call, src, lib_file=None):
    text = " ".join(t for t in (call, src, lib_file) if isinstance(t, str) and t)  # NaN: none
    for kind, rx in _KINDS:
        if rx.search(text):
            return kind
    return "python"


def _loop_window(stacks):
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


def pyspy_host_code(run, rank):
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


def _ledger_host_code(run):
    """traindx.derive.ledger.host_code(run) when the derive layer has it (helper `ledger`), else None."""
    from traindx.derive import ledger

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


def _host_capacity(led):
    """Seconds per steady step the ledger books host work in: `host` once measured, else the
    lines it is folded into today (fwd/bwd is a residual, unexplained the gaps, and a closure
    run by the optimizer step - Lightning's training_step - is inside the optimizer line)."""
    if "host_s" in led:
        return float((led["host_s"] + led["unexplained_s"]).mean())
    return float((led["forward_backward_s"] + led["unexplained_s"] + led["optimizer_s"]).mean())


# -- framework between its own calls -------------------------------------------------------------
def _ancestor_lines(run, rank):
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


# -- prescriptions -----------------------------------------------------------------------------
def _async_edit(src, path, line, cwd, daemon=True):
    """A concrete edit that runs the line's work on a background thread, or None when the line
    is not such work. It qualifies when each of its statements (one, or several joined by `;`)
    is a bare call or an assignment to names that nothing in its function (or module) reads:
    the values are computed on the thread, in order, and the unread names dropped. A write (a
    file, a log) runs on a non-daemon thread, so the run's end waits for it and nothing written
    is lost; a wait may never end, so its thread is a daemon."""
    if not src or src.endswith((":", "\\", ",", "(")):
        return None
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return None
    work, assigned = [], set()
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            work.append(node.value)
        elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            work.append(node.value)
            assigned.update(t.id for t in node.targets)
        else:
            return None
    if not work:
        return None
    real = next((c for c in (path, os.path.join(cwd or "", path)) if os.path.isfile(c)), None)
    file_tree, lines = _tree(real) if real else (None, [])
    if not 0 < line <= len(lines) or (
        assigned and (file_tree is None or _names_read(file_tree, line) & assigned)
    ):
        return None
    raw = lines[line - 1]
    indent = raw[: len(raw) - len(raw.lstrip())]
    parts = [ast.get_source_segment(src, value) for value in work]
    target = parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"
    after = f"{indent}__import__('threading').Thread(target=lambda: {target}, daemon={bool(daemon)}).start()"
    return {"file": path, "line": line, "before": raw, "after": after, "op": "replace"}


def _names_read(file_tree, line):
    """The names read anywhere in the function holding `line` (the module, at top level)."""
    scope = _innermost(file_tree, line, (ast.FunctionDef, ast.AsyncFunctionDef)) or file_tree
    return {n.id for n in ast.walk(scope) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _prescriptions(kind, where, src, path, line, seconds, has_gpu, cwd, period=None):
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
        _async_edit(src, path, line, cwd, daemon=kind in ("sleep", "wait"))
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


# -- the analysis ------------------------------------------------------------------------------
# work on the CPU itself: on a CPU-only job it is the job's compute as much as the model's (the
# batch built with tensor ops, the loss outside the module), competing for the same cores
# wherever it runs; named from COMPUTE_MIN_SHARE there, as info below it (a CPU job's batch
# built with tensor ops takes 8-12 % of its step by itself: no cause, the job's own work)
COMPUTE_KINDS = ("python", "tensor", "numpy")
COMPUTE_MIN_SHARE = 0.15


def _severity(kind, share, has_gpu):
    if kind in COMPUTE_KINDS and not has_gpu and share < COMPUTE_MIN_SHARE:
        return "info"
    return ev.severity_for_share(share)


def _steady(run, rank):
    from traindx.derive import ledger

    led = ledger.steady_rows(run, rank)
    return led


def _claimed(src, led):
    """The ledger line a call of this source line is booked in, when that line is non-zero."""
    for rx, cat in MEASURED_ELSEWHERE:
        if src and rx.search(src) and f"{cat}_s" in led and float(led[f"{cat}_s"].sum()) > 0:
            return cat
    return None


def _groups_from_ledger(table, rank, led):
    """Per line seconds per steady step from ledger.host_code (and per step, for periods)."""
    t = table[table["rank"].astype(str) == str(rank)]
    steps = {int(s) for s in led["step"]}
    t = t[t["step"].isin(steps)]
    if not len(t):
        return []
    n = max(1, len(led))
    out = []
    waits = "runq_s" in t and t["runq_s"].notna().any()
    for (fn, file, line, call), g in t.groupby(["function", "file", "line", "call"], dropna=False):
        per_step = g.groupby("step")["seconds"].sum()
        out.append(
            {
                "function": fn,
                "file": file,
                "line": int(line),
                "call": call,
                "lib_file": None,
                "seconds": float(per_step.sum()) / n,
                "runq_s": float(g["runq_s"].fillna(0.0).sum()) / n if waits else None,
                "samples": int(g["samples"].sum()) if "samples" in g else None,
                "per_step": per_step.reindex(sorted(steps), fill_value=0.0),
                "method": "traindx.derive.ledger.host_code: the ledger's host intervals",
            }
        )
    return out


def _own_step_s(run, rank, led):
    """The steady step less the training thread's run-queue wait (the shim's `cpu` events,
    thread_runq_s), or None where a steady step has no such record: the step as the job's own
    work and blocking calls made it, whatever share of the cores other processes left it."""
    runq = ev.ledger_step_runq_s(run, rank, led["step"])
    if runq is None:
        return None
    wall = led["wall_s"].to_numpy(float)
    own = float((wall - np.minimum(wall, runq)).mean())
    return own if own > 0 else None


def _groups_from_pyspy(run, rank, led):
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


def _call_site_note(run, rank, g, src, line_name, seconds, share, cwd):
    """An info note: the user's explicit call of something the shim books in `line_name`."""
    path = _display(g["file"], cwd)
    raw = None
    for candidate in (g["file"], os.path.join(cwd or "", g["file"])):
        try:
            with open(candidate, encoding="utf-8", errors="replace") as f:
                raw = f.read().splitlines()[g["line"] - 1]
            break
        except (OSError, IndexError):
            continue
    return Finding(
        id="host_work.call_site",
        title=f"{src} at {path}:{g['line']} ({line_name} line)",
        severity="info",
        analyzer=ANALYZER,
        summary=(
            f"The loop calls `{src}` itself at {path}:{g['line']}, {seconds:.3f} s a step "
            f"({share:.0%}) on the ledger's {line_name} line."
        ),
        seconds_lost_per_step=seconds,
        share_of_step=share,
        ranks=(rank,),
        evidence={
            "rank": rank,
            "file": path,
            "path": g["file"],
            "line": g["line"],
            "source": src,
            "raw": raw,
            "function": g["function"],
            "ledger_line": line_name,
            "seconds_per_step": round(seconds, 5),
        },
    )


def _call_sites_from_pyspy(run, rank, led, step_s, cwd, noted):
    """The call-site notes py-spy's samples show that the ledger's host samples cannot: an
    explicit call booked in another line (a gc.collect() in the loop) runs inside that line's
    span, outside every host interval, and holds the GIL, so the shim's own sampler thread
    takes no sample there; py-spy, outside the process, sees the thread at the user's line."""
    out = []
    for g in _groups_from_pyspy(run, rank, led):
        if (g["file"], g["line"]) in noted or not g["file"] or ev.is_library_path(g["file"]):
            continue
        src = source_line(g["file"], g["line"], cwd)
        claimed = _claimed(src, led)
        if not claimed or g.get("few_samples"):
            continue
        # the line's own cost is its ledger line's (a GC span less its wait for a core)
        booked = min(g["seconds_sampled"], float(led[f"{claimed}_s"].mean()))
        if booked / step_s >= MIN_SHARE:
            out.append(_call_site_note(run, rank, g, src, claimed, booked, booked / step_s, cwd))
            noted.add((g["file"], g["line"]))
    return out


def _display(path, cwd):
    if cwd and path and path.startswith(cwd.rstrip("/") + "/"):
        return path[len(cwd.rstrip("/")) + 1 :]
    return path


def _analyze_rank(run, rank):
    from traindx.analyzers import stability

    led = _steady(run, rank)
    if not len(led):
        return []
    step_s = float(led["wall_s"].mean())
    if step_s <= 0:
        return []
    table = _ledger_host_code(run)
    groups = _groups_from_ledger(table, rank, led) if table is not None else []
    from_ledger = bool(groups)
    if not groups:
        groups = _groups_from_pyspy(run, rank, led)
    cwd = run.manifest.get("cwd")
    has_gpu = bool(run.manifest.get("gpus"))
    framework_lines = _ancestor_lines(run, rank) if run.pyspy.get((rank, "all")) else set()
    periods = stability.line_periods(led, step_s)
    findings = []
    used_periods = set()
    # py-spy has no steps: a period goes to a line by its cost only when one line fits it
    fits = {}
    for g in groups:
        if g.get("per_step") is None:
            p = _matching_period(g, periods, g["seconds"])
            if p is not None:
                fits.setdefault(f"{p['line']}:{p['period']}", []).append(g)
    ambiguous = {k: v for k, v in fits.items() if len(v) > 1}
    candidates = []  # host lines py-spy saw too seldom to name alone, for the periodic lines
    own_step = _own_step_s(run, rank, led)
    noted = set()  # (file, line) of the call-site notes made
    for g in groups:
        if own_step is not None and g.get("runq_s") is not None:
            _without_runqueue_wait(g, own_step, step_s)
    for g in sorted(groups, key=lambda g: -g["seconds"]):
        seconds = g["seconds"]
        share = g.get("share", seconds / step_s)
        src = source_line(g["file"], g["line"], cwd)
        claimed = _claimed(src, led)
        if claimed:
            # its time is another ledger line's and that line's analyzer judges it; the call
            # site goes to that finding (chains.attach_call_sites), not a finding of its own
            booked = min(g.get("seconds_sampled", seconds), float(led[f"{claimed}_s"].mean()))
            if booked / step_s >= MIN_SHARE and g["file"] and not ev.is_library_path(g["file"]):
                findings.append(_call_site_note(run, rank, g, src, claimed, booked, booked / step_s, cwd))
                noted.add((g["file"], g["line"]))
            continue
        if (g["file"], g["line"]) not in framework_lines:
            candidates.append((g, src))
        if share < MIN_SHARE or seconds < MIN_SECONDS or g.get("few_samples"):
            continue
        kind = kind_of(g["call"], src, g.get("lib_file"))
        # a group without a library call holds NaN there (pandas), which is truthy
        call = (g["call"] if isinstance(g["call"], str) else None) or _call_of_kind(src, kind)
        path = _display(g["file"], cwd)
        where = f"{path}:{g['line']}"
        framework = (g["file"], g["line"]) in framework_lines
        period = _matching_period(g, periods, seconds)
        if period and f"{period['line']}:{period['period']}" in ambiguous:
            period = None
        if period:
            used_periods.add(period["line"] + f":{period['period']}")
        what = KIND_TEXT[kind] + (f" ({call})" if call else "")
        if framework:
            title = (
                f"The framework's loop between its measured calls: {seconds * 1e3:.0f} ms a "
                f"step under {g['function']}() ({where})"
            )
            severity = "info"
            summary = (
                f"{share:.0%} of the step runs in library code called from {where} "
                f"({call or 'the framework'}) between the model's forward/backward, the "
                "optimizer step and the data wait: the framework's own per-step work "
                "(logging, callbacks, progress bars). Not a line of your loop body."
            )
            pres = ()
        else:
            every = f" on every {ordinal(period['period'])} step" if period else ""
            title = (
                f"Host work in the training loop{every}: {g['function']}() at {where}, "
                f"{seconds * 1e3:.0f} ms a step ({share:.0%})"
            )
            severity = _severity(kind, share, has_gpu)
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
            pres = tuple(
                _prescriptions(
                    kind,
                    where,
                    src,
                    g["file"],
                    g["line"],
                    seconds,
                    has_gpu,
                    cwd,
                    period["period"] if period else None,
                )
            )
        evidence = {
            "rank": rank,
            "function": g["function"],
            "file": path,
            "line": g["line"],
            "call": call,
            "kind": kind,
            "source": src,
            "seconds_per_step": round(seconds, 5),
            "method": g["method"],
            "step_s": round(step_s, 5),
        }
        for k in ("samples", "share_of_loop_samples", "runqueue_wait"):
            if g.get(k) is not None:
                evidence[k] = g[k]
        if period:
            evidence["period"] = period
        findings.append(
            Finding(
                id="host_work.framework_loop" if framework else "host_work.code",
                title=title,
                severity=severity,
                analyzer=ANALYZER,
                summary=summary,
                steps_affected=tuple(period["steps"]) if period else (),
                seconds_lost_per_step=seconds,
                share_of_step=share,
                evidence=evidence,
                prescriptions=pres,
                ranks=(rank,),
            )
        )
    if from_ledger:
        findings.extend(_call_sites_from_pyspy(run, rank, led, step_s, cwd, noted))
    # a line that differs with a period and no code named for it: the line itself, with the
    # host code py-spy saw most of as the likely one
    for p in periods:
        if f"{p['line']}:{p['period']}" in used_periods or p["line"] not in UNCLAIMED_LINES:
            continue
        lost = p["excess_s"] / p["period"]
        share = lost / step_s
        if share < MIN_SHARE:
            continue
        evidence = {"rank": rank, "period": p}
        code_text, pres = " The record names no code for it.", ()
        tied = ambiguous.get(f"{p['line']}:{p['period']}") or []
        if tied:
            # several lines cost what the excess spreads over the period: name them all, the
            # one most sampled first (py-spy cannot say which one runs only on those steps)
            order = [(g, src) for g, src in candidates if any(g is t for t in tied)]
            candidates = order + [c for c in candidates if c not in order]
            evidence["candidates"] = [
                {
                    "function": g["function"],
                    "file": _display(g["file"], cwd),
                    "line": g["line"],
                    "seconds_per_step": round(g["seconds"], 5),
                }
                for g in tied
            ]
        if candidates:
            g, src = candidates[0]
            path = _display(g["file"], cwd)
            where = f"{path}:{g['line']}"
            call = (g["call"] if isinstance(g["call"], str) else None) or _call_name(None, src)
            kind = kind_of(call, src, g.get("lib_file"))
            code_text = (
                f" The host code py-spy saw most of in the loop is {g['function']}() at "
                f"{where}" + (f": `{src}`" if src else "") + f" ({KIND_TEXT[kind]})."
            )
            if len(tied) > 1:
                code_text += (
                    " Lines that cost what the excess spreads over the period: "
                    + ", ".join(f"{c['file']}:{c['line']}" for c in evidence["candidates"])
                    + " (py-spy has no steps: one of them runs on these steps only)."
                )
            evidence.update(
                function=g["function"],
                file=path,
                line=g["line"],
                call=call,
                kind=kind,
                source=src,
                samples=g.get("samples"),
            )
            pres = tuple(
                _prescriptions(kind, where, src, g["file"], g["line"], lost, has_gpu, cwd, p["period"])
            )
        findings.append(
            Finding(
                id="host_work.periodic_line",
                title=(
                    f"Every {ordinal(p['period'])} step the {p['label']} line is "
                    f"{p['excess_s'] * 1e3:.0f} ms longer on rank {rank}"
                ),
                severity=_severity(evidence.get("kind"), share, has_gpu),
                analyzer=ANALYZER,
                summary=(
                    f"Steps ≡ {p['residue']} mod {p['period']} spend {p['slow_s']:.3f} s in "
                    f"{p['label']} against {p['other_s']:.3f} s for the others." + code_text
                ),
                steps_affected=tuple(p["steps"]),
                seconds_lost_per_step=lost,
                share_of_step=share,
                evidence=evidence,
                prescriptions=pres,
                ranks=(rank,),
            )
        )
    return findings


# the ledger lines no specialised analyzer owns (host work is booked in them; the optimizer line
# holds a closure's code: Lightning's training_step)
UNCLAIMED_LINES = ("host", "forward_backward", "unexplained", "optimizer")


def _without_runqueue_wait(group, own_step, step_s):
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


def _matching_period(group, periods, seconds):
    """The period found in the ledger lines this code's time is booked in, when the code's
    own steps show it (ledger.host_code per step), or - py-spy has no steps - when its cost is
    the excess spread over the period (the caller keeps that only when one line fits)."""
    per_step = group.get("per_step")
    for p in periods:
        if p["line"] not in UNCLAIMED_LINES:
            continue
        if per_step is not None and len(per_step):
            on = per_step[per_step.index.isin(p["steps"])]
            off = per_step[~per_step.index.isin(p["steps"])]
            if len(on) and len(off) and float(on.median()) - float(off.median()) >= 0.5 * p["excess_s"]:
                return p
            continue
        expected = p["excess_s"] / p["period"]
        if expected > 0 and 0.5 <= seconds / expected <= 2.0:
            return p
    return None


def analyze(run):
    findings = []
    if not len(run.ledger):
        return findings
    for rank in sorted(set(run.ledger["rank"]), key=str):
        findings.extend(_analyze_rank(run, rank))
    return findings
