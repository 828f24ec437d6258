"""A plain training loop whose training thread blocks on a slow read every step (a remote file
system / a slow socket in real jobs): --read-ms per step at the `os.read` line below, outside
the model, the DataLoader and the optimizer. --read-every k: only every k-th step reads."""
import argparse
import os
import threading
import time

import torch
import torch.nn as nn


def slow_storage(read_ms):
    """A pipe answered --read-ms after each request: a read that blocks, wherever it runs."""
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()

    def serve():
        while os.read(req_r, 1):
            time.sleep(read_ms / 1000)
            os.write(rep_w, b"x" * 64)
    threading.Thread(target=serve, daemon=True, name="storage").start()
    return req_w, rep_r


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--read-ms", type=float, default=150)
    p.add_argument("--read-every", type=int, default=1)
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(256, 64), torch.randn(256, 1)
    req, rep = slow_storage(args.read_ms)
    for step in range(args.steps):
        if args.read_ms > 0 and step % args.read_every == 0:
            os.write(req, b"r")
            meta = os.read(rep, 64)  # the slow read
            assert meta
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
