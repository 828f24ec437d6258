"""What the host sampler (profiler/shim/_traindx_shim/hostsample.py) costs: per sample and per
second, with a training thread that holds the GIL in a torch model's forward (the stack a
sample walks: the job's loop, nn.Module's call machinery, a layer's forward).

Two figures, both CPU time (on a shared machine wall time mostly measures the other processes):
1. per sample: the sampler's own work for one sample (frames, key, run-queue read), timed on the
   sampler thread in a loop while the training thread runs a forward (best of --reps);
2. per second of a run: the sampler thread's CPU over --seconds while the training thread runs
   forwards, as the step end books it (roles.OWN_CPU), its samples and rate.

--shim DIR: the shim package's parent folder (default: this checkout's profiler/shim), to time
an older shim (`git archive <commit> profiler/shim | tar -x -C /tmp/old`, then
--shim /tmp/old/profiler/shim).

usage: OMP_NUM_THREADS=1 python bench/hostsample_cost.py [--seconds 5] [--shim DIR]
"""

import argparse
import os
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--shim", default=os.path.join(ROOT, "profiler", "shim"))
    args = p.parse_args()
    sys.path.insert(0, args.shim)
    os.environ.setdefault("TRAINDX_RUN_DIR", tempfile.mkdtemp(prefix="hostsample-bench-"))
    import _traindx_shim as shim
    import torch
    from _traindx_shim import hostsample, roles
    from _traindx_shim.writer import EventWriter

    events = os.path.join(os.environ["TRAINDX_RUN_DIR"], "events")
    os.makedirs(events, exist_ok=True)
    shim._state["writer"] = EventWriter(events)
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()) for _ in range(8)]
    )
    x = torch.randn(16, 64)
    stop = threading.Event()
    tid = threading.get_ident()

    def train_loop():
        while not stop.is_set():
            model(x)

    # 1. per sample, timed on a second thread while this one runs forwards
    out = []

    def sampler():
        frames = sys._current_frames
        n = 300
        for _ in range(args.reps):
            start = time.thread_time_ns()
            for _ in range(n):
                frame = frames().get(tid)
                if frame is not None:
                    hostsample._key_id(frame)
                    hostsample._runqueue_ns()
                del frame
                time.sleep(0.0005)  # let the training thread run between samples
            out.append((time.thread_time_ns() - start) / n)
        stop.set()

    hostsample._state["tid"] = tid
    hostsample._open_schedstat()
    th = threading.Thread(target=sampler)
    th.start()
    train_loop()
    th.join()
    print(
        f"one sample (its work, the sleep's wake included): best {min(out) / 1e3:.1f} µs of CPU, median {sorted(out)[len(out) // 2] / 1e3:.1f}"
    )

    # 2. per second of a run: the sampler thread as the shim starts it
    stop.clear()
    hostsample.start(tid)
    timer = threading.Timer(args.seconds, stop.set)
    t0 = time.monotonic()
    timer.start()
    cpu0 = {k: v[1] for k, v in roles.OWN_CPU.items()}
    train_loop()
    wall = time.monotonic() - t0
    n = len(hostsample._buf)
    used = sum(v[1] - cpu0.get(k, 0) for k, v in roles.OWN_CPU.items() if v[0] == "traindx-hostsample")
    hostsample.flush(1)
    print(
        f"over {wall:.1f} s: {n} samples ({n / wall:.1f} a second), the sampler's CPU {used / 1e3 / wall:.0f} µs a second"
        f" ({100 * used / 1e9 / wall:.3f} % of a core; {used / 1e3 / max(n, 1):.1f} µs a sample)"
    )


if __name__ == "__main__":
    main()
