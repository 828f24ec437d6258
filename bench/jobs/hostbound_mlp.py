"""A healthy host-bound step (issue 47): a 12-block transformer-style MLP (width 512, 16x128
tokens, bf16 autocast on CUDA, fused AdamW, one synchronize per step for timing): ~10 ms a step
on an H100, most of it the host launching small kernels. Prints a nanoGPT-style line per step
(`iter N: loss L, time T ms`), the step time the overhead bench reads.

    python bench/jobs/hostbound_mlp.py [--steps 300] [--width 512] [--blocks 12] [--tokens 2048]
    (--device cpu --width 32 --tokens 64: a tiny CPU run that tests the bench here)
"""

import argparse
import time

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=16 * 128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    dev = torch.device(a.device)
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(a.width) for _ in range(a.blocks)], nn.Linear(a.width, a.width)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    x = torch.randn(a.tokens, a.width, device=dev)
    y = torch.randn(a.tokens, a.width, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for step in range(a.steps):
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        dt = time.perf_counter() - t0
        print(f"iter {step}: loss {loss.item():.4f}, time {dt * 1e3:.2f}ms", flush=True)


if __name__ == "__main__":
    main()
