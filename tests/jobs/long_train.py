"""A small real training loop that runs for a given wall time, not a step count: the stand-in for
a job that runs for days, sped up (tests/test_long_runs.py). Prints one `step N loss X` line per
step and, at the end, `done: N steps`."""
import argparse
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=40)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (bench/gpu_long_run.sh)")
    args = p.parse_args()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x = torch.randn(4096, 32)
    y = (x @ torch.randn(32, 1)).squeeze(1)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    end = time.monotonic() + args.seconds
    step = 0
    while time.monotonic() < end:
        for xb, yb in loader:
            xb, yb = xb.to(dev, non_blocking=True), yb.to(dev, non_blocking=True)
            loss = nn.functional.mse_loss(model(xb).squeeze(1), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"step {step} loss {loss.item():.4f}", flush=True)
            step += 1
            if time.monotonic() >= end:
                break
    print(f"done: {step} steps", flush=True)


if __name__ == "__main__":
    main()
