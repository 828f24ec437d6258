"""A small multi-rank training job with one slow rank, as stragglers happen in real jobs.

    torchrun --nproc-per-node 2 straggler_train.py --sync allreduce --slow-rank 1 --cause gc

--sync: how the ranks meet each step
  allreduce  blocking per-parameter gradient all_reduce after backward, then a loss all_reduce
  ddp        DistributedDataParallel (its gradient all-reduces run in C++ inside backward),
             plus the usual blocking all_reduce of the loss for logging
  pipeline   two pipeline stages: stage 0 sends its activations to stage 1 (send/recv), stage 1
             computes the loss and sends the activation gradient back; no straggler, only the
             bubble each stage spends waiting for the other (--grad-norm: plus an all_reduce of
             the gradient norm over the stages, where stage 0 always arrives last)
--cause: what the slow rank does in each step before it reaches the collective
  sleep      time.sleep (host work of any kind: logging, evaluation on one rank)
  compute    extra matmuls
  gc         gc.collect() over a large live heap (a GC storm on one rank)
  data       its DataLoader's __getitem__ is slow (a slow shard / storage on one rank)
  compile    a torch.compile'd function fed a new shape every step: it recompiles in each step
  gpu        (CUDA) about --slow-seconds of large matmuls queued on its GPU, no host wait: the
             rank is slow on its GPU only (as a throttled or slower GPU is)
Works with gloo on the CPU and NCCL on GPUs (--device cuda, one GPU per rank by LOCAL_RANK).
"""
import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


class Batches(torch.utils.data.Dataset):
    def __init__(self, width, delay_s):
        self.width, self.delay_s = width, delay_s

    def __len__(self):
        return 1_000_000

    def __getitem__(self, i):
        if self.delay_s:
            time.sleep(self.delay_s)
        g = torch.Generator().manual_seed(i)
        return torch.randn(self.width, generator=g), torch.randn(1, generator=g)


def mlp(width, layers):
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sync", choices=("allreduce", "ddp", "pipeline"), default="allreduce")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--cause", choices=("sleep", "compute", "gc", "data", "compile", "gpu"), default="sleep")
    p.add_argument("--slow-seconds", type=float, default=0.2)
    p.add_argument("--heap", type=int, default=1_000_000, help="gc: live objects on the slow rank")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rows", type=int, default=0,
                   help="rows per step on the device (the batch repeated): GPU-sized steps")
    p.add_argument("--grad-norm", action="store_true",
                   help="pipeline: all-reduce the gradient norm over the stages every step")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cuda = a.device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    slow = rank == a.slow_rank
    heap = [[i] for i in range(a.heap)] if slow and a.cause == "gc" else None
    delay = a.slow_seconds / a.batch if slow and a.cause == "data" else 0.0
    loader = torch.utils.data.DataLoader(Batches(a.width, delay), batch_size=a.batch,
                                         sampler=torch.utils.data.distributed.DistributedSampler(
                                             Batches(a.width, 0.0), num_replicas=world, rank=rank))
    batches = iter(loader)
    model = mlp(a.width, a.layers).to(device)
    if a.sync == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    head = torch.nn.Linear(a.width, 1).to(device)
    opt = torch.optim.SGD(list(model.parameters()) + list(head.parameters()), lr=1e-3)
    spin = torch.randn(256, 256, device=device)
    big, n_big = None, 0
    if slow and a.cause == "gpu" and cuda:
        big = torch.randn(8192, 8192, device=device)
        big @ big
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            big @ big
        torch.cuda.synchronize()
        n_big = max(1, round(a.slow_seconds / ((time.perf_counter() - t) / 5)))
    if slow and a.cause == "compile":
        torch._dynamo.config.recompile_limit = 10_000
        torch._dynamo.config.automatic_dynamic_shapes = False
        scale = torch.compile(lambda t: (t * 2 + 1).sin().sum(), backend="aot_eager", dynamic=False)

    def slow_work():
        if not slow:
            return
        if a.cause == "sleep":
            time.sleep(a.slow_seconds)
        elif a.cause == "gc":
            gc.collect()
        elif a.cause == "compute":
            end = time.perf_counter() + a.slow_seconds
            while time.perf_counter() < end:
                spin @ spin
            if cuda:
                torch.cuda.synchronize()
        elif a.cause == "gpu" and big is not None:
            for _ in range(n_big):
                big @ big  # queued: the host goes on at once
        elif a.cause == "compile":
            scale(torch.ones(step + 1, device=device))  # a new shape: a new graph, every step

    for step in range(1, a.steps + 1):
        x, y = next(batches)  # the data cause is slow here, on the slow rank only
        x, y = x.to(device), y.to(device)
        if a.rows > x.shape[0]:
            x, y = x.repeat(a.rows // x.shape[0], 1), y.repeat(a.rows // y.shape[0], 1)
        opt.zero_grad(set_to_none=True)
        if a.sync == "pipeline":
            slow_work()  # before the stage's part of the step
            loss = pipeline_step(model, head, x, y, rank)
        else:
            if a.sync == "ddp":
                slow_work()  # before forward: the other ranks wait inside DDP's backward
            loss = F.mse_loss(head(model(x)), y)
            loss.backward()
            if a.sync == "allreduce":
                slow_work()  # after backward, before the gradient all-reduce
                for prm in list(model.parameters()) + list(head.parameters()):
                    dist.all_reduce(prm.grad)
                    prm.grad /= world
        if a.sync == "pipeline" and a.grad_norm:
            # the global gradient norm over all stages (clipping): a collective across stages
            norm = torch.stack([q.grad.norm() for q in model.parameters()]).norm().pow(2)
            dist.all_reduce(norm)
        opt.step()
        if a.sync != "pipeline":
            logged = loss.detach().clone()
            dist.all_reduce(logged)  # the mean loss for the log line, every step
            loss = logged / world
        value = loss.item()  # every rank reads its loss (a host sync on a GPU), rank 0 logs it
        if rank == 0:
            print(f"step {step} loss {value:.4f}", flush=True)
    del heap
    # every rank done before any closes its connections (gloo can abort a rank whose peer tore
    # down first: seen once beside a loaded run)
    dist.barrier()
    dist.destroy_process_group()


def pipeline_step(model, head, x, y, rank):
    """Stage 0: its MLP; stage 1: its MLP, the head and the loss. Activations forward, gradients back."""
    if rank == 0:
        act = model(x)
        dist.send(act.detach().contiguous(), dst=1)
        grad = torch.empty_like(act)
        dist.recv(grad, src=1)  # stage 0's bubble: stage 1's forward and backward
        act.backward(grad)
        return act.detach().pow(2).mean()
    act = torch.empty(x.shape[0], x.shape[1], device=x.device)
    dist.recv(act, src=0)  # stage 1's bubble: stage 0's forward
    act.requires_grad_(True)
    loss = F.mse_loss(head(model(act)), y)
    loss.backward()
    dist.send(act.grad.contiguous(), dst=0)
    return loss.detach()


if __name__ == "__main__":
    main()
