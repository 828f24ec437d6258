"""A user's job that calls gc.collect() every step while holding a large object graph (a
metadata index kept as Python objects), so every step pays a full collection."""
import argparse
import gc

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
p.add_argument("--index-size", type=int, default=400_000)
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
    gc.collect()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
