"""The scale benchmark: analysis cost (wall seconds, peak RSS) over a grid of ranks x steps.

usage: python bench/scale.py [--grid 8x1000,8x4000,64x2000,256x2000,1024x2000] [--timeout 600]
                             [--what report|load|load-cached|imports] [--cache cold|warm]
                             [--work /tmp/traindx-scale] [--max-gb G] [--json OUT.json] [--md OUT.md]

Each cell writes a synthetic run record with bench/synth_run.py (cached under --work, reused
when present) and measures, in a fresh subprocess of its own:
  report         `diagnose report --reanalyze --quiet RUN` (load + every analyzer + the HTML)
  load           traindx.load_run(RUN) and every event table (steps, spans, ledger built)
  load-cached    the same with the Parquet cache (tables/events/) warm
  imports        only the imports (pandas, pyarrow): the fixed cost inside every load figure
--cache cold (default) removes the Parquet cache before each cell, so the events are parsed
from the JSONL files (and the cache written, as a first analysis does); warm runs the cell once
unmeasured first, so the measured run reads the tables from Parquet.
--nodes-of K writes each cell as a multi-node run (RANKS / K nodes of K ranks: RUN/nodes/node-NNN/,
each node's clock skewed by up to ±1 s and aligned by the process group's first barrier) and
measures what each stage of a real multi-node run costs:
  node tables    record.write_tables(node folder) for every node, timed one by one in one child
                 (what each node's diagnose pays at its job's end; --node-tables no skips it, so
                 the central analysis parses every node's JSONL)
  merge          `diagnose merge RUN --no-report` (clock.json and the merged manifest: the real
                 merge code, reading the nodes' tables)
  report         `diagnose report --reanalyze --quiet RUN` on the merged run (run-wide cache and
                 outputs removed first: the central analysis as it runs after the merge)
Wall seconds come from time.perf_counter around the child; peak RSS from os.wait4's rusage
of that child alone (ru_maxrss, KiB on Linux). A cell that passes --timeout is killed and
recorded as a timeout (a lower bound), and the larger cells of that row are skipped.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import synth_run  # noqa: E402

LOADERS = {
    "imports": "import traindx.derive.run, traindx.profiler.columnar; print({path!r})",  # the fixed cost
    "load": "from traindx.derive.run import load_run; r = load_run({path!r}); print(len(r.ledger))",
    "load-cached": "from traindx.derive.run import load_run; r = load_run({path!r}, cache=True); "
    "print(len(r.ledger))",
}


def command_for(what, path):
    if what == "report":
        return [sys.executable, "-m", "traindx", "report", "--reanalyze", "--quiet", path]
    return [sys.executable, "-c", LOADERS[what].format(path=path)]


def _limit_memory(gb):
    def apply():
        import resource

        limit = int(gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


def measure(cmd, timeout, max_gb=None):
    """(wall_s, peak_rss_mb, returncode, timed_out, stderr tail) of one child process.
    max_gb: the child's address-space limit (RLIMIT_AS): on a shared machine a cell that would
    need more fails with a MemoryError instead of pushing everyone else out of memory."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_limit_memory(max_gb) if max_gb else None,
    )
    timed_out = threading.Event()

    def kill():
        timed_out.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout, kill)
    timer.start()
    err = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    timer.cancel()
    reader.join(timeout=5)
    proc.returncode = os.waitstatus_to_exitcode(status)
    tail = (err[0] if err else b"").decode("utf-8", "replace").strip().splitlines()[-3:]
    return wall, usage.ru_maxrss / 1024, proc.returncode, timed_out.is_set(), tail


NODE_TABLES = """
import glob, json, statistics, sys, time
from traindx.derive.run import write_tables
out = []
for folder in sorted(glob.glob(sys.argv[1] + "/nodes/*/")):
    t = time.perf_counter()
    problem = write_tables(folder.rstrip("/"))
    out.append(time.perf_counter() - t)
    if problem:
        sys.exit(f"{folder}: {problem}")
print(json.dumps(out))
"""


