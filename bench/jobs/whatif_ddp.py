"""A CPU data-parallel job under torchrun (gloo) for the what-if bench (bench/whatif_ddp.sh).

    torchrun --nproc-per-node 4 whatif_ddp.py --sync ddp --slow-rank 1 --slow-ms 30
    torchrun --nproc-per-node 4 whatif_ddp.py --sync allreduce --skew 0.6

--sync ddp        DistributedDataParallel (its all-reduces run inside backward)
--sync allreduce  a blocking all_reduce of each gradient after backward (a hand-written DDP)
--slow-rank R     rank R is a slow worker: each of its layers takes --slow-ms longer, forward
                  and backward alike (hooks: a throttled or faulty host)
--skew X          unequal work: rank r gets rows x (1 + X * (2r/(world-1) - 1)), the global
                  batch unchanged (sequence-length or bucketing imbalance across DP ranks)
--layer-ms T      each layer also waits T ms per --rows rows in forward, 2T in backward: device
                  time stood in by a sleep, so that the step's length follows the work and not the
                  load of a shared 2-core machine (the matmuls themselves stay small)
Healthy twin: the same command without --slow-rank / with --skew 0.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sync", choices=("ddp", "allreduce"), default="ddp")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=20.0)
    p.add_argument("--skew", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, default=256, help="rows per rank per step (before skew)")
    p.add_argument("--layer-ms", type=float, default=0.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    mods = []
    for _ in range(a.layers):
        mods += [torch.nn.Linear(a.width, a.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*mods)
    share = 1.0 + a.skew * (2 * rank / max(1, world - 1) - 1) if world > 1 else 1.0
    rows = max(1, round(a.rows * share))
    device_s = a.layer_ms / 1000.0 * rows / a.rows
    extra_s = a.slow_ms / 1000.0 if rank == a.slow_rank else 0.0

    def on_forward(module, inputs, output):
        time.sleep(device_s + extra_s)

    def on_backward(module, grad_in, grad_out):
        time.sleep(2 * device_s + extra_s)

    if device_s + extra_s > 0:
        for m in model:
            if isinstance(m, torch.nn.Linear):
                m.register_forward_hook(on_forward)
                m.register_full_backward_hook(on_backward)
    net = torch.nn.parallel.DistributedDataParallel(model) if a.sync == "ddp" else model
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(rows, a.width, generator=g), torch.randn(rows, a.width, generator=g)
    for step in range(1, a.steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(net(x), y)
        loss.backward()
        if a.sync == "allreduce":
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= world
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
