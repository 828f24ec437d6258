"""A small decoder-only transformer trained on the CPU: the healthy baseline workload.

Real AdamW, real next-token loss on a seeded synthetic language (a noisy order-3 Markov chain, so
the loss has something to learn), and one Megatron-format log line per step.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_log import log_line  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    p.add_argument("--exit-code", type=int, default=0, help="exit with this code at the end (tests)")
    p.add_argument("--slow-rank", type=int, default=-1,
                   help="under torchrun: this rank sleeps --slow-seconds every step (a straggler)")
    p.add_argument("--slow-seconds", type=float, default=0.2)
    return p.parse_args(argv)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab, d, layers, heads, seq_len):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq_len, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make_batch(gen, table, batch, seq_len, vocab):
    """Sequences from a fixed random order-3 Markov chain with 10 % noise."""
    x = torch.randint(vocab, (batch, seq_len + 1), generator=gen)
    for t in range(3, seq_len + 1):
        nxt = table[(x[:, t - 1] * 31 + x[:, t - 2] * 7 + x[:, t - 3]) % table.numel()]
        keep = torch.rand(batch, generator=gen) > 0.1
        x[:, t] = torch.where(keep, nxt, x[:, t])
    return x[:, :-1], x[:, 1:]


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    table = torch.randint(args.vocab, (4096,), generator=gen)
    model = TinyLM(args.vocab, args.d_model, args.layers, args.heads, args.seq_len)
    rank, world = 0, 1
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        gen.manual_seed(args.seed + 1 + rank)  # each rank its own data
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        x, y = make_batch(gen, table, args.batch_size, args.seq_len, args.vocab)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))
        if rank == args.slow_rank:
            time.sleep(args.slow_seconds)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0:
            log_line(step, args.steps, (time.perf_counter() - t0) * 1000, args.lr,
                     args.batch_size * world, loss.item(), args.batch_size * args.seq_len * world)
    if world > 1:
        dist.destroy_process_group()
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