def multinode_dir(work, ranks, steps, seed, per_node):
    path = os.path.join(work, f"mn{ranks}x{steps}-k{per_node}-s{seed}")
    if not os.path.isdir(os.path.join(path, "nodes")):
        shutil.rmtree(path, ignore_errors=True)
        t = time.perf_counter()
        synth_run.write_multinode(path, ranks // per_node, per_node, steps, seed)
        print(f"  wrote {path} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return path


def multinode_cell(a, ranks, steps):
    """{node tables, merge, report} costs of one multi-node cell (see the module's doc)."""
    import glob
    import statistics

    path = multinode_dir(a.work, ranks, steps, a.seed, a.nodes_of)
    for folder in glob.glob(os.path.join(path, "nodes", "*", "tables")):
        shutil.rmtree(folder)
    row = {
        "ranks": ranks,
        "steps": steps,
        "nodes": ranks // a.nodes_of,
        "ranks_per_node": a.nodes_of,
        "record_mb": round(size_mb(path), 1),
        "node_tables": a.node_tables,
        "load_1min_before": round(os.getloadavg()[0], 2),
    }
    if a.node_tables == "yes":
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", NODE_TABLES, path], capture_output=True, text=True, check=False
        )
        if done.returncode:
            row["node_tables_error"] = done.stderr.strip().splitlines()[-3:]
            return row
        per_node = json.loads(done.stdout)
        row.update(
            node_tables_median_s=round(statistics.median(per_node), 3),
            node_tables_max_s=round(max(per_node), 3),
            node_tables_total_s=round(sum(per_node), 1),
            node_tables_child_wall_s=round(time.perf_counter() - start, 1),
        )
    for name in ("manifest.json", "clock.json", "nvml.csv", "log.txt"):
        if os.path.exists(os.path.join(path, name)):
            os.remove(os.path.join(path, name))
    shutil.rmtree(os.path.join(path, "pyspy"), ignore_errors=True)
    wall, rss, rc, to, tail = measure(
        [sys.executable, "-m", "traindx", "merge", "--no-report", "--quiet", path], a.timeout, a.max_gb
    )
    row.update(merge_wall_s=round(wall, 2), merge_peak_rss_mb=round(rss, 1), merge_rc=rc)
    if rc:
        row["stderr"] = tail
        return row
    shutil.rmtree(os.path.join(path, "tables"), ignore_errors=True)
    for name in ("findings.json", "report.html"):
        if os.path.exists(os.path.join(path, name)):
            os.remove(os.path.join(path, name))
    wall, rss, rc, to, tail = measure(command_for("report", path), a.timeout, a.max_gb)
    row.update(
        wall_s=round(wall, 2),
        peak_rss_mb=round(rss, 1),
        rc=rc,
        timed_out=to,
        record_mb=round(size_mb(path), 1),
    )
    if rc and not to:
        row["stderr"] = tail
    return row


def run_dir(work, ranks, steps, seed):
    path = os.path.join(work, f"r{ranks}x{steps}-s{seed}")
    if not os.path.exists(os.path.join(path, "manifest.json")):
        shutil.rmtree(path, ignore_errors=True)
        t = time.perf_counter()
        synth_run.write_run(path, ranks, steps, seed)
        print(f"  wrote {path} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return path


def size_mb(path):
    total = 0
    for dirpath, _, files in os.walk(path):
        if "tables" in os.path.relpath(dirpath, path).split(os.sep):
            continue  # the event tables are a copy of the record, not part of it
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return total / 1e6


def _parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default="8x1000,8x4000,64x2000,256x2000,1024x2000")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--what", default="report", choices=["report", *LOADERS])
    p.add_argument("--cache", default="cold", choices=["cold", "warm"])
    p.add_argument("--work", default="/tmp/traindx-scale")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    p.add_argument(
        "--max-gb", type=float, default=None, help="address-space limit of each measured child (GiB)"
    )
    p.add_argument(
        "--nodes-of",
        type=int,
        default=None,
        metavar="K",
        help="write each cell as a multi-node run of K ranks per node (report only)",
    )
    p.add_argument(
        "--node-tables",
        default="yes",
        choices=["yes", "no"],
        help="with --nodes-of: each node writes its tables first (as its diagnose does)",
    )
    return p


def main(argv=None):
    a = _parser().parse_args(argv)
    cells = []
    for item in a.grid.split(","):
        r, _, s = item.strip().partition("x")
        cells.append((int(r), int(s)))
    os.makedirs(a.work, exist_ok=True)
    results = []
    timed_out_at = None
    load = os.getloadavg()[0]
    for ranks, steps in cells:
        if timed_out_at and ranks * steps >= timed_out_at:
            results.append(
                {"ranks": ranks, "steps": steps, "skipped": "a smaller cell timed out or ran out of memory"}
            )
            continue
        if a.nodes_of:
            row = multinode_cell(a, ranks, steps)
            results.append(row)
            print(json.dumps(row), file=sys.stderr)
            continue
        row, to = _measured_cell(a, ranks, steps)
        if to or row.get("out_of_memory_limit_gb"):
            timed_out_at = ranks * steps
        results.append(row)
        print(json.dumps(row), file=sys.stderr)
    doc = {
        "what": a.what,
        "cache": a.cache,
        "nodes_of": a.nodes_of,
        "node_tables": a.node_tables,
        "timeout_s": a.timeout,
        "cpus": os.cpu_count(),
        "load_1min_at_start": round(load, 2),
        "python": sys.version.split()[0],
        "cells": results,
    }
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
    table = markdown(doc)
    if a.md:
        with open(a.md, "w", encoding="utf-8") as f:
            f.write(table)
    print(table)
    return 0


def _measured_cell(a, ranks, steps):
    """One cell of the grid: its run written (once), the command measured in a child."""
    path = run_dir(a.work, ranks, steps, a.seed)
    shutil.rmtree(os.path.join(path, "tables"), ignore_errors=True)
    if a.cache == "warm" or a.what == "load-cached":  # warm it in a child not measured
        subprocess.run(command_for("load-cached", path), stdout=subprocess.DEVNULL, check=False)
    if a.what == "report":  # analysis rebuilds them; a stale one must not be measured
        for name in ("findings.json", "report.html"):
            if os.path.exists(os.path.join(path, name)):
                os.remove(os.path.join(path, name))
    wall, rss, rc, to, tail = measure(command_for(a.what, path), a.timeout, a.max_gb)
    row = {
        "ranks": ranks,
        "steps": steps,
        "record_mb": round(size_mb(path), 1),
        "wall_s": round(wall, 2),
        "peak_rss_mb": round(rss, 1),
        "rc": rc,
        "timed_out": to,
        "load_1min_before": round(os.getloadavg()[0], 2),
    }
    if rc and not to:
        row["stderr"] = tail
        if any("MemoryError" in line or "bad_alloc" in line or "Cannot allocate" in line for line in tail):
            row["out_of_memory_limit_gb"] = a.max_gb
    return row, to


def markdown(doc):
    lines = [
        f"| ranks x steps | record MB | {doc['what']} ({doc.get('cache', 'cold')}) wall s | peak RSS MB |",
        "|---|---|---|---|",
    ]
    for c in doc["cells"]:
        if "skipped" in c:
            lines.append(f"| {c['ranks']} x {c['steps']} | | skipped ({c['skipped']}) | |")
            continue
        if "wall_s" not in c:
            lines.append(
                f"| {c['ranks']} x {c['steps']} | {c['record_mb']:.0f} | failed: "
                f"{c.get('node_tables_error') or c.get('stderr')} | |"
            )
            continue
        wall = f"> {c['wall_s']:.0f} (timeout)" if c["timed_out"] else f"{c['wall_s']:.1f}"
        if c.get("nodes"):
            wall += (
                f" ({c['nodes']} nodes; merge {c['merge_wall_s']:.1f} s; node tables "
                + (
                    f"median {c['node_tables_median_s']:.2f} s"
                    if "node_tables_median_s" in c
                    else "not written"
                )
                + ")"
            )
        if c.get("out_of_memory_limit_gb"):
            wall += f" (over the {c['out_of_memory_limit_gb']:g} GiB limit)"
        elif c["rc"] and not c["timed_out"]:
            wall += f" (exit {c['rc']})"
        lines.append(
            f"| {c['ranks']} x {c['steps']} | {c['record_mb']:.0f} | {wall} | {c['peak_rss_mb']:.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
