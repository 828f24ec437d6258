"""Hot-path cost of the time-ledger spans (profiler/shim/_traindx_shim/spans.py), per call.

Times, in one process, a bare call and the same call wrapped the way the shim wraps it (the
DataLoader iterator's __next__, torch.autograd.backward, the optimizer's global hooks, a CUDA-only
Tensor.item wrapper on a CPU tensor), with the event writer live. Prints ns per call and the
overhead per step for a typical step (1 data wait, 1 backward, 1 optimizer step, 20 CPU .item()).

usage: TRAINDX_RUN_DIR=$(mktemp -d) python bench/span_overhead.py [--calls 200000]
"""

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "profiler", "shim"))
os.environ.setdefault("TRAINDX_RUN_DIR", tempfile.mkdtemp(prefix="span-bench-"))

import _traindx_shim as shim  # noqa: E402
from _traindx_shim import cpustat, spans  # noqa: E402
from _traindx_shim.writer import EventWriter  # noqa: E402


def per_call_ns(fn, calls):
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200_000)
    args = p.parse_args()
    shim._state["writer"] = EventWriter(os.path.join(os.environ["TRAINDX_RUN_DIR"], "bench.jsonl"), "0")

    def work():
        return None

    timed = spans._timed("data", work)
    import torch

    spans._state["compiling"] = torch.compiler.is_dynamo_compiling
    t = torch.ones(())
    item = spans._cuda_only_sync(torch.Tensor.item)
    hooks = lambda: (spans._opt_pre(None, (), {}), spans._opt_post(None, (), {}))
    rows = {
        "bare call": per_call_ns(work, args.calls),
        "timed span (data/backward/io)": per_call_ns(timed, args.calls),
        "optimizer pre+post hooks": per_call_ns(hooks, args.calls),
        "Tensor.item bare (CPU)": per_call_ns(t.item, args.calls),
        "Tensor.item wrapped (CPU: no span)": per_call_ns(lambda: item(t), args.calls),
        # the DataLoader span's run-queue wait: the thread's schedstat read at both ends
        "data span run-queue reads (2 x schedstat)": per_call_ns(
            lambda: (cpustat.runqueue_ns(), cpustat.runqueue_ns()), args.calls
        ),
    }
    shim._state["writer"].flush()
    for name, ns in rows.items():
        print(f"{name:40s} {ns:9.0f} ns/call")
    span = rows["timed span (data/backward/io)"] - rows["bare call"]
    per_step = (
        2 * span
        + rows["data span run-queue reads (2 x schedstat)"]
        + rows["optimizer pre+post hooks"]
        + 20 * (rows["Tensor.item wrapped (CPU: no span)"] - rows["Tensor.item bare (CPU)"])
    )
    print(
        f"overhead per typical step (1 data wait, 1 backward, 1 optimizer step, 20 .item()): "
        f"{per_step / 1000:.1f} µs"
    )


if __name__ == "__main__":
    main()
