"""Ranks forked from the parent (torch.multiprocessing.start_processes with start_method="fork",
as Lightning's "ddp_fork" and notebook launchers do)."""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def train(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(6):
        time.sleep(0.3)  # reading a batch
        model(torch.randn(16, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()  # every rank done with its gloo work before teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = sys.argv[1]
    mp.start_processes(train, args=(2,), nprocs=2, start_method="fork")
