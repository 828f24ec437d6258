"""Cost on the job's thread of the shim's event writer per step: events queued (flushed by the
writer thread every FLUSH_INTERVAL_S) vs written through at every step. The numbers behind the
choice in profiler/shim/_traindx_shim/writer.py.

usage: python bench/writer_cost.py [--steps 20000] [--reps 3]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiler", "shim")
)
from _traindx_shim.writer import EventWriter  # noqa: E402


def per_step_us(writer, steps, through):
    t = time.perf_counter()
    for i in range(steps):  # what a step emits: its end, the next begin, a gc aggregate
        writer.emit("step_end", step=i, source="torch.optim", duration_s=0.0123)
        writer.emit("step_begin", step=i + 1)
        writer.emit("gc", step=i, generation=0, count=3, total_s=1e-4, max_s=5e-5, collected=10)
        if through:
            writer.flush()
    return (time.perf_counter() - t) / steps * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        w = EventWriter(d)
        queued, through = [], []
        for _ in range(a.reps):
            queued.append(per_step_us(w, a.steps, False))
            through.append(per_step_us(w, a.steps, True))
    print(f"queued: median {statistics.median(queued):.1f} us/step {[round(x, 1) for x in queued]}")
    print(
        f"written through each step: median {statistics.median(through):.1f} us/step "
        f"{[round(x, 1) for x in through]}"
    )


if __name__ == "__main__":
    main()
