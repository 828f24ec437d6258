"""A 1-GPU-per-node NCCL DDP job for bench/gpu_multinode.sh (torchrun --nnodes 2): bf16 MLP
steps, the loss averaged over ranks for logging (an NCCL all_reduce: it only enqueues, so it is
no clock evidence), and a dist.barrier() every --barrier-every steps as jobs do around logging,
evaluation or checkpoints (NCCL's barrier blocks until every rank arrived: clock evidence).
--uneven S: before each barrier the rank (step // barrier_every) mod world works S longer
(its logging or evaluation), so each rank is sometimes the last to reach a barrier."""

import argparse
import os
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--width", type=int, default=4096)
p.add_argument("--barrier-every", type=int, default=2)
p.add_argument("--uneven", type=float, default=0.02)
a = p.parse_args()
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
model = torch.nn.Sequential(
    *[m for _ in range(4) for m in (torch.nn.Linear(a.width, a.width, bias=False), torch.nn.GELU())]
)
model = torch.nn.parallel.DistributedDataParallel(model.cuda().bfloat16())
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
x = torch.randn(4096, a.width, device="cuda", dtype=torch.bfloat16)
for step in range(1, a.steps + 1):
    t = time.perf_counter()
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    logged = loss.detach().clone()
    dist.all_reduce(logged)
    value = logged.item() / world
    if step % a.barrier_every == 0:
        if (step // a.barrier_every) % world == rank:
            time.sleep(a.uneven)  # this rank's extra work before the sync point (logging, eval)
        dist.barrier()
    print(
        f"rank {rank} step {step} loss {value:.6f} time {(time.perf_counter() - t) * 1000:.2f}ms", flush=True
    )
dist.destroy_process_group()
