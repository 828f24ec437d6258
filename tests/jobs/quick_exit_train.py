"""Ends the way Ray Train ends its workers: the process group is destroyed, then the process
quits at once (ray.kill: a quick exit, no atexit handlers, no buffered writes flushed)."""
import os
import sys

import torch
import torch.distributed as dist


def main():
    steps = int(sys.argv[1])
    dist.init_process_group("gloo", init_method=f"file://{os.path.abspath('pg_store')}",
                            rank=0, world_size=1)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step + 1} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
