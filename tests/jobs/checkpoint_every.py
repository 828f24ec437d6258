"""A user's job that writes a full checkpoint every --save-every steps, inline."""
import argparse
import os
import tempfile

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=25)
p.add_argument("--save-every", type=int, default=5)
p.add_argument("--width", type=int, default=1024)
args = p.parse_args()

torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(6)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
out = tempfile.mkdtemp(prefix="ckpt-")
x = torch.randn(8, args.width)
for step in range(args.steps):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step % args.save_every == args.save_every - 1:
        for k in range(3):  # slow storage: several full copies
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                       os.path.join(out, f"ckpt-{k}.pt"))
    print(f"step {step} loss {loss.item():.4f}", flush=True)
