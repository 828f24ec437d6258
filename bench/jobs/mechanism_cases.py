"""Causes no rule of traindx is named after, each with its fixed twin (issue 46): the places table
and its mechanisms (derive/places.py, analyzers/gpu_places.py) must find them on their own.

  --case checkpoint  a small transformer with activation checkpointing around every block
                     (torch.utils.checkpoint, non-reentrant); twin: the blocks called directly
  --case nchw        a bf16 conv net with BatchNorm in the default NCHW layout; twin: the model
                     and its inputs in torch.channels_last
  --case cast        a bf16-autocast MLP whose output projection casts its input to float32
                     and runs with autocast off (a "keep the head in fp32" habit); twin: no cast

Each step prints `step N loss X ms Y` (the job's own step time). --small: tiny sizes, runs on the
CPU (a check of the code, no timing meaning).
"""

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

CASES = ("checkpoint", "nchw", "cast")


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, width, heads, depth, vocab, recompute):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.out = nn.Linear(width, vocab)
        self.recompute = recompute

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        return self.out(x)


def conv_bn(cin, cout, stride):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
    )


class ConvNet(nn.Module):
    def __init__(self, width, classes):
        super().__init__()
        w = width
        self.stem = conv_bn(3, w, 1)
        self.stages = nn.Sequential(
            conv_bn(w, w, 1),
            conv_bn(w, 2 * w, 2),
            conv_bn(2 * w, 2 * w, 1),
            conv_bn(2 * w, 4 * w, 2),
            conv_bn(4 * w, 4 * w, 1),
        )
        self.fc = nn.Linear(4 * w, classes)

    def forward(self, x):
        return self.fc(self.stages(self.stem(x)).mean((2, 3)))


class MLP(nn.Module):
    def __init__(self, width, depth, classes, fp32_head):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, classes)
        self.fp32_head = fp32_head

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        if self.fp32_head:
            with torch.autocast(x.device.type, enabled=False):
                return self.head(x.float())
        return self.head(x)


def build(a, dev):
    """(model, batch maker) of one case and arm."""
    bad = not a.fixed
    if a.case == "checkpoint":
        width, heads, depth, vocab, batch, seq = (
            (64, 4, 2, 128, 2, 32) if a.small else (1024, 16, 8, 8192, 16, 1024)
        )
        model = Transformer(width, heads, depth, vocab, recompute=bad).to(dev)

        def make():
            idx = torch.randint(0, vocab, (batch, seq + 1), device=dev)
            return idx[:, :-1], idx[:, 1:]

        return model, make
    if a.case == "nchw":
        width, batch, size, classes = (8, 4, 16, 10) if a.small else (64, 128, 112, 1000)
        model = ConvNet(width, classes).to(dev)
        if not bad:
            model = model.to(memory_format=torch.channels_last)

        def make():
            x = torch.randn(batch, 3, size, size, device=dev)
            if not bad:
                x = x.to(memory_format=torch.channels_last)
            return x, torch.randint(0, classes, (batch,), device=dev)

        return model, make
    width, depth, classes, batch = (64, 2, 64, 32) if a.small else (4096, 4, 16384, 8192)
    model = MLP(width, depth, classes, fp32_head=bad).to(dev)

    def make():
        return torch.randn(batch, width, device=dev), torch.randint(0, classes, (batch,), device=dev)

    return model, make


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=CASES, required=True)
    p.add_argument("--fixed", action="store_true")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--small", action="store_true", help="tiny sizes (a CPU check of the code)")
    a = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model, make = build(a, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda")
    t_prev = time.perf_counter()
    for step in range(a.steps):
        x, y = make()
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = loss.item()
        now = time.perf_counter()
        print(f"step {step} loss {value:.4f} ms {(now - t_prev) * 1000:.2f}", flush=True)
        t_prev = now
    return 0


if __name__ == "__main__":
    sys.exit(main())
