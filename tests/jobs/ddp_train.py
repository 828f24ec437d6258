"""A small DDP training script as users write them: torchrun-style environment (RANK,
WORLD_SIZE, MASTER_ADDR/PORT), or SLURM's when started by srun (the script sets RANK itself)."""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Noise(torch.utils.data.Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(32, generator=g), torch.randn(1, generator=g)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--worker-start", default=None, help="fork | spawn | forkserver")
    p.add_argument("--io-wait", type=float, default=0.3, help="seconds of simulated reading per step")
    p.add_argument("--reduce-loss", action="store_true",
                   help="average the loss over the ranks for logging (a blocking all_reduce)")
    p.add_argument("--uneven", type=float, default=0.0, metavar="S",
                   help="rank (step mod world size) waits S seconds more for its batch")
    args = p.parse_args()
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:  # srun: no torchrun
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ["LOCAL_RANK"] = os.environ["SLURM_LOCALID"]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(
        Noise(), batch_size=16, num_workers=args.workers,
        multiprocessing_context=args.worker_start if args.workers else None,
        sampler=torch.utils.data.distributed.DistributedSampler(Noise()))
    batches = iter(loader)
    for step in range(args.steps):
        x, y = next(batches)
        time.sleep(args.io_wait + (args.uneven if step % dist.get_world_size() == rank else 0))
        loss = torch.nn.functional.mse_loss(model(x), y)
        if args.reduce_loss:
            logged = loss.detach().clone()
            dist.all_reduce(logged)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {rank} step {step + 1} loss {loss.item():.4f}", flush=True)
    # every rank done with its gloo work before any tears the group down (without it, a rank
    # occasionally aborts in gloo's teardown: "terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
