"""A user's loop shaped like many tutorials: batches from a DataLoader without pinned memory,
copied with .to(device), and the loss read to the host every step to keep a running sum
(`total += loss.item()`). On a GPU each read waits for every queued kernel and each copy is
staged through pageable memory; on a CPU both are cheap (the job runs as it is anywhere)."""
import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=32)
p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = p.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)
dev = torch.device(args.device)
data = TensorDataset(torch.randn(1024, 64), torch.randn(1024, 1))
loader = DataLoader(data, batch_size=16, shuffle=False)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
total = 0.0
for step, (x, y) in enumerate(loader):
    if step >= args.steps:
        break
    x = x.to(dev)
    y = y.to(dev)
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    total += loss.item()
    if step % 2 == 0:
        print(f"step {step} loss {loss.item():.4f} mean {total / (step + 1):.4f}", flush=True)
