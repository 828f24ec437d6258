"""A training script shaped like nanoGPT's train.py: a small GPT, `torch.compile(model)`,
`estimate_loss()` under no_grad at iteration 0 before training, gradient accumulation, and its
log line `iter N: loss X, time Yms, mfu Z%`. Config overrides as nanoGPT takes them
(`--max_iters=20`, `--compile=False`, `--backend=aot_eager`).

--vary_block_size=True: every batch has a different sequence length (unpadded packing).
"""
import sys
import time

import torch
import torch.nn as nn
from torch.nn import functional as F

# -- config (nanoGPT's configurator: --key=value overrides) --------------------------------------
max_iters = 12
eval_interval = 100
eval_iters = 2
gradient_accumulation_steps = 2
batch_size = 4
block_size = 32
n_layer = 2
n_head = 2
n_embd = 32
vocab_size = 128
learning_rate = 1e-3
compile = True
backend = "inductor"
dynamic = False
vary_block_size = False
log_interval = 1
for arg in sys.argv[1:]:
    key, val = arg[2:].split("=")
    globals()[key] = type(globals()[key])(val) if not isinstance(globals()[key], bool) else val == "True"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block() for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets=None):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        n = sum(p.numel() for p in self.parameters())
        flops_per_iter = 6 * n * block_size * fwdbwd_per_iter
        return flops_per_iter / dt / 312e12


data = torch.randint(0, vocab_size, (20000,), generator=torch.Generator().manual_seed(0))
_lengths = iter(list(range(block_size, 8, -1)) * 100)


def get_batch(split):
    t = next(_lengths) if (vary_block_size and split == "train") else block_size
    ix = torch.randint(len(data) - t - 1, (batch_size,))
    x = torch.stack([data[i:i + t] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + t] for i in ix])
    return x, y


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch("val")
            _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


torch.manual_seed(1337)
model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
if compile:
    print("compiling the model... (takes a ~minute)")
    model = torch.compile(model, backend=backend, dynamic=dynamic)

X, Y = get_batch("train")
t0 = time.time()
iter_num = 0
running_mfu = -1.0
while True:
    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    for micro_step in range(gradient_accumulation_steps):
        logits, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")  # prefetch the next batch while the backward runs (on a GPU)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if iter_num % log_interval == 0:
        lossf = loss.item() * gradient_accumulation_steps
        if iter_num >= 5:
            mfu = model.estimate_mfu(batch_size * gradient_accumulation_steps, dt) if not compile else model._orig_mod.estimate_mfu(batch_size * gradient_accumulation_steps, dt)
            running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%")
    iter_num += 1
    if iter_num > max_iters:
        break
