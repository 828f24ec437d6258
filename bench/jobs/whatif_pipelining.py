"""A pipeline-parallel job built on torch.distributed.pipelining (PipelineStage + a library
schedule) under torchrun (gloo), for the what-if bench (bench/whatif_pipeline.py): one stage per
rank; the library moves activations and gradients with isend/irecv (batch_isend_irecv) and waits
on the returned works.

    torchrun --nproc-per-node 2 whatif_pipelining.py --split 6,2     # the first stage carries 6 layers
    torchrun --nproc-per-node 2 whatif_pipelining.py --split 4,4     # its balanced twin

--split A,B,...    layers per stage (one entry per rank)
--schedule NAME    gpipe or 1f1b (ScheduleGPipe, Schedule1F1B)
--micro-batches M  micro-batches per step
--layer-ms T       each layer also waits T ms per forward, 2T per backward (device time stood in by
                   a sleep, so that a step follows the layer count, not a shared CPU's load)
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from whatif_pipeline import build_stage  # the same stages as the blocking job (this folder)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--split", default="")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layer-ms", type=float, default=0.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    split = [int(x) for x in a.split.split(",")] if a.split else [4] * world
    if len(split) != world:
        raise SystemExit(f"--split names {len(split)} stages for {world} ranks")
    torch.manual_seed(rank)
    module = build_stage(split[rank], a.width, a.layer_ms / 1000.0, "cpu")
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    loss_fn = lambda y, t: F.mse_loss(y, t)  # noqa: E731
    cls = ScheduleGPipe if a.schedule == "gpipe" else Schedule1F1B
    schedule = cls(stage, n_microbatches=a.micro_batches, loss_fn=loss_fn)
    opt = torch.optim.SGD(module.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    batch = torch.randn(a.rows * a.micro_batches, a.width, generator=g)
    target = torch.randn(a.rows * a.micro_batches, a.width, generator=g)
    first, last = rank == 0, rank == world - 1
    for step in range(1, a.steps + 1):
        opt.zero_grad(set_to_none=True)
        if first:
            schedule.step(batch)
        elif last:
            losses: list[torch.Tensor] = []
            schedule.step(target=target, losses=losses)
            print(f"step {step} loss {sum(float(v.detach()) for v in losses):.4f}", flush=True)
        else:
            schedule.step()
        opt.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
