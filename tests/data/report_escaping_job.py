"""A tiny training job whose strings try to inject HTML: the report must show them as text.

Its busy function is renamed (code object name and file name) to markup, it runs on a thread
named with markup, and it prints markup; py-spy, the shim and the log record all of them.
"""
import sys
import threading
import time

import torch

MARKUP_NAME = "<script>window.__pwned=1</script>"
MARKUP_FILE = "/tmp/<img src=x onerror=window.__pwned=2>.py"
MARKUP_THREAD = "<b onmouseover=window.__pwned=3>worker</b>"


def spin(seconds):
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:  # hold the GIL: py-spy's --gil recorder sees this frame
        n += 1
    return n


spin.__code__ = spin.__code__.replace(co_name=MARKUP_NAME, co_qualname=MARKUP_NAME,
                                      co_filename=MARKUP_FILE)


def main(steps):
    param = torch.nn.Parameter(torch.zeros(16))
    opt = torch.optim.SGD([param], lr=0.1)
    for step in range(steps):
        worker = threading.Thread(target=spin, args=(0.35,), name=MARKUP_THREAD)
        worker.start()
        spin(0.15)
        worker.join()
        loss = ((param - 1.0) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"<script>document.title='pwned'</script> step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
