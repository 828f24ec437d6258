"""The live judgement's rolling window on a long run: rows held and the CPU of one pass.

A run grows to --steps steps (a real recorded CPU job's steady steps repeated, later by one
period each copy: tests/test_live_window.py's generator), read every --piece steps as the live
passes read it (traindx.derive.so_far.EventsSoFar), once with the whole record kept and once with a
window of --keep steps; at a few points: the rows held, the steps a pass sees, and the CPU of
one pass (load + every analyzer) right after the record grew by 2 steps (min of --reps).

    python bench/live_window.py [--steps 3000 --piece 150 --keep 200 --reps 3]
"""

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from test_live_window import _recording, _step_lines  # noqa: E402

from traindx.analyzers import analyze  # noqa: E402
from traindx.derive.run import load_run  # noqa: E402
from traindx.derive.so_far import EventsSoFar  # noqa: E402


def grow(keep, total, piece, reps, points):
    manifest, name, header, blocks, period = _recording()
    run_dir = tempfile.mkdtemp(prefix="live-window-")
    os.makedirs(os.path.join(run_dir, "events"))
    with open(os.path.join(run_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    path = os.path.join(run_dir, "events", name)
    so_far, rows, written = EventsSoFar(keep_steps=keep), [], 0
    for k in range(1, total // piece + 1):
        with open(path, "a") as f:
            f.write("\n".join(_step_lines(header, blocks, period, written, piece)) + "\n")
        written += piece
        analyze(load_run(run_dir, cache=False, so_far=so_far))
        if k * piece in points:
            took = []
            for _ in range(reps):  # a pass right after 2 more steps, as at a step end
                with open(path, "a") as f:
                    f.write("\n".join(_step_lines(header, blocks, period, written, 2)) + "\n")
                written += 2
                t0 = time.process_time()
                run = load_run(run_dir, cache=False, so_far=so_far)
                analyze(run)
                took.append(time.process_time() - t0)
            rows.append(
                {
                    "window": keep,
                    "steps_written": written,
                    "rows_held": so_far.kept_rows(),
                    "steps_in_pass": len(run.steps),
                    "pass_cpu_min_s": round(min(took), 4),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--piece", type=int, default=150)
    ap.add_argument("--keep", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    points = {a.piece, a.steps // 2, a.steps}
    points = {p - p % a.piece for p in points}
    rows = grow(None, a.steps, a.piece, a.reps, points) + grow(a.keep, a.steps, a.piece, a.reps, points)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
