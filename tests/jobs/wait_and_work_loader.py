"""A user's job whose Dataset.__getitem__ first waits on storage (a sleep: the thread is off the
CPU) and then decodes (fixed CPU work of the loading thread), no DataLoader workers."""
import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=10)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--wait-ms", type=float, default=5.0, help="storage wait per sample (a sleep)")
p.add_argument("--work-ms", type=float, default=0.5, help="CPU time of the decode per sample")
args = p.parse_args()


class Records(Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        time.sleep(args.wait_ms / 1000)
        deadline = time.thread_time() + args.work_ms / 1000  # CPU seconds, whatever the load
        acc = 0
        while time.thread_time() < deadline:
            acc = (acc * 31 + i) % 1_000_003
        return torch.full((64,), float(acc % 7)), torch.tensor(float(i % 3))


torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
it = iter(DataLoader(Records(), batch_size=args.batch, shuffle=False, num_workers=0))
for step in range(args.steps):
    x, y = next(it)
    loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
