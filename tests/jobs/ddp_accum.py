"""DDP with gradient accumulation, as public code writes it (optionally with no_sync())."""
import argparse
import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--no-sync", action="store_true")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])
    model = DDP(net, bucket_cap_mb=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        for micro in range(args.accum):
            x = torch.randn(32, 512)
            last = micro == args.accum - 1
            ctx = model.no_sync() if args.no_sync and not last else contextlib.nullcontext()
            with ctx:
                loss = model(x).pow(2).mean() / args.accum
                loss.backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
