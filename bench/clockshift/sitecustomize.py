"""Benchmark-only stand-in for a host whose wall clock is off: when BENCH_CLOCK_SHIFT_S is set,
this Python process's time.time()/time.time_ns() read that many seconds off (the monotonic clock
and C/C++ code are untouched). bench/gpu_multinode.sh puts this folder on PYTHONPATH of one
"node" when libfaketime (LD_PRELOAD, a real shift of the whole process tree, used by the CPU
tests) is not installed on the GPU machine. Every timestamp traindx records comes from Python's
time.time_ns(), in diagnose and in the shim, so both see the shifted clock. Chains to the next
sitecustomize on sys.path, as the shim does.
"""

import os
import sys
import time

_shift = float(os.environ.get("BENCH_CLOCK_SHIFT_S") or 0)
if _shift:
    _ns, _time_ns, _time = int(_shift * 1e9), time.time_ns, time.time
    time.time_ns = lambda: _time_ns() + _ns
    time.time = lambda: _time() + _shift


def _chain():
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    paths = [os.path.abspath(p or os.curdir) for p in sys.path]
    rest = sys.path[paths.index(here) + 1 :] if here in paths else []
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_chain()
