"""GPU-side slow steps, each with its fixed twin (run on a GPU; bench/gpu_view.sh runs every pair).

    python bench/jobs/gpu_cases.py --case host_batch            # the batch built by numpy on the CPU
    python bench/jobs/gpu_cases.py --case host_batch --fixed    # ... built on the GPU
    --case pageable      a host-memory dataset copied from pageable memory (fixed: pinned once,
                         non_blocking copies)
    --case empty_cache   torch.cuda.empty_cache() after every step (fixed: not called)
    --case item_sync     a finiteness check read with .item() after every layer (fixed: one
                         on-device check per step, read with the loss)
    --case tiny_kernels  400 narrow layers, a few µs each: launch-bound (fixed: the model's
                         forward and backward replayed from CUDA graphs)

Real AdamW on a regression MLP in bf16; the loss is read once per step and printed (as most
training loops do). Each pair runs the same math for the same number of steps.
"""
import argparse
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

CASES = ("host_batch", "pageable", "empty_cache", "item_sync", "tiny_kernels")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=CASES, required=True)
    p.add_argument("--fixed", action="store_true")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="1/16 of the sizes (a CPU check)")
    return p.parse_args(argv)


# (input width, hidden width, layers, batch)
SHAPES = {"host_batch": (1024, 4096, 8, 8192), "pageable": (8192, 4096, 4, 16384),
          "empty_cache": (4096, 4096, 8, 8192), "item_sync": (2048, 2048, 48, 2048),
          "tiny_kernels": (64, 64, 400, 32)}


class MLP(nn.Module):
    def __init__(self, d_in, width, layers, check_every_layer=False):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, 1)
        self.check_every_layer = check_every_layer

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = F.gelu(layer(x))
            if self.check_every_layer and not torch.isfinite(x).all().item():
                raise FloatingPointError("non-finite activations")
        return self.head(x)


def cpu_batch(rng, batch, d_in):
    """What a host-side pipeline does per batch: draw, standardise per sample, clip."""
    x = rng.standard_normal((batch, d_in), dtype=np.float32)
    x -= x.mean(axis=1, keepdims=True)
    x /= x.std(axis=1, keepdims=True) + 1e-6
    np.clip(x, -4.0, 4.0, out=x)
    return x


def main(argv=None):
    a = parse_args(argv)
    torch.manual_seed(a.seed)
    dev = a.device
    cuda = dev.startswith("cuda")
    d_in, width, layers, batch = SHAPES[a.case]
    if a.small:
        d_in, width, batch = max(8, d_in // 16), max(8, width // 16), max(8, batch // 16)
    model = MLP(d_in, width, layers, check_every_layer=a.case == "item_sync" and not a.fixed)
    model = model.to(dev, torch.bfloat16 if cuda else torch.float32)
    dtype = next(model.parameters()).dtype
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4,
                            fused=a.case == "tiny_kernels" and a.fixed and cuda)
    target_w = torch.randn(d_in, 1, device=dev) / d_in ** 0.5
    rng = np.random.default_rng(a.seed)
    host_data = None
    if a.case == "pageable":
        host_data = [torch.randn(batch, d_in) for _ in range(3)]  # a dataset kept in host memory
        if a.fixed and cuda:
            host_data = [t.pin_memory() for t in host_data]
    step_fn = model
    if a.case == "tiny_kernels" and a.fixed and cuda:
        sample = torch.randn(batch, d_in, device=dev, dtype=dtype)
        step_fn = torch.cuda.make_graphed_callables(model, (sample,))
    t_prev = time.perf_counter()
    for step in range(a.steps):
        if a.case == "host_batch" and not a.fixed:
            x = torch.from_numpy(cpu_batch(rng, batch, d_in)).to(dev)
        elif a.case == "pageable":
            x = host_data[step % len(host_data)].to(dev, non_blocking=a.fixed)
        else:
            x = torch.randn(batch, d_in, device=dev)
        y = x @ target_w
        x = x.to(dtype)
        out = step_fn(x)
        loss = F.mse_loss(out.float(), y)
        if a.case == "item_sync" and a.fixed:
            loss = loss + 0.0 * (~torch.isfinite(out).all()).float()  # checked with the loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = loss.item()
        if a.case == "empty_cache" and not a.fixed and cuda:
            torch.cuda.empty_cache()
        now = time.perf_counter()
        print(f"step {step} loss {value:.4f} ms {(now - t_prev) * 1000:.2f}", flush=True)
        t_prev = now
    return 0


if __name__ == "__main__":
    sys.exit(main())
