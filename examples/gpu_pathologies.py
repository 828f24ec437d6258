"""GPU training jobs that each reproduce a GPU-side reason a step is slow (run on a GPU).

    python examples/gpu_pathologies.py --pathology launch_bound  # hundreds of tiny kernels per step
    python examples/gpu_pathologies.py --pathology alloc_retries # a capped, fragmented allocator
    python examples/gpu_pathologies.py --pathology power         # large bf16 GEMMs at the power cap
    python examples/gpu_pathologies.py --pathology sync          # .item() after every layer
    python examples/gpu_pathologies.py --pathology none          # healthy: a few large GEMMs

Real AdamW on an MLP regression task; one Megatron-format log line per step.
"""
import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_log import log_line  # noqa: E402

PATHOLOGIES = ("none", "launch_bound", "alloc_retries", "power", "sync")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pathology", choices=PATHOLOGIES, default="none")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--slow-from", type=int, default=0, metavar="STEP",
                   help="from this step on, the loop also waits --slow-ms on the host (an onset)")
    p.add_argument("--slow-ms", type=float, default=50.0)
    return p.parse_args(argv)


def shape_for(pathology):
    """(width, layers, batch): tiny layers make the launch-bound job; wide ones the others."""
    if pathology == "launch_bound":
        return 64, 400, 32
    if pathology == "power":
        return 8192, 8, 16384
    return 4096, 8, 8192


class MLP(nn.Module):
    def __init__(self, width, layers, sync=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, 1)
        self.sync = sync

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
            if self.sync and not torch.isfinite(x).all().item():  # a host-device sync per layer
                raise FloatingPointError("non-finite activations")
        return self.head(x)


def fragment(step, device):
    """A scratch buffer a little larger every step under a memory cap: the cached block of the
    last step is too small, and cached plus new exceed the cap, so the caching allocator frees
    its cache and retries cudaMalloc (num_alloc_retries grows every step)."""
    size = int((1.0 + 0.05 * (step % 20)) * 2 ** 30)
    return torch.empty(size, dtype=torch.uint8, device=device)


def main(argv=None):
    a = parse_args(argv)
    torch.manual_seed(a.seed)
    device = "cuda"
    if a.pathology == "alloc_retries":
        torch.cuda.set_per_process_memory_fraction(0.025)  # ~3.5 GiB of an H200
    width, layers, batch = shape_for(a.pathology)
    dtype = torch.bfloat16
    model = MLP(width, layers, sync=a.pathology == "sync").to(device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    target_w = torch.randn(width, 1, device=device, dtype=dtype) / width ** 0.5
    held = []
    for step in range(1, a.steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x = torch.randn(batch, width, device=device, dtype=dtype)
        y = x @ target_w
        if a.slow_from and step >= a.slow_from:
            time.sleep(a.slow_ms / 1000)  # host work the GPU waits for
        if a.pathology == "alloc_retries":
            held = None  # last step's scratch goes back to the allocator's cache
            held = fragment(step, device)
        loss = F.mse_loss(model(x).float(), y.float())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = loss.item()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1000
        log_line(step, a.steps, ms, a.lr, batch, value)
    del held
    return 0


if __name__ == "__main__":
    sys.exit(main())
