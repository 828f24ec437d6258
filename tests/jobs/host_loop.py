"""A plain training loop whose own code slows it between the measured calls (for the host-work
and threads analyzers): a blocking read per step, CPU work on every other step, threads.

    python tests/jobs/host_loop.py --steps 30 --read-seconds 0.08 --odd-seconds 0.05
"""
import argparse
import os
import time

import torch
import torch.nn as nn


def busy(seconds):
    """Pure-Python CPU work for about `seconds` of wall time."""
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        n += 1
    return n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--read-seconds", type=float, default=0.0,
                   help="a blocking read from slow storage every step")
    p.add_argument("--odd-seconds", type=float, default=0.0,
                   help="CPU work on odd steps (every --every-th step)")
    p.add_argument("--every", type=int, default=2, help="the period of --odd-seconds' cost")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: as is)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = nn.Sequential(nn.Linear(a.width, a.width), nn.ReLU(), nn.Linear(a.width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    blob = os.path.abspath(__file__)
    for step in range(a.steps):
        x = torch.randn(64, a.width)
        y = x.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if a.read_seconds:
            with open(blob, "rb") as f:
                f.read()
            time.sleep(a.read_seconds)
        if a.odd_seconds and step % a.every == a.every - 1:
            busy(a.odd_seconds)
        print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
