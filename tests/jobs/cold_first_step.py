"""A user's loop whose first steady step is several times the others (a one-off: a buffer made
lazily on first use, as minGPT's first optimizer step is 5x its next ones) and that calls
gc.collect() every step while holding a large object graph. Over the first three steps the
one-off is in the steady window (a warm-up is at most half the steps) and dilutes the
collection's share of the step; over four or more it is the warm-up."""
import argparse
import gc

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=16)
p.add_argument("--index-size", type=int, default=150_000)
p.add_argument("--cold-seconds", type=float, default=1.5, help="the one-off in step 1")
p.add_argument("--cold-steps", type=int, default=1, help="how many steps from step 1 pay it")
p.add_argument("--no-collect", action="store_true", help="the healthy twin")
args = p.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)
index = [{"id": i, "tags": [i, str(i)]} for i in range(args.index_size)]  # lives all run long


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if 2 <= self.calls < 2 + args.cold_steps:
            # made on first use after the warm-up batch: seconds of matmuls, once per step
            import time
            t0, a = time.perf_counter(), torch.randn(256, 256)
            while time.perf_counter() - t0 < args.cold_seconds:
                a = torch.tanh(a @ a)
        return self.body(x)


model = Model()
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(args.steps):
    x = torch.randn(32, 64)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if not args.no_collect:
        gc.collect()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
