"""A user's job: per-sample Python feature extraction in Dataset.__getitem__, no workers."""
import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--item-ms", type=float, default=2.0, help="busy CPU time per sample")
p.add_argument("--batch", type=int, default=16)
p.add_argument("--num-workers", type=int, default=0)
p.add_argument("--cpu-clock", action="store_true",
               help="--item-ms is CPU time of the loading thread (fixed work, as real feature "
                    "extraction is), not wall time (which does less work when the CPU is shared)")
args = p.parse_args()


class Tokens(Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        clock = time.thread_time if args.cpu_clock else time.perf_counter
        deadline = clock() + args.item_ms / 1000  # busy, no sleep: pure Python work
        acc = 0
        while clock() < deadline:
            acc = (acc * 31 + i) % 1_000_003
        return torch.full((128,), float(acc % 7)), torch.tensor(float(i % 3))


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
loader = DataLoader(Tokens(), batch_size=args.batch, shuffle=False, num_workers=args.num_workers)
it = iter(loader)
for step in range(args.steps):
    x, y = next(it)
    loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
