"""A job whose time goes to garbage collection, stopped by a signal 0.4 s into its loop: a SIGTERM
that its handler turns into sys.exit(143) (what a SLURM or Kubernetes preemption relies on), or
with `--int` a SIGINT (Ctrl-C). Bare, it stops within a few of its 150 steps."""
import gc
import os
import signal
import sys
import threading

sig = signal.SIGINT if "--int" in sys.argv else signal.SIGTERM
if sig == signal.SIGTERM:
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(143))
heap = [[i] for i in range(400_000)]  # a full collection walks every one of them
threading.Timer(0.4, os.kill, (os.getpid(), sig)).start()
for step in range(150):
    gc.collect()
    print(f"step {step + 1}", flush=True)
print("ran 150 of 150 steps")
