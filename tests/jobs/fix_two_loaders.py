"""A user's job shaped like pytorch/examples: a train and a test DataLoader built with the same
kwargs, the worker count from its own --workers flag, each sample waits on storage (a sleep)."""
import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
p.add_argument("--read-ms", type=float, default=6.0, help="storage wait per sample")
args = p.parse_args()


class Samples(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(args.read_ms / 1000)  # a read from slow storage
        g = torch.Generator().manual_seed(i)
        return torch.randn(32, generator=g), torch.tensor(float(i % 2))


torch.manual_seed(0)
torch.set_num_threads(1)
kwargs = {"batch_size": args.batch_size}
train_loader = DataLoader(Samples(400), shuffle=False, num_workers=args.workers, **kwargs)
test_loader = DataLoader(Samples(64), shuffle=False, num_workers=args.workers, **kwargs)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
for epoch in range(args.epochs):
    model.train()
    for step, (x, y) in enumerate(train_loader):
        loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
    model.eval()
    with torch.no_grad():
        total = sum(nn.functional.mse_loss(model(x).squeeze(-1), y).item() for x, y in test_loader)
    print(f"epoch {epoch} test loss {total:.4f}", flush=True)
