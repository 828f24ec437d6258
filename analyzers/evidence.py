"""Shared reading of the run record for the analyzers: the steady window of steps, the steps the
torch.profiler window slowed down, severities from the share of step time lost, and telling the
job's own code from libraries in py-spy and torch.profiler frames."""
import re
import sys

import numpy as np
import pandas as pd

# share of step time lost -> severity; below the lowest: "info"
SEVERITY_BY_SHARE = ((0.30, "high"), (0.10, "medium"), (0.03, "low"))
SEVERITY_ORDER = ("info", "low", "medium", "high", "critical")


def union_seconds(intervals):
    """Seconds covered by (start_ns, end_ns) intervals, overlaps counted once."""
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e9


def severity_for_share(share):
    for limit, severity in SEVERITY_BY_SHARE:
        if share is not None and share >= limit:
            return severity
    return "info"


def profiled_steps(run):
    """{rank: set(step)} of the steps inside a torch.profiler window (slower by design)."""
    out = {}
    for e in events_of_type(run, "torch_profile").itertuples():
        first, last = getattr(e, "first_step", None), getattr(e, "last_step", None)
        if pd.notna(first) and pd.notna(last):
            out.setdefault(e.rank, set()).update(range(int(first), int(last) + 1))
    return out


def warmup_count(durations):
    """How many leading steps are warm-up: step 0 always (imports, first compiles, allocator);
    then every leading step slower than 1.5x the median of the second half (at most half)."""
    n = len(durations)
    if n == 0:
        return 0
    reference = float(pd.Series(durations[n // 2:]).median())
    count = 1
    while count < n // 2 and durations[count] > 1.5 * reference:
        count += 1
    return count


def steady_steps(run, rank=None, keep_profiled=False):
    """The steps of the steady window, per rank: no warm-up, no torch.profiler window.
    Built once per run for every rank (vectorised warm-up count), then sliced per rank."""
    key = ("steady_steps", keep_profiled)
    table = run.cached(key, lambda: _steady_all(run, keep_profiled))
    if rank is None:
        return table.copy(deep=False)
    return run.rank_rows(key, rank, table)


def _steady_all(run, keep_profiled):
    steps = run.steps.dropna(subset=["duration_s"])
    if not len(steps):
        return steps.iloc[0:0]
    # rank order as groupby gives it, step order within a rank
    steps = steps.sort_values(["rank", "step"], kind="stable")
    rank = steps["rank"]
    pos = steps.groupby("rank", sort=False).cumcount().to_numpy()
    n = rank.map(rank.value_counts()).to_numpy()
    d = steps["duration_s"].to_numpy(np.float64)
    second_half = pos >= n // 2
    ref = steps["duration_s"][second_half].groupby(rank[second_half], sort=False).median()
    ref = rank.map(ref).to_numpy(np.float64)
    # warmup_count per rank: step 0, then the leading steps slower than 1.5x the reference
    stop = (pos >= 1) & ~(d > 1.5 * ref)
    first_stop = pd.Series(np.where(stop, pos, np.iinfo(np.int64).max), index=steps.index) \
        .groupby(rank, sort=False).transform("min").to_numpy()
    count = np.maximum(1, np.minimum(first_stop, n // 2))
    out = steps[pos >= count]
    if not keep_profiled:
        profiled = profiled_steps(run)
        if profiled:
            pairs = {(r, int(s)) for r, ss in profiled.items() for s in ss}
            keys = pd.MultiIndex.from_arrays([out["rank"], out["step"].astype(np.int64)])
            out = out[~keys.isin(list(pairs))]
    return out


def steps_seconds(run, rank):
    """Total seconds of all the completed steps of a rank: what py-spy seconds spent in the
    training loop compare against (py-spy has no timestamps; set-up and exit are not steps)."""
    steps = run.rank_steps(rank).dropna(subset=["duration_s"])
    return float(steps["duration_s"].sum()) if len(steps) else 0.0


def median_step_s(run, rank=None):
    steady = steady_steps(run, rank)
    if len(steady):
        return float(steady["duration_s"].median())
    steps = run.steps.dropna(subset=["duration_s"])
    if len(steps):
        return float(steps["duration_s"].median())
    # no shim (attach, --no-shim): the step time the job prints itself, if it does
    logged = run.log_steps["step_time_s"].dropna() if len(run.log_steps) else []
    return float(logged.iloc[len(logged) // 4:].median()) if len(logged) else None


# -- frames ----------------------------------------------------------------------------------
_LIBRARY_PATH = re.compile(r"[/\\](site|dist)-packages[/\\]|[/\\]lib[/\\]python\d\.\d+[/\\]|^<")
# python_function names in torch.profiler traces: "path/relative/to/sys.path(LINE): function"
_TRACE_FRAME = re.compile(r"^(?P<file>.+?)\((?P<line>\d+)\): (?P<function>.+)$")
KNOWN_LIBRARIES = {
    "torch", "torchvision", "torchaudio", "triton", "numpy", "transformers", "megatron",
    "flash_attn", "cutlass", "apex", "transformer_engine", "deepspeed", "accelerate", "swift",
    "datasets", "einops", "fla", "torchtitan", "tensordict", "pandas", "traindx", "_traindx_shim",
    "functorch", "sympy", "safetensors", "tokenizers", "peft", "trl", "lightning",
    "pytorch_lightning", "jinja2", "google", "tqdm", "wandb", "tensorboard", "nvtx", "pynvml",
    "scipy", "sklearn", "filelock", "fsspec", "requests", "urllib3", "typing_extensions",
}


LOW_LEVEL_PACKAGES = frozenset({
    "torch", "torchgen", "functorch", "flash_attn", "cutlass", "nvidia_cutlass_dsl", "tvm_ffi",
    "triton", "numpy", "einops", "quack", "_traindx_shim", "traindx", "importlib", "concurrent",
})


def is_library_path(path):
    """py-spy paths are absolute: the interpreter's lib, site-packages, and the low-level
    packages wherever a cluster installs them (the H200 machine: /opt/gpu-site/site)."""
    if not path or _LIBRARY_PATH.search(path):
        return True
    parts = re.split(r"[/\\]", path)[:-1]
    return any(p in LOW_LEVEL_PACKAGES for p in parts)


def parse_trace_frame(name):
    """(file, line, function) of a torch.profiler python_function event, or None for builtins."""
    m = _TRACE_FRAME.match(name or "")
    if not m:
        return None
    return m["file"], int(m["line"]), m["function"]


def is_library_trace_file(path):
    """torch.profiler strips the sys.path prefix, so tell libraries by their top-level name."""
    if is_library_path(path) and path.startswith(("/", "<")):
        return True
    top = re.split(r"[/\\]", path, maxsplit=1)[0]
    top = top[:-3] if top.endswith(".py") else top
    return top in KNOWN_LIBRARIES or top in sys.stdlib_module_names


def user_frames(stack):
    """The job's own frames of a py-spy stack (root first), innermost last."""
    return [f for f in stack if not is_library_path(f.file)]


def frame_label(frame):
    return f"{frame.name} ({frame.file}:{frame.line})"


# -- py-spy threads ----------------------------------------------------------------------------
_THREAD_NAME = re.compile(r'^Thread (?P<tid>\d+|0x[0-9a-fA-F]+)(?: "(?P<name>.*)")?$')


def thread_key(name):
    """(thread id, thread name) of a py-spy thread label like 'Thread 8485 "MainThread"'.
    The --idle and --gil recordings name one thread differently; its id is the same."""
    m = _THREAD_NAME.match(name or "")
    if not m:
        return name, name
    return m["tid"], m["name"] or ""


_THREAD_ROOT = re.compile(r"^thread \((?P<tid>\d+|0x[0-9a-fA-F]+)\): (?P<name>.+)$")


def _name_from_root_frames(samples):
    """py-spy 0.4 sometimes leaves 'thread (718): MainThread' as a root frame of the samples."""
    for stack in samples.stacks[:50]:
        for frame in stack[:2]:
            m = _THREAD_ROOT.match(frame.name) if not frame.file else None
            if m:
                return m["name"]
    return ""


def merge_threads(recording):
    """{thread id: (name, ThreadSamples)} with the name of the first non-empty label."""
    out = {}
    for label, samples in (recording or {}).items():
        tid, name = thread_key(label)
        name = name or _name_from_root_frames(samples)
        if tid in out:
            prev_name, prev = out[tid]
            prev.stacks.extend(samples.stacks)
            prev.weights.extend(samples.weights)
            out[tid] = (prev_name or name, prev)
        else:
            out[tid] = (name, samples)
    return out


IMPORT_FRAME_FILES = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")


def is_import_sample(stack):
    """A sample taken while Python imports modules: start-up, not training."""
    return any(f.file in IMPORT_FRAME_FILES for f in stack)


def training_weight(samples, keep=lambda stack: True):
    """Seconds of samples (py-spy weights are seconds) outside imports that satisfy `keep`."""
    total = 0.0
    for stack, weight in zip(samples.stacks, samples.weights):
        if not is_import_sample(stack) and keep(stack):
            total += weight
    return total


def hottest_frames(samples, limit=5, keep=lambda stack: True):
    """[(Frame, seconds)] per function of the innermost own-code frame (falling back to the
    leaf) of the samples kept, hottest first; the Frame carries the function's hottest line."""
    by_function, by_line = {}, {}
    for stack, weight in zip(samples.stacks, samples.weights):
        if is_import_sample(stack) or not stack or not keep(stack):
            continue
        own = user_frames(stack)
        frame = own[-1] if own else stack[-1]
        key = (frame.name, frame.file)
        by_function[key] = by_function.get(key, 0.0) + weight
        by_line[frame] = by_line.get(frame, 0.0) + weight
    hottest_line = {}
    for frame, seconds in by_line.items():
        key = (frame.name, frame.file)
        if key not in hottest_line or seconds > by_line[hottest_line[key]]:
            hottest_line[key] = frame
    ranked = sorted(by_function.items(), key=lambda kv: -kv[1])[:limit]
    return [(hottest_line[key], seconds) for key, seconds in ranked]


def hottest_leaves(samples, limit=5, keep=lambda stack: True):
    """[(Frame, seconds)] of the innermost frames, libraries included."""
    counts = {}
    for stack, weight in zip(samples.stacks, samples.weights):
        if is_import_sample(stack) or not stack or not keep(stack):
            continue
        counts[stack[-1]] = counts.get(stack[-1], 0.0) + weight
    return sorted(counts.items(), key=lambda kv: -kv[1])[:limit]


def frames_evidence(hot):
    return [{"frame": frame_label(f), "function": f.name, "file": f.file, "line": f.line,
             "seconds": round(s, 3)} for f, s in hot]


def main_thread_id(recording_all, recording_gil):
    """The py-spy id of the main thread: the one the --gil recording names MainThread, else the
    one with the most samples in the --idle recording (it lives for the whole job)."""
    for recording in (recording_gil, recording_all):
        for tid, (name, _) in merge_threads(recording).items():
            if name == "MainThread":
                return tid
    threads = merge_threads(recording_all)
    if not threads:
        return None
    return max(threads, key=lambda tid: sum(threads[tid][1].weights))


def own_thread(name):
    """traindx's own threads (the shim's writer) are never the job's problem."""
    return (name or "").startswith("traindx-")


# -- torch.profiler ----------------------------------------------------------------------------
def enclosing_user_function(py_events, thread, t_ns):
    """The innermost python_function event of the job's own code on `thread` that encloses
    time t_ns: (file, def line, function) or None. py_events: that rank's python_function rows."""
    rows = py_events[(py_events["tid"] == thread) & (py_events["start_ns"] <= t_ns)
                     & (py_events["end_ns"] >= t_ns)]
    best = None
    for row in rows.itertuples():
        parsed = parse_trace_frame(row.name)
        if not parsed or is_library_trace_file(parsed[0]):
            continue
        if best is None or row.start_ns >= best[0]:
            best = (row.start_ns, parsed)
    return None if best is None else best[1]


def enclosing_frames(py_events, thread, t_ns):
    """Names of the python_function events on `thread` that enclose t_ns, innermost first."""
    rows = py_events[(py_events["tid"] == thread) & (py_events["start_ns"] <= t_ns)
                     & (py_events["end_ns"] >= t_ns)]
    return list(rows.sort_values("start_ns", ascending=False)["name"])


def step_of(run, rank, t_ns):
    steps = run.rank_steps(rank)
    hit = steps[(steps["start_ns"] <= t_ns) & (steps["end_ns"] >= t_ns)]
    return None if not len(hit) else int(hit["step"].iloc[0])


def trace_steps(run, rank):
    """Steps of `rank` inside its torch.profiler window, as rows of run.steps."""
    steps = run.rank_steps(rank)
    return steps[steps["step"].isin(profiled_steps(run).get(rank, set()))]


def events_of_type(run, type_):
    """The events of one type: RunRecord.of_type (the per-type table); for a record-like object
    with only a wide `events` frame, that frame filtered."""
    if hasattr(run, "of_type"):
        return run.of_type(type_)
    events = getattr(run, "events", None)
    if events is None or not len(events) or "type" not in events:
        return pd.DataFrame()
    return events[events["type"] == type_].dropna(axis=1, how="all")
