"""Trim run folders recorded by bench/gpu_view.sh into the test fixture
tests/data/h200-gpu-view-cases.tar.xz (what tests/test_gpu_view.py re-analyses on CPU).

    python bench/gpu_view_fixture.py RUNS_DIR OUT.tar.xz [CASE ...] [--steps-only RUN ...]
                                     [--gpu-only RUN ...]

Kept, unchanged: manifest.json, events/*.jsonl, nvml.csv, procs/, the py-spy recordings of the
training process (pyspy/*-all.speedscope.json, *-gil.speedscope.json). The torch.profiler
window (trace/0.json.gz, stored as plain trace/0.json for xz: extract() gzips it back) keeps
every event; of each event only the keys the trace reader
(traindx.profiler.torchtrace) reads: ph, cat, name, ts, dur, pid, tid and the args Python id,
Python parent id, device, stream, bytes, and the Python frames down to LIBRARY_DEPTH calls
below the job's own; an anomaly's deep capture (trace/0.anomaly-*.json.gz) likewise. Left out:
what diagnose derives again (findings.json, ledger.csv, report.html, live.json), py-spy's logs
and dumps.
"""

import glob
import gzip
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile

KEEP_FILES = ("manifest.json", "nvml.csv", "log.txt")
KEEP_DIRS = ("events", "procs")
EVENT_KEYS = ("ph", "cat", "name", "ts", "dur", "pid", "tid")
ARG_KEYS = ("Python id", "Python parent id", "device", "stream", "bytes", "correlation", "Sequence number")
# python_function calls kept below the job's own frames: its calls and theirs (what the GPU
# analyzers read: the statement a sync ends, the call an idle gap ends in); deeper library
# internals (torch's own Python under a call) are left out
LIBRARY_DEPTH = 2
# ... and, at any depth, the tool's own calls (torch.profiler's, traindx's): the analyzers leave
# the window's time in them out
TOOL_FRAMES = ("torch/profiler/", "torch/autograd/profiler", "_traindx_shim/")


def _library_depths(events):
    """{Python id: calls between it and the nearest enclosing frame of the job's own code}."""
    from traindx.analyzers.core import evidence as ev

    parent, own = {}, {}
    for e in events:
        if e.get("cat") == "python_function" and isinstance(e.get("args"), dict):
            pid = e["args"].get("Python id")
            if pid is None:
                continue
            parent[pid] = e["args"].get("Python parent id")
            parsed = ev.parse_trace_frame(e.get("name"))
            own[pid] = bool(parsed) and not ev.is_library_trace_file(parsed[0])
    depth = {}
    for pid in parent:
        chain, p = [], pid
        while p in parent and p not in depth and not own[p]:
            chain.append(p)
            p = parent[p]
        d = depth.get(p, 0)  # an own frame, the root, or one already known
        for q in reversed(chain):
            d += 1
            depth[q] = d
        if pid in own and own[pid]:
            depth[pid] = 0
    return depth


GPU_ONLY_CATS = (
    "kernel",
    "gpu_memcpy",
    "gpu_memset",
    "cuda_runtime",
    "cuda_driver",
    "user_annotation",
    "gpu_user_annotation",
)


