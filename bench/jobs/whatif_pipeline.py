"""A pipeline-parallel job under torchrun (gloo) for the what-if bench (bench/whatif_pipeline.py,
bench/gpu_pipeline.sh): one stage per rank, a GPipe schedule (every micro-batch's forward, then
every backward) with blocking torch.distributed send/recv of the activations and their gradients.

    torchrun --nproc-per-node 2 whatif_pipeline.py --split 6,2     # the first stage carries 6 layers
    torchrun --nproc-per-node 2 whatif_pipeline.py --split 4,4     # its balanced twin

--split A,B,...   layers per stage (one entry per rank); the twin has the same total, evenly split
--micro-batches M micro-batches per step (GPipe: M forwards, then M backwards on every stage)
--layer-ms T      each layer also waits T ms per forward, 2T per backward: device time stood in
                  by a sleep so that a step follows the layer count and not the load of a shared
                  CPU machine (0 on a GPU: the matmuls are the work)
--device cuda     every stage on cuda:0 (separate processes on one GPU: NCCL refuses two ranks on
                  one device, so gloo moves the activations through the host); each layer ends
                  with a device sync so that the forward/backward spans hold the device time
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def build_stage(layers: int, width: int, layer_s: float, device: str) -> torch.nn.Module:
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    stage = torch.nn.Sequential(*mods).to(device)
    cuda = device.startswith("cuda")

    def on_forward(module, inputs, output):
        if cuda:
            torch.cuda.synchronize()
        if layer_s:
            time.sleep(layer_s)

    def on_backward(module, grad_in, grad_out):
        if cuda:
            torch.cuda.synchronize()
        if layer_s:
            time.sleep(2 * layer_s)

    for m in stage:
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(on_forward)
            m.register_full_backward_hook(on_backward)
    return stage


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--split", default="")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layer-ms", type=float, default=0.0)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    split = [int(x) for x in a.split.split(",")] if a.split else [4] * world
    if len(split) != world:
        raise SystemExit(f"--split names {len(split)} stages for {world} ranks")
    torch.manual_seed(rank)
    device = a.device
    stage = build_stage(split[rank], a.width, a.layer_ms / 1000.0, device)
    opt = torch.optim.SGD(stage.parameters(), lr=1e-4)
    first, last = rank == 0, rank == world - 1
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(a.rows, a.width, generator=g) for _ in range(a.micro_batches)]
    target = [torch.randn(a.rows, a.width, generator=g).to(device) for _ in range(a.micro_batches)]
    host = torch.empty(a.rows, a.width)
    for step in range(1, a.steps + 1):
        opt.zero_grad(set_to_none=True)
        inputs, outputs, losses = [], [], []
        for mb in range(a.micro_batches):  # forwards
            if first:
                x = data[mb].to(device)
            else:
                dist.recv(host, src=rank - 1)
                x = host.to(device, copy=True).requires_grad_()
            y = stage(x)
            inputs.append(x)
            outputs.append(y)
            if last:
                losses.append(F.mse_loss(y, target[mb]) / a.micro_batches)
            else:
                dist.send(y.detach().cpu(), dst=rank + 1)
        for mb in range(a.micro_batches):  # backwards, in the same order
            if last:
                torch.autograd.backward(losses[mb])
            else:
                dist.recv(host, src=rank + 1)
                torch.autograd.backward(outputs[mb], host.to(device))
            if not first:
                dist.send(inputs[mb].grad.detach().cpu(), dst=rank - 1)
        opt.step()
        if last:
            print(f"step {step} loss {sum(float(v) for v in losses):.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
