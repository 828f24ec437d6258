"""A small training loop that keeps each step's loss: in a list as the tensor itself (with its
autograd graph: `--keep-graph`, a leak that grows every step), in a running sum of the tensors
(`--sum-graph`: one tensor whose graph grows by a step's graph every step), or as a Python
number (the healthy twin). `--cuda`: on the GPU. tests/test_memprice.py runs them under diagnose."""

import sys

import torch

torch.manual_seed(0)
device = "cuda" if "--cuda" in sys.argv else "cpu"
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
history = []
total = 0.0
for step in range(int(sys.argv[1])):
    x, y = torch.randn(64, 64, device=device), torch.randint(0, 10, (64,), device=device)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    if "--keep-graph" in sys.argv:
        history.append(loss)
    elif "--sum-graph" in sys.argv:
        total += loss
    else:
        history.append(loss.item())
        total += loss.item()
print(f"mean loss {float(total or sum(float(v) for v in history)) / int(sys.argv[1]):.3f}")
