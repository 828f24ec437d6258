"""Side by side on one Kineto trace: traindx's streaming reader vs Holistic Trace Analysis.

usage: python bench/trace_vs_hta.py [--mb 1024] [--work /tmp/traindx-trace]
           [--hta-python /tmp/hta-venv/bin/python] [--json OUT.json]

Writes (or reuses) a synthetic trace of --mb MB (bench/synth_trace.py) as WORK/trace/0.json and
measures, each in a fresh subprocess (wall seconds; peak RSS of that child from os.wait4):
  traindx  traindx.profiler.torchtrace.load_trace (streamed into the columnar table) and a
           per-kernel-name time summary over it (what launch_bound/host_sync start from)
  hta      hta.trace_analysis.TraceAnalysis(trace_dir=WORK/trace) (HTA's parse, its default
           parser backend) and get_temporal_breakdown(visualize=False)
HTA runs from its own virtual environment (install it there only:
  python3 -m venv /tmp/hta-venv && /tmp/hta-venv/bin/pip install torch==2.13.0 \\
      HolisticTraceAnalysis==0.5.0)
The same file, the same machine, one after the other in one run; the load average is recorded.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import synth_trace  # noqa: E402
from scale import measure  # noqa: E402

OURS = """
import time
t = time.perf_counter()
from traindx.profiler.torchtrace import load_trace
df = load_trace({path!r}, "0")
parsed = time.perf_counter() - t
kernels = df[df["cat"] == "kernel"].groupby("name")["dur_s"].agg(["count", "sum"])
print("events", len(df), "kernels", int(kernels["count"].sum()), "parse_s", round(parsed, 2))
"""
HTA = """
import time
t = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
analyzer = TraceAnalysis(trace_dir={trace_dir!r})
parsed = time.perf_counter() - t
breakdown = analyzer.get_temporal_breakdown(visualize=False)
df = analyzer.t.get_trace(0)
print("events", len(df), "parse_s", round(parsed, 2))
print(breakdown.to_string()[:400])
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=1024)
    p.add_argument("--work", default="/tmp/traindx-trace")
    p.add_argument("--hta-python", default="/tmp/hta-venv/bin/python")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--skip-hta", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    trace_dir = os.path.join(a.work, "trace")
    path = os.path.join(trace_dir, "0.json")
    os.makedirs(trace_dir, exist_ok=True)
    if not os.path.exists(path):
        t = time.perf_counter()
        info = synth_trace.write_trace(path, a.mb)
        print(f"wrote {info} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    size_mb = os.path.getsize(path) / 1e6
    doc = {
        "trace_mb": round(size_mb, 1),
        "cpus": os.cpu_count(),
        "load_1min_at_start": round(os.getloadavg()[0], 2),
        "runs": {},
    }
    runs = [("traindx", [sys.executable, "-c", OURS.format(path=path)])]
    if not a.skip_hta:
        runs.append(("hta", [a.hta_python, "-c", HTA.format(trace_dir=trace_dir)]))
    for name, cmd in runs:
        wall, rss, rc, timed_out, tail = measure(cmd, a.timeout)
        row = {
            "wall_s": round(wall, 1),
            "peak_rss_mb": round(rss),
            "rss_per_trace_mb": round(rss / size_mb, 2),
            "rc": rc,
            "timed_out": timed_out,
            "load_1min_after": round(os.getloadavg()[0], 2),
        }
        if rc:
            row["stderr"] = tail
        doc["runs"][name] = row
        print(name, json.dumps(row), file=sys.stderr)
    ours, hta = doc["runs"].get("traindx"), doc["runs"].get("hta")
    if ours and hta and not hta["rc"] and not ours["rc"]:
        doc["speedup_vs_hta"] = round(hta["wall_s"] / ours["wall_s"], 2)
        doc["ram_vs_hta"] = round(ours["peak_rss_mb"] / hta["peak_rss_mb"], 3)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
