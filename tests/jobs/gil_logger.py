"""A user's job with a metrics thread that formats statistics in pure Python, holding the GIL."""
import argparse
import threading

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
args = p.parse_args()
stop = threading.Event()


def metrics_reporter():
    history = []
    while not stop.is_set():
        history.append(sum(i * i for i in range(20_000)) % 97)  # pure Python, never releases
        history = history[-100:]


threading.Thread(target=metrics_reporter, name="metrics", daemon=True).start()
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(32, 256)
for step in range(args.steps):
    for _ in range(20):  # many small ops: each needs the GIL back
        loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
stop.set()
