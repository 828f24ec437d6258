"""What the per-step GPU clock costs (profiler/shim/_traindx_shim/gputime.py), on a GPU.

1. One mark (event taken from the pool, recorded on the current stream, host clock read):
   median µs over many, with the GPU busy (the normal case) and idle.
2. One step's bookkeeping at the boundary: query() of each mark, elapsed_time, the emit.
3. Host-to-device copy bandwidth, pinned and pageable (the pageable-copy finding's reference).

    python bench/gpu_view_overhead.py   (prints one JSON object)
"""

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "profiler", "shim"))


def main():
    import torch
    from _traindx_shim import gputime

    emitted = []
    gputime.emit = lambda type_, **f: emitted.append(f)  # measure the bookkeeping, not the disk
    gputime._state["torch"] = torch
    torch.zeros(1, device="cuda")
    assert gputime._cuda_ready()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def per_mark(busy, n=2000):
        times = []
        gputime._state["step"] = 0
        for _ in range(n):
            if busy:
                a @ a
            gputime._state["marks"] = []
            t0 = time.perf_counter_ns()
            for _ in range(10):
                gputime.mark("x")
            times.append((time.perf_counter_ns() - t0) / 10)
            gputime._release(gputime._state["marks"])
        torch.cuda.synchronize()
        return statistics.median(times) / 1000

    per_mark(False, 200)  # pool filled, warm
    idle_us, busy_us = per_mark(False), per_mark(True, 300)

    boundary = []
    for step in range(300):
        for _ in range(8):
            gputime.mark("x")
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        gputime._boundary(step)
        boundary.append((time.perf_counter_ns() - t0) / 1000)
    gputime._harvest(wait=True)

    def bandwidth(pinned, mb=512):
        src = torch.randn(mb * 2**20 // 4)
        if pinned:
            src = src.pin_memory()
        dst = torch.empty_like(src, device="cuda")
        for _ in range(2):
            dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize()
        t = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=pinned)
            torch.cuda.synchronize()
            t.append(time.perf_counter() - t0)
        return src.numel() * 4 / statistics.median(t) / 1e9

    print(
        json.dumps(
            {
                "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "mark_us_gpu_idle": round(idle_us, 2),
                "mark_us_gpu_busy": round(busy_us, 2),
                "boundary_us_8_marks": round(statistics.median(boundary), 1),
                "steps_emitted": len(emitted),
                "h2d_pinned_GBps": round(bandwidth(True), 1),
                "h2d_pageable_GBps": round(bandwidth(False), 1),
            }
        )
    )


if __name__ == "__main__":
    main()
