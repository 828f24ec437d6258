"""A user's job whose end-of-step hook (called from the loop, not written in it) runs
gc.collect() while a large object graph lives: every step pays a full collection at the
hook's line, which no static look at the loop finds. The loop does some host work of its own
too, so the shim's samples of the training thread (the ledger's host code) are not empty."""
import argparse
import gc

import torch
from torch import nn


def end_of_step(step, loss):
    gc.collect()
    print(f"step {step} loss {loss:.4f}", flush=True)


p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=14)
p.add_argument("--index-size", type=int, default=300_000)
args = p.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)
index = [{"id": i, "tags": [i, str(i)]} for i in range(args.index_size)]  # lives all run long
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(args.steps):
    x = torch.randn(32, 64)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    seen = sorted(str(i % 997) for i in range(20_000))  # per-step host work in the loop itself
    end_of_step(step, loss.item())
