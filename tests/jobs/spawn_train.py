"""DDP started by torch.multiprocessing.spawn: the parent only launches, each child is a rank."""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def train(rank, world_size, steps):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        time.sleep(0.3)  # reading a batch
        loss = model(torch.randn(16, 32)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {rank} step {step + 1} loss {loss.item():.4f}", flush=True)
    dist.barrier()  # every rank done with its gloo work before teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", sys.argv[1])
    mp.spawn(train, args=(2, 6), nprocs=2)
