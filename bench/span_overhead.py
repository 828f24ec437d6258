"""Hot-path cost of the time-ledger spans (profiler/shim/_traindx_shim/spans.py), per call.

Times, in one process, a bare call and the same call wrapped the way the shim wraps it (the
DataLoader iterator's __next__, torch.autograd.backward, the optimizer's global hooks, a CUDA-only
Tensor.item wrapper on a CPU tensor), with the event writer live. Prints ns per call and the
overhead per step for a typical step (1 data wait, 1 backward, 1 optimizer step, 20 CPU .item()).

--step-end: also the shim's step-end work, part by part (profiler/shim/_traindx_shim/stepwork.py,
what each step's `cpu` event states as shim_end_ns), best of 5 repetitions of --calls/100 calls.

usage: TRAINDX_RUN_DIR=$(mktemp -d) python bench/span_overhead.py [--calls 200000] [--step-end]
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
from _traindx_shim import cpustat, gcstats, hostsample, memwatch, selfcost, spans, stepwork  # noqa: E402
from _traindx_shim.writer import EventWriter  # noqa: E402


def per_call_ns(fn, calls):
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200_000)
    p.add_argument("--step-end", action="store_true", help="also time the step end's parts")
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
    if args.step_end:
        step_end(torch, max(100, args.calls // 100))


def best_of(fn, calls, reps=5):
    """ns per call: the best of `reps` timings (a loaded machine only adds)."""
    return min(per_call_ns(fn, calls) for _ in range(reps))


def step_end(torch, calls):
    """The step end's parts, as stepwork.evidence runs them on a CPU job (torch imported)."""
    shim._state["run_dir"] = os.environ["TRAINDX_RUN_DIR"]
    shim._start_writer(False)  # a real writer: its thread flushes to disk as in a run
    memwatch._state["hunted"] = True  # this loop's queued events grow the heap: no memory hunt
    selfcost.BUDGET_PCT = 0  # the default path, never shed (the loop's own cost would shed it)
    step = [10]

    def whole():
        step[0] += 1
        stepwork.evidence(step[0], 10_000_000, torch, True)

    rows = {
        "gc aggregate (gcstats.emit_step)": lambda: gcstats.emit_step(10),
        "cpu evidence (cpustat.emit_step)": lambda: cpustat.emit_step(10),
        "  /proc/stat + /proc/loadavg": cpustat._proc_stat,
        "  schedstat (run-queue wait)": cpustat.runqueue_ns,
        "own cost (selfcost.step_fields)": lambda: selfcost.step_fields(1, 10_000_000),
        "host samples flush (none pending)": lambda: hostsample.flush(10),
        "allocator stats (CPU: none)": lambda: stepwork.emit_alloc(10, torch),
        "memory: rss (statm)": memwatch.rss_bytes,
        "memory: heap (mallinfo2)": memwatch.heap_bytes,
        "one event emitted": lambda: shim.emit("span", cat="forward", start=1, t=2, tid=3),
        "the whole step end (stepwork.evidence)": whole,
    }
    if torch.cuda.is_available():  # the GPU path: what the allocator's stats cost a step
        torch.cuda.init()
        rows["allocator stats, the nested dict (read every step before)"] = (
            torch.cuda.memory_stats_as_nested_dict
        )
        rows["torch.cuda.memory_allocated() (flattens the same dict)"] = torch.cuda.memory_allocated
        rows["allocator stats on the clock (stepwork.emit_alloc)"] = lambda: stepwork.emit_alloc(
            step[0], torch
        )
    for name, fn in rows.items():
        print(f"{name:40s} {best_of(fn, calls) / 1000:9.1f} µs")


if __name__ == "__main__":
    main()