def trim_trace(src, dest, gpu_only=False):
    """The window's events, trimmed (module docstring); gpu_only: the GPU's work and the CUDA
    calls only (no CPU op, no Python frame)."""
    with gzip.open(src, "rt") as f:
        doc = json.load(f)
    events = []
    for e in doc.get("traceEvents", []):
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        if gpu_only and e.get("cat") not in GPU_ONLY_CATS:
            continue
        out = {k: e[k] for k in EVENT_KEYS if k in e}
        args = {k: e["args"][k] for k in ARG_KEYS if isinstance(e.get("args"), dict) and k in e["args"]}
        if args:
            out["args"] = args
        events.append(out)
    depth = _library_depths(events)
    events = [
        e
        for e in events
        if e.get("cat") != "python_function"
        or depth.get((e.get("args") or {}).get("Python id"), 0) <= LIBRARY_DEPTH
        or str(e.get("name", "")).startswith(TOOL_FRAMES)
    ]
    top = {k: v for k, v in doc.items() if k != "traceEvents" and not isinstance(v, (list, dict))}
    # the same instants with fewer digits: whole microseconds move from every ts into the base
    shift = int(min((e["ts"] for e in events), default=0))
    for e in events:
        e["ts"] = round(e["ts"] - shift, 3)
    top["baseTimeNanoseconds"] = int(top.get("baseTimeNanoseconds") or 0) + shift * 1000
    top["traceEvents"] = events
    with open(dest, "w") as f:  # plain JSON: the tar's xz compresses it (tests gzip it back)
        json.dump(top, f, separators=(",", ":"))


def trim_run(src, dest, steps_only=False, gpu_only=False):
    """A trimmed copy of one run folder; steps_only: its manifest and events (a twin whose step
    times are all a test reads); gpu_only: its trace without CPU ops and Python frames."""
    os.makedirs(dest)
    for name in KEEP_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), dest)
    for name in KEEP_DIRS:
        if os.path.isdir(os.path.join(src, name)):
            shutil.copytree(os.path.join(src, name), os.path.join(dest, name))
    pyspy = os.path.join(src, "pyspy")
    if steps_only:
        return
    if os.path.isdir(pyspy):
        os.makedirs(os.path.join(dest, "pyspy"))
        for name in sorted(os.listdir(pyspy)):
            if name.endswith(".speedscope.json"):
                shutil.copy2(os.path.join(pyspy, name), os.path.join(dest, "pyspy", name))
    traces = os.path.join(src, "trace")
    names = sorted(n for n in os.listdir(traces) if n.endswith(".json.gz")) if os.path.isdir(traces) else []
    if names:
        os.makedirs(os.path.join(dest, "trace"))
    for name in names:  # the window, and an anomaly's deep capture (both read as the window)
        trim_trace(os.path.join(traces, name), os.path.join(dest, "trace", name[:-3]), gpu_only)


def extract(archive, dest):
    """Unpack the fixture into dest (a run folder per case arm), each trace gzipped back to
    the name diagnose gives it (trace/<name>.json.gz)."""
    with tarfile.open(archive, "r:xz") as tar:
        try:
            tar.extractall(dest, filter="data")
        except TypeError:  # Python before 3.11.4: no extraction filters (our own archive)
            tar.extractall(dest)
    for plain in glob.glob(os.path.join(dest, "*", "trace", "*.json")):
        with open(plain, "rb") as f, gzip.open(plain + ".gz", "wb", compresslevel=1) as g:
            shutil.copyfileobj(f, g)
        os.remove(plain)
    return dest


def main(argv):
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[2].strip())
        return 2
    root, out, rest = argv[1], argv[2], argv[3:]
    lists, key = {"": [], "--steps-only": [], "--gpu-only": []}, ""
    for arg in rest:
        if arg in lists:
            key = arg
        else:
            lists[key].append(arg)
    cases, steps_only, gpu_only = lists[""], set(lists["--steps-only"]), set(lists["--gpu-only"])
    names = sorted(
        n
        for n in os.listdir(root)
        if os.path.isdir(os.path.join(root, n))
        and n.rsplit("-", 1)[-1] in ("bad", "fixed")
        and (not cases or n.rsplit("-", 1)[0] in cases)
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            trim_run(os.path.join(root, name), os.path.join(tmp, name), name in steps_only, name in gpu_only)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz", preset=9) as tar:
            for name in names:
                tar.add(os.path.join(tmp, name), arcname=name)
        with open(out, "wb") as f:
            f.write(buf.getvalue())
    print(f"{out}: {len(names)} runs, {os.path.getsize(out) / 1e3:.0f} kB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
