"""Hot-path cost of the forward span (the shim's nn.Module.__call__ wrapper, steps.py) and of
the host sampler (hostsample.py), in one process, bare and hooked arms interleaved.

1. Per module call: a model of N nn.Identity submodules (the cheapest module there is: the
   worst case for a per-call cost) called with the wrapper in place vs nn.Module.__call__ as torch
   ships it. One outermost call per forward (it emits the span), N inner calls (one flag read).
2. The sampler: a pure-Python loop (holds the GIL, the sampler has to take it from it) and a
   small CPU model step, with the sampler at TRAINDX_HOST_SAMPLE_HZ vs off.

CPU time, not wall time: the training thread's for the module arms, the process's (the sampler
thread included) for the sampler arms.

usage: OMP_NUM_THREADS=1 python bench/forward_overhead.py [--modules 200] [--reps 7]
"""

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "profiler", "shim"))
os.environ.setdefault("TRAINDX_RUN_DIR", tempfile.mkdtemp(prefix="forward-bench-"))

import _traindx_shim as shim  # noqa: E402
from _traindx_shim import hostsample, steps  # noqa: E402
from _traindx_shim.writer import EventWriter  # noqa: E402


def timed(fn, n, clock=time.thread_time_ns):
    """CPU ns per call of this thread (on a shared, loaded machine wall time mostly measures
    the other processes); the sampler arms pass the process's CPU clock (its own thread too)."""
    start = clock()
    for _ in range(n):
        fn()
    return (clock() - start) / n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--modules", type=int, default=200)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--forwards", type=int, default=2000)
    args = p.parse_args()
    events = os.path.join(os.environ["TRAINDX_RUN_DIR"], "events")
    os.makedirs(events, exist_ok=True)
    shim._state["writer"] = EventWriter(events)
    import torch

    _forward_hooks(torch, args)
    _sampler_overhead(torch, args)
    _sample_cost()
    shim._state["writer"].flush()


def _forward_hooks(torch, args):
    """The forward's cost with the discovery wrapper, then with the outermost module's hooks."""
    import torch.nn as nn

    bare_call = nn.Module.__call__
    steps._state["torch"] = torch
    steps._state["train_thread"] = threading.get_ident()
    steps._forward["discovering"] = True
    steps._sync_forward_hook()
    wrapped_call = nn.Module.__call__
    assert wrapped_call is not bare_call
    model = nn.Sequential(*[nn.Identity() for _ in range(args.modules)])
    x = torch.ones(4)
    model(x)  # discovered: the outermost module

    def arm(call):
        nn.Module.__call__ = call
        return timed(lambda: model(x), args.forwards)

    bare, hooked = [], []
    for _ in range(args.reps):
        bare.append(arm(bare_call))
        hooked.append(arm(wrapped_call))
    b, h = statistics.median(bare), statistics.median(hooked)
    print(f"forward of {args.modules} Identity modules, bare: {b / 1e3:.1f} µs")
    print(
        f"  the first {steps.DISCOVER_STEPS} steps (wrapper): {h / 1e3:.1f} µs, +{(h - b) / 1e3:.2f} µs per"
        f" forward = {(h - b) / (args.modules + 1):.0f} ns per module call ({100 * (h - b) / b:+.1f} %)"
    )
    nn.Module.__call__ = wrapped_call
    steps._discovered()  # the outermost module gets its hooks, the wrapper goes
    assert nn.Module.__call__ is bare_call and id(model) in steps._hooked
    bare, hooked = [], []
    for _ in range(args.reps):
        hooked.append(timed(lambda: model(x), args.forwards))
        for handle in steps._hooked.pop(id(model)):  # the same module without its hooks
            handle.remove()
        bare.append(timed(lambda: model(x), args.forwards))
        steps._hooked[id(model)] = (
            model.register_forward_pre_hook(steps._module_pre),
            model.register_forward_hook(steps._module_post, always_call=True),
        )
    b, h = statistics.median(bare), statistics.median(hooked)
    print(
        f"  from then on (hooks on the outermost module): {h / 1e3:.1f} µs vs {b / 1e3:.1f} µs,"
        f" +{(h - b) / 1e3:.2f} µs per forward ({100 * (h - b) / b:+.1f} %), inner calls untouched"
    )


def _sampler_overhead(torch, args):
    """The sampler: the same work with it on and off (a step in progress, this thread sampled)."""
    lin = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(lin.parameters(), lr=0.01)
    data = torch.randn(64, 256)

    def python_work():
        s = 0
        for i in range(200_000):
            s += i * i
        return s

    def model_step():
        loss = lin(data).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    for name, work, n in (("pure-Python loop", python_work, 5), ("Linear(256) step", model_step, 200)):
        off, on = [], []
        for _ in range(args.reps):
            hostsample._state["running"] = False
            off.append(timed(work, n, time.process_time_ns))
            hostsample.start(threading.get_ident())
            on.append(timed(work, n, time.process_time_ns))
            hostsample.flush(0)
        o, s = statistics.median(off), statistics.median(on)
        print(
            f"{name} with the sampler at {hostsample.RATE_HZ:g} Hz: off {o / 1e6:.3f} ms, "
            f"on {s / 1e6:.3f} ms of CPU ({100 * (s - o) / o:+.2f} %)"
        )


def _sample_cost():
    """The cost of one sample (sys._current_frames + the stack walk + the key look-up) for a
    stack 60 frames deep, taken on the sampler thread while this one holds the GIL."""
    depth_frames = 60

    def deep(k):
        return deep(k - 1) if k else measure_sample()

    def measure_sample():
        tid = threading.get_ident()
        out = {}

        def sampler():
            frames = sys._current_frames
            n = 2000
            start = time.thread_time_ns()
            for _ in range(n):
                hostsample._key_id(frames()[tid])
            out["ns"] = (time.thread_time_ns() - start) / n

        th = threading.Thread(target=sampler)
        th.start()
        th.join()
        return out["ns"]

    per_sample = deep(depth_frames)
    print(
        f"one sample of a {depth_frames}-frame stack: {per_sample / 1e3:.1f} µs of CPU"
        f" = {100 * per_sample * hostsample.RATE_HZ / 1e9:.2f} % of a core at {hostsample.RATE_HZ:g} Hz"
    )


if __name__ == "__main__":
    main()
