"""A user's job that writes its outputs where jobs do: a checkpoint and a result file relative
to its working folder, a line appended to a results file given by absolute path, bytes appended
to a large file beside the script; and calls gc.collect() every step over a large object graph
(so `diagnose --fix` has a source patch to try: the candidate runs from a scratch copy)."""
import argparse
import gc
import os

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--index-size", type=int, default=150_000)
p.add_argument("--results", required=True)
args = p.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)
index = [{"id": i, "tags": [i, str(i)]} for i in range(args.index_size)]
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
torch.save(model.state_dict(), "ckpt.pt")
os.makedirs("out", exist_ok=True)
with open(os.path.join("out", "final.txt"), "w") as f:
    f.write(f"final loss {loss.item():.6f} pid {os.getpid()}\n")
with open(args.results, "a") as f:
    f.write(f"run pid {os.getpid()} loss {loss.item():.6f}\n")
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "big.bin"), "ab") as f:
    f.write(b"appended by the job\n")
