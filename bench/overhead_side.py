"""Overhead of `diagnose` on a loaded, shared machine: the bare job and the diagnosed one run at
the same time, side by side, so that both see the same load (interleaved runs on a machine whose
load drifts by 2x within a minute compare the drift, not diagnose). Each step line is
timestamped as it is read; only the steps both jobs ran in the same wall-clock window count
(after --skip warm-up steps of each). A pair's ratio: the diagnosed job's median step over the
bare one's in that window. --reps pairs per arm, which one starts first alternating.

Each command starts in a session of its own, as `diagnose` starts its job: where the kernel's
autogroup is on (/proc/sys/kernel/sched_autogroup_enabled) a session is a scheduling group of
its own, and a bare job sharing the bench's would get a smaller share of a loaded machine.

What it cannot see: the helpers' CPU taxes the bare job beside them too (by its share of the
machine), so a helper's cost is underestimated by that share; the shim's in-job cost is not.

usage: python bench/overhead_side.py [--reps 5] [--skip 10] [--json out.json] [--keep DIR]
                                     [--variant 'NAME=DIAGNOSE ARGS' ...] -- <job command>
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import stated_cost  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from traindx.profiler.logparse import parse_line  # noqa: E402


def _launch(command):
    """Start a command; its step times with the wall-clock time each line was read."""
    # a session of its own each, as diagnose starts its job: with the kernel's autogroup on, a
    # session is a scheduling group, and a job sharing one would get a smaller share
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    steps = []

    def read():
        for line in proc.stdout:
            r = parse_line(line)
            if r and r.get("step_time_s") is not None:
                steps.append((time.time(), r["step_time_s"]))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return proc, reader, steps


def run_pair(command, diagnose_args, run_dir, bare_first):
    diagnosed = [
        sys.executable,
        "-m",
        "traindx",
        "--quiet",
        "--run-dir",
        run_dir,
        *diagnose_args,
        "--",
        *command,
    ]
    order = [command, diagnosed] if bare_first else [diagnosed, command]
    started = [_launch(c) for c in order]
    for proc, reader, _ in started:
        proc.wait()
        reader.join()
    bare, arm = (started[0][2], started[1][2]) if bare_first else (started[1][2], started[0][2])
    return bare, arm


def _in_job_pct(cost):
    """The stated cost's in-job part (the shim's time and its threads'), % of the bare step."""
    try:
        part = cost["shim_s_per_step"] + cost["threads_s_per_step"]
        return 100.0 * part / (cost["step_s"] - cost["per_step_s"])
    except (TypeError, KeyError, ZeroDivisionError):
        return None


def common_window(bare, arm, skip):
    bare, arm = bare[skip:], arm[skip:]
    if not bare or not arm:
        return [], []
    lo, hi = max(bare[0][0], arm[0][0]), min(bare[-1][0], arm[-1][0])
    pick = lambda steps: [t for ts, t in steps if lo <= ts <= hi]  # noqa: E731
    return pick(bare), pick(arm)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip", type=int, default=10)
    p.add_argument("--json")
    p.add_argument("--keep", help="keep each diagnosed run's folder under this folder")
    p.add_argument("--variant", action="append", default=[], help="NAME=ARGS: a diagnose arm")
    p.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    arms = {"diagnose": []}
    for v in a.variant:
        name, _, args = v.partition("=")
        arms[name] = args.split()
    out = {arm: {"pairs": [], "steps": [], "stated": []} for arm in arms}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = a.keep or scratch
        for rep in range(a.reps):
            for arm, args in arms.items():
                run_dir = os.path.join(tmp, f"{arm}-{rep}")
                bare, diag = common_window(*run_pair(command, args, run_dir, rep % 2 == 0), a.skip)
                if len(bare) < 5 or len(diag) < 5:
                    print(f"rep {rep} {arm}: too few common steps ({len(bare)}, {len(diag)})", flush=True)
                    continue
                ratio = statistics.median(diag) / statistics.median(bare)
                cost = stated_cost(run_dir)
                out[arm]["pairs"].append(ratio)
                out[arm]["steps"].append(
                    [statistics.median(bare), statistics.median(diag), len(bare), len(diag)]
                )
                out[arm]["stated"].append(cost.get("pct") if cost else None)
                # the part the bench can see: on a saturated machine the helpers' CPU slows the
                # bare job beside too, so the pair ratio shows only the in-job part
                in_job = _in_job_pct(cost)
                out[arm].setdefault("stated_in_job", []).append(in_job)
                print(
                    f"rep {rep} {arm:10s}: bare {statistics.median(bare) * 1e3:.2f} ms ({len(bare)} steps), "
                    f"diagnosed {statistics.median(diag) * 1e3:.2f} ms ({len(diag)}): {ratio:.3f}"
                    + (f", states {cost['pct']:.2f} %" if cost and cost.get("pct") is not None else "")
                    + (f" (in the job {in_job:.2f} %)" if in_job is not None else ""),
                    flush=True,
                )
    for arm, r in out.items():
        if r["pairs"]:
            stated = [s for s in r["stated"] if s is not None]
            r["median_pair_ratio"] = statistics.median(r["pairs"])
            r["median_stated_pct"] = statistics.median(stated) if stated else None
            print(
                f"{arm:12s} median of {len(r['pairs'])} side-by-side pair ratios {r['median_pair_ratio']:.4f} "
                f"(pairs {', '.join(f'{x:.3f}' for x in r['pairs'])})"
                + (f"; stated {r['median_stated_pct']:.2f} %" if stated else "")
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": command, "skip": a.skip, "arms": out}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
