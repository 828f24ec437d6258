"""A small MLP language model on packed batches whose token count changes every step, normalised
by a Triton RMSNorm: `python train.py --steps 8` (needs a GPU)."""
import argparse
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from fastnorm.kernels import RMSNorm


class Model(nn.Module):
    def __init__(self, vocab, d, layers):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.ModuleDict({"norm": RMSNorm(d), "ff": nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))}) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = x + b["ff"](b["norm"](x))
        return self.head(self.norm(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--min-tokens", type=int, default=6000)
    p.add_argument("--max-tokens", type=int, default=8192)
    args = p.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = Model(args.vocab, args.d_model, args.layers).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(args.steps):
        t0 = time.perf_counter()
        n = int(torch.randint(args.min_tokens, args.max_tokens + 1, (1,), generator=gen))
        ids = torch.randint(args.vocab, (n + 1,), generator=gen).cuda()
        logits = model(ids[:-1])
        loss = F.cross_entropy(logits.float(), ids[1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        print(f"step: {step}  loss: {loss.item():.4f}  time: {1000 * (time.perf_counter() - t0):.1f}ms",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
