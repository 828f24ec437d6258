"""torch.compile on shapes that change every step: dynamo recompiles (CPU inductor).

A small token-mixing language model compiled with `torch.compile(..., dynamic=False)` (a common setting,
to get static-shape kernels) and trained on batches whose sequence length changes every step,
as with unpadded or bucketed data. Every new length fails dynamo's size guard and compiles the
model again ("tensor 'x' size mismatch at index 1"), until the recompile limit is hit.
`--dynamic true` compiles once with symbolic shapes; `--dynamic auto` lets dynamo turn the
changing dimension dynamic by itself after the first recompile.

    python examples/compile_dynamic.py --steps 4
    diagnose --steps 4 -- python examples/compile_dynamic.py
"""
import argparse
import os
import sys
import time

# one compile worker: a pool of compile subprocesses costs more than it saves on a small CPU
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
import torch.nn as nn
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_tiny import log_line  # noqa: E402  (one log format for every example)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--dynamic", choices=["false", "true", "auto"], default="false",
                   help="torch.compile's dynamic= (false: static shapes; auto: dynamo decides)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--min-len", type=int, default=24)
    p.add_argument("--len-step", type=int, default=8, help="how much the length grows each step")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    return p.parse_args(argv)


class TokenMLP(nn.Module):
    def __init__(self, vocab, d):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        h = self.tok(x)
        # causal running mean over the sequence: the length is part of every shape
        h = h + F.gelu(self.mix(h.cumsum(1) / torch.arange(1, x.shape[1] + 1)[None, :, None]))
        return self.head(h)


def batch(gen, vocab, batch_size, length):
    x = torch.randint(vocab, (batch_size, length + 1), generator=gen)
    x[:, 1:] = (x[:, :-1] * 7 + 3) % vocab  # a deterministic successor: learnable
    return x[:, :-1], x[:, 1:]


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    model = TokenMLP(args.vocab, args.d_model)
    dynamic = {"false": False, "true": True, "auto": None}[args.dynamic]
    compiled = torch.compile(model, dynamic=dynamic)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        length = args.min_len + (step - 1) * args.len_step  # a new sequence length every step
        x, y = batch(gen, args.vocab, args.batch_size, length)
        logits = compiled(x)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        log_line(step, args.steps, (time.perf_counter() - t0) * 1000, args.lr, args.batch_size,
                 loss.item(), args.batch_size * length)
    return 0


if __name__ == "__main__":
    sys.exit(main())
