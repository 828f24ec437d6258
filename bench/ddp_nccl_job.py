"""A tiny 2-rank NCCL DDP job for bench/gpu_ranks.sh: an MLP of --layers square bf16 Linear
layers (--width), --batch rows a step; rank 0 prints a Megatron-format line per step so
bench/overhead.py reads the same step time in the bare and the diagnosed arm."""

import argparse
import os
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--width", type=int, default=8192)
p.add_argument("--batch", type=int, default=8192)
a = p.parse_args()
dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
layers = [torch.nn.Linear(a.width, a.width, bias=False) for _ in range(a.layers)]
model = torch.nn.Sequential(*[m for l in layers for m in (l, torch.nn.GELU())]).cuda().bfloat16()
model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
x = torch.randn(a.batch, a.width, device="cuda", dtype=torch.bfloat16)
for step in range(1, a.steps + 1):
    t = time.perf_counter()
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    value = loss.item()  # one sync a step, in both arms
    ms = (time.perf_counter() - t) * 1000
    if rank == 0:
        print(
            f" iteration {step:8d}/{a.steps:8d} | elapsed time per iteration (ms): {ms:.2f} | "
            f"lm loss: {value:.6E} |",
            flush=True,
        )
dist.destroy_process_group()
