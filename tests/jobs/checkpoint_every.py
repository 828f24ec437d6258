"""A user's job that writes a full checkpoint every --save-every steps, inline."""
import argparse
import atexit
import os
import shutil
import tempfile
import time

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=25)
p.add_argument("--save-every", type=int, default=5)
p.add_argument("--vocab", type=int, default=200_000)
p.add_argument("--save-dir", default=None, help="where the checkpoints go (default: the temp dir)")
p.add_argument("--pause-file", default=None,
               help="a neighbour's load, by construction (tests): if this file exists when the job "
               "starts, each step then waits the number it holds times as long as the step ran")
args = p.parse_args()
pause = 0.0
if args.pause_file and os.path.exists(args.pause_file):
    with open(args.pause_file) as f:
        pause = float(f.read())

torch.manual_seed(0)
torch.set_num_threads(1)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(args.vocab, 64, sparse=True)  # a large table, cheap to train
        self.head = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                                  nn.ReLU(), nn.Linear(1024, 1))

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


model = TinyLM()
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
out = tempfile.mkdtemp(prefix="ckpt-", dir=args.save_dir)
atexit.register(shutil.rmtree, out, True)  # ~220 MB at most: leave no trace in /tmp
previous = []
for step in range(args.steps):
    started = time.perf_counter()
    ids = torch.randint(0, args.vocab, (256, 16))
    loss = model(ids).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step % args.save_every == args.save_every - 1:
        # each checkpoint in files of its own (a fresh write every time, as a job that keeps its
        # newest checkpoint does), the previous one removed
        saved = [os.path.join(out, f"ckpt-{step}-{shard}.pt") for shard in range(2)]
        for path in saved:
            torch.save(model.state_dict(), path)
        for path in previous:
            os.remove(path)
        previous = saved
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    if pause:
        time.sleep(pause * (time.perf_counter() - started))
