"""A job whose steps launch many small kernels: a Triton kernel autotuned again every step (its
key is a length that changes with every batch, as packed batches do) plus thousands of tiny ops.
The torch.profiler window's worst case (FACTS.md §8). On a CPU it runs the tiny ops only.

usage: python bench/profiler_window_job.py [--steps N] [--ops K] [--configs C]
Prints `step i time_s` for every step (perf_counter, after a device sync)."""

import argparse
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--ops", type=int, default=2000, help="tiny elementwise ops per step")
p.add_argument("--configs", type=int, default=8, help="autotune configs (CUDA only)")
args = p.parse_args()
cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"

add = None
if cuda:
    import triton
    import triton.language as tl

    @triton.autotune(
        configs=[
            triton.Config({"BLOCK": 2 ** (5 + i % 6)}, num_warps=2 ** (i % 3)) for i in range(args.configs)
        ],
        key=["n"],
    )
    @triton.jit
    def add_kernel(x, y, out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out + offs, tl.load(x + offs, mask=mask) + tl.load(y + offs, mask=mask), mask=mask)

    def add(x, y):
        out = torch.empty_like(x)
        n = x.numel()
        add_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, out, n)
        return out


w = torch.nn.Parameter(torch.ones(64, device=device))
opt = torch.optim.SGD([w], lr=1e-6)
for step in range(args.steps):
    t0 = time.perf_counter()
    y = w
    for _ in range(args.ops):
        y = y * 1.0001 + 0.0001
    loss = y.sum()
    if add is not None:
        n = 4096 + 64 * step  # a new packed length every step: autotunes again
        x = torch.randn(n, device=device)
        loss = loss + add(x, x).sum() * 0
    loss.backward()
    opt.step()
    opt.zero_grad()
    if cuda:
        torch.cuda.synchronize()
    print(f"step {step} time_s {time.perf_counter() - t0:.4f}", flush=True)
